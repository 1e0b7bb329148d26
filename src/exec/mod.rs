//! The engine: the one pipeline behind every face.
//!
//! request → validate (the rules of [`crate::shape`]) → plan → dispatch (the CPU kernels
//! of [`crate::cpu`], or the CUDA launchers of `cuda/` through [`cuda`]) → backward
//! composition (`dA = dC·Bᵀ`, `dB = Aᵀ·dC` on transposed descriptions, no copies), for
//! the packed and the list forms, written once; the gathered products of the MoE layer
//! ([`packed_gather`], and [`packed_gather_k`] for its weight gradients), the fused expert products ([`fused`]: a GroupedM product with a
//! SwiGLU or dGated epilogue) and the row ops of the MoE glue ([`rows`]) go the same way.
//! See ARCHITECTURE.md.
//!
//! The engine never sees a Python object or an ndarray type. A face ([`crate::api`] on
//! ndarray, `crate::python` on torch tensors and numpy arrays) describes each array as a
//! [`Tensor`] (address, dtype, [`Layout`], [`Device`]) or an [`IntTensor`] (`offs`, an
//! index), and lends what its runtime provides through [`Runtime`]: fresh outputs, CUDA
//! workspaces and argument blocks, normalised copies of operands no kernel can read in
//! place, the current CUDA stream, the TF32 flag, and a way to run the CPU kernels (e.g.
//! with the GIL released).
//!
//! Every check happens before anything is allocated or written: on error the caller's
//! buffers are untouched.
//!
//! This file is the GEMM pipeline (packed and list forms, forward and backward); the
//! vocabulary it and its siblings speak is [`vocab`], the operand and output
//! normalisation they share is [`operands`]: no module of `exec/` imports from this one.

// The ndarray face runs on the CPU only: without the Python face, or in a build without
// CUDA, the CUDA half of the engine (devices, workspaces, the launchers) has no caller.
#![cfg_attr(any(not(feature = "python"), not(groupmm_cuda)), allow(dead_code))]

pub(crate) mod cuda;
pub(crate) mod ffi;
pub(crate) mod fused;
mod operands;
pub(crate) mod rows;
mod vocab;

use operands::{check_out, contiguous_int32, into_target, writes_in_place, Operands};
use rows::gather_rows;
pub use vocab::{Device, Grads, IntTensor, Output, Runtime, Tensor};

use crate::cpu;
use crate::dtype::DType;
use crate::error::Result;
use crate::layout::Transposable;
use crate::shape::{self, GroupDims, Item, PackedDims};
use half::{bf16, f16};

/// Runs `$body` with `$TI`, `$TO` bound to the element types of the runtime dtypes
/// `$ti`, `$to` (every pair: the ndarray face chooses its output type freely).
macro_rules! with_types {
    ($ti:expr, $to:expr, |$TI:ident, $TO:ident| $body:block) => {
        with_types!(@in $ti, $to, $TI, $TO, $body,
            [F16 f16] [BF16 bf16] [F32 f32] [F64 f64])
    };
    (@in $ti:expr, $to:expr, $TI:ident, $TO:ident, $body:block, $([$v:ident $t:ty])*) => {
        match $ti {
            $(DType::$v => {
                #[allow(dead_code)]
                type $TI = $t;
                with_types!(@out $to, $TO, $body, [F16 f16] [BF16 bf16] [F32 f32] [F64 f64])
            })*
        }
    };
    (@out $to:expr, $TO:ident, $body:block, $([$v:ident $t:ty])*) => {
        match $to {
            $(DType::$v => {
                #[allow(dead_code)]
                type $TO = $t;
                $body
            })*
        }
    };
}

// ---------------------------------------------------------------------------------
// Packed forms
// ---------------------------------------------------------------------------------

/// The checks of a packed product: dtypes and devices agree, shapes make a form.
fn validate_packed(a: &Tensor, b: &Tensor, offs: Option<&IntTensor>) -> Result<PackedDims> {
    shape::check_like("b", b.like(), "a", a.reference())?;
    let offs_len = match offs {
        Some(o) => {
            shape::check_like("offs", (None, o.device), "a", a.reference())?;
            Some(shape::offs_len(&o.layout)?)
        }
        None => None,
    };
    shape::plan_packed(&a.layout, &b.layout, offs_len)
}

/// `offs` values on the host (CPU calls), checked; CUDA calls never read them.
///
/// # Safety
/// `offs` describes live host memory when its device is the CPU.
unsafe fn host_offs(offs: Option<&IntTensor>, plan: &PackedDims) -> Result<Option<Vec<i32>>> {
    let Some(o) = offs.filter(|o| o.device == Device::Cpu) else {
        return Ok(None);
    };
    let (n, s) = (o.layout.shape[0], o.layout.strides[0]);
    let vals: Vec<i32> = (0..n)
        // SAFETY: a live 1-D int32 host array of n elements with stride s (contract).
        .map(|i| unsafe { *((o.ptr as *const i32).offset(i as isize * s)) })
        .collect();
    shape::check_offs(&vals, plan)?;
    Ok(Some(vals))
}

/// Grouped product of a packed form into `out` (allocated when `None`); returns the
/// output object.
///
/// # Safety
/// Every description is of live memory on its device for the whole call (inputs
/// readable, `out` writable), as [`Runtime`] promises for what it lends.
pub unsafe fn packed<R: Runtime>(
    rt: &mut R,
    a: &Tensor,
    b: &Tensor,
    offs: Option<&IntTensor>,
    out_dtype: Option<DType>,
    out: Option<Output<R::Out>>,
) -> Result<R::Out> {
    let dtype = out_dtype.unwrap_or(a.dtype);
    let plan = validate_packed(a, b, offs)?;
    if let Some((_, o)) = &out {
        check_out(
            "out",
            o,
            &plan.out_shape,
            dtype,
            ("a", a),
            [("a", a), ("b", b)],
        )?;
    }
    // SAFETY: forwarded contract.
    let offs_vals = unsafe { host_offs(offs, &plan)? };
    let ops = Operands::prepare(rt, &[a, b], offs)?;
    let (a, b) = (&ops.t[0], &ops.t[1]);
    into_target(rt, out, &plan.out_shape, dtype, a.device, |rt, c| {
        // SAFETY: forwarded contract; `c` is a fresh output or the checked `out`.
        unsafe { run_packed(rt, &plan, a, b, ops.offs.as_ref(), offs_vals.as_deref(), c) }
    })
}

/// Both backward products of a packed form: `dA = grad·bᵀ`, `dB = aᵀ·grad` (same
/// `offs`), each only when asked for, with dtype `out_dtype` (default: `a`'s).
///
/// # Safety
/// As [`packed`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn packed_backward<R: Runtime>(
    rt: &mut R,
    grad: &Tensor,
    a: &Tensor,
    b: &Tensor,
    offs: Option<&IntTensor>,
    need_a: bool,
    need_b: bool,
    out_dtype: Option<DType>,
) -> Result<Grads<R::Out>> {
    shape::check_like("grad", grad.like(), "a", a.reference())?;
    let fwd = validate_packed(a, b, offs)?;
    shape::check_grad("grad", &grad.layout, &fwd.out_shape)?;
    // SAFETY: forwarded contract.
    let offs_vals = unsafe { host_offs(offs, &fwd)? };
    if !(need_a || need_b) {
        return Ok((None, None));
    }
    let dtype = out_dtype.unwrap_or(a.dtype);
    // Kernel-readable inputs, copied (CUDA) at most once for both products.
    let ops = Operands::prepare(rt, &[grad, a, b], offs)?;
    // The gradients follow the layouts of the inputs as given (before any copy).
    let t = if rt.can_transpose() {
        shape::transposed_grads(&a.layout, &b.layout)
    } else {
        [false; 2]
    };
    let [(ga, gb), (ha, hb)] = shape::backward_layouts(&ops.t[0], &ops.t[1], &ops.t[2], t);
    let offs_len = offs.map(|o| o.layout.shape[0]);
    let product = |rt: &mut R, x: &Tensor, y: &Tensor, swapped: bool| -> Result<R::Out> {
        let plan = shape::plan_packed(&x.layout, &y.layout, offs_len)?;
        let o = into_target(rt, None, &plan.out_shape, dtype, x.device, |rt, c| {
            // SAFETY: forwarded contract; `c` is a fresh output.
            unsafe { run_packed(rt, &plan, x, y, ops.offs.as_ref(), offs_vals.as_deref(), c) }
        })?;
        if swapped {
            rt.transposed(o)
        } else {
            Ok(o)
        }
    };
    let da = if need_a {
        Some(product(rt, &ga, &gb, t[0])?)
    } else {
        None
    };
    let db = if need_b {
        Some(product(rt, &ha, &hb, t[1])?)
    } else {
        None
    };
    Ok((da, db))
}

/// The GroupedM product with gathered rows, the MoE forward on tokens kept in token
/// order: `out[r] = x[src[r]] · w[g]` for the rows `r` of group `g` (`offs` over the `R`
/// rows of `src`, the token of each routed row); a row whose `src` is outside
/// `[0, rows of x)` is a zero row (rule: [`shape::plan_gather`]). The CUDA side may read
/// the rows through `src` itself (groupmm's gathering varlen kernel, only with
/// `GROUPMM_SM90_GATHER=1`: no `[R, K]` copy); otherwise, and on the CPU, the rows are
/// gathered first (the row op `GatherSum` with `src` as a one-column `inverse`: row `r`
/// sums the one row `src[r]`) and the plain product runs.
///
/// # Safety
/// As [`packed`].
pub unsafe fn packed_gather<R: Runtime>(
    rt: &mut R,
    x: &Tensor,
    src: &IntTensor,
    w: &Tensor,
    offs: &IntTensor,
    out_dtype: Option<DType>,
) -> Result<R::Out> {
    let dtype = out_dtype.unwrap_or(x.dtype);
    shape::check_like("w", w.like(), "x", x.reference())?;
    shape::check_like("src", (None, src.device), "x", x.reference())?;
    shape::check_like("offs", (None, offs.device), "x", x.reference())?;
    let plan = shape::plan_gather(
        &x.layout,
        &w.layout,
        &src.layout,
        shape::offs_len(&offs.layout)?,
    )?;
    // SAFETY: forwarded contract.
    let offs_vals = unsafe { host_offs(Some(offs), &plan)? };
    let ops = Operands::prepare(rt, &[x, w], Some(offs))?;
    let (x, w, offs) = (&ops.t[0], &ops.t[1], ops.offs.as_ref());
    let src = contiguous_int32(rt, src)?;
    into_target(rt, None, &plan.out_shape, dtype, x.device, |rt, c| {
        if let Device::Cuda(_) = x.device {
            // SAFETY: forwarded contract; `c` is a fresh output.
            let gather = cuda::Fusion {
                src: Some(&src),
                ..cuda::Fusion::default()
            };
            if unsafe { cuda::packed(rt, &plan, x, w, offs, &gather, c)? } {
                return Ok(());
            }
        }
        // SAFETY: forwarded contract.
        let (_keep, a) = unsafe { gather_rows(rt, x, &src)? };
        // SAFETY: as for `packed`; `a` is alive until `_keep` drops, after the product.
        unsafe { run_packed(rt, &plan, &a, w, offs, offs_vals.as_deref(), c) }
    })
}

/// The GroupedK product with gathered rows, the weight gradient of the MoE layer on
/// tokens kept in token order (no `[R, K]` copy of them): `out[g] = Σ a_rᵀ · b_r` over the
/// routed rows `r` of group `g` (`offs` over the `R = len(src)` rows), `[G, K, N]` of
/// `a`'s dtype, zeros for empty groups, with `a_r = a[src[r]]`, `b_r = b[r]`, or with
/// `gathered_b`, `a_r = a[r]`, `b_r = b[src[r]]` (rule: [`shape::plan_gather_k`]). With
/// `transposed`, the same values computed as `(Σ b_rᵀ · a_r)ᵀ`: the transposed view of a
/// fresh contiguous `[G, N, K]` (the gradient of a column-major weight in its own layout,
/// as [`packed_backward`] gives it). `out`, when given, is written instead of a fresh
/// output (checked by [`check_out`]): in place wherever the kernels can describe it as
/// row-major ([`writes_slab_in_place`]), so that a caller can fill a slab of a larger
/// gradient (the MoE backward gathers `x` one slab of its columns at a time), else
/// through a fresh output copied into it.
///
/// On CUDA, one GroupedK request whose `Fusion` reads the routed rows through `src`
/// (`src_b` when the gathered operand is the product's B); where the bridge answers
/// `Unsupported`, and on the CPU, the rows are gathered first ([`gather_rows`]) and the
/// plain GroupedK product runs. An index out of range is an error: on the CPU at once
/// (the row op's host rule, [`shape::check_indices`]), on CUDA at the next call.
///
/// # Safety
/// As [`packed`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn packed_gather_k<R: Runtime>(
    rt: &mut R,
    a: &Tensor,
    b: &Tensor,
    offs: &IntTensor,
    src: &IntTensor,
    gathered_b: bool,
    transposed: bool,
    out: Option<Output<R::Out>>,
) -> Result<R::Out> {
    shape::check_like("b", b.like(), "a", a.reference())?;
    shape::check_like("src", (None, src.device), "a", a.reference())?;
    shape::check_like("offs", (None, offs.device), "a", a.reference())?;
    let plan = shape::plan_gather_k(
        &a.layout,
        &b.layout,
        &src.layout,
        shape::offs_len(&offs.layout)?,
        gathered_b,
        transposed,
    )?;
    if let Some((_, t)) = &out {
        let mut shape = plan.out_shape.clone();
        if transposed {
            shape.swap(1, 2);
        }
        check_out("out", t, &shape, a.dtype, ("a", a), [("a", a), ("b", b)])?;
    }
    // SAFETY: forwarded contract.
    let offs_vals = unsafe { host_offs(Some(offs), &plan)? };
    // The product that runs, `Σ first_rᵀ · second_r`; `src_b`: `src` indexes the rows of
    // `second` (swapped operands swap which one is gathered).
    let (first, second, src_b) = if transposed {
        (b, a, !gathered_b)
    } else {
        (a, b, gathered_b)
    };
    let ops = Operands::prepare(rt, &[first, second], Some(offs))?;
    let (first, second, offs) = (&ops.t[0], &ops.t[1], ops.offs.as_ref());
    let src = contiguous_int32(rt, src)?;
    let run = |rt: &mut R, c: &Tensor| -> Result<()> {
        // The gathered operand, and the first one (read transposed, as the backward's
        // dB = aᵀ·grad reads it), row-major as the kernels' `Fusion` wants them; the
        // fallback below reads the same tensors (no second copy).
        let (x, y) = match first.device {
            Device::Cuda(_) => {
                let x = cuda::row_major(rt, first)?;
                let y = if src_b {
                    cuda::row_major(rt, second)?
                } else {
                    second.clone()
                };
                let gather = cuda::Fusion {
                    src: Some(&src),
                    src_b,
                    ..cuda::Fusion::default()
                };
                // SAFETY: forwarded contract; `c` is a fresh output, `x` and `y` live (or
                // copies the face keeps for the call).
                if unsafe { cuda::packed(rt, &plan, &x.transposed(), &y, offs, &gather, c)? } {
                    return Ok(());
                }
                (x, y)
            }
            Device::Cpu => (first.clone(), second.clone()),
        };
        // No kernel reads the rows through `src` here: gather them first.
        // SAFETY: forwarded contract; `src` contiguous int32.
        let (_keep, rows) = unsafe { gather_rows(rt, if src_b { &y } else { &x }, &src)? };
        let (x, y) = if src_b { (&x, &rows) } else { (&rows, &y) };
        // SAFETY: as for `packed`; `rows` is alive until `_keep` drops, after the product.
        unsafe { run_packed(rt, &plan, &x.transposed(), y, offs, offs_vals.as_deref(), c) }
    };
    // The product's own target: `out` (transposed back when the product runs transposed)
    // where the kernels write it as it is, else a fresh output.
    let direct = out.as_ref().and_then(|(_, t)| {
        let c = if transposed {
            t.transposed()
        } else {
            t.clone()
        };
        writes_slab_in_place(&c).then_some(c)
    });
    let out = match (out, direct) {
        (Some((o, _)), Some(c)) => {
            run(rt, &c)?;
            return Ok(o);
        }
        (out, _) => out,
    };
    let (fresh, c) = rt.alloc(&plan.out_shape, a.dtype, a.device)?;
    run(rt, &c)?;
    let fresh = if transposed {
        rt.transposed(fresh)?
    } else {
        fresh
    };
    match out {
        Some((o, _)) => {
            rt.copy_into(&o, &fresh)?;
            Ok(o)
        }
        None => Ok(fresh),
    }
}

/// True when a GroupedK product writes `out` as it is: any layout on the CPU; on CUDA one
/// the kernels describe as row-major ([`cuda::operand`]: unit column stride, rows and
/// groups apart), e.g. a slab of the rows or columns of a larger contiguous gradient.
fn writes_slab_in_place(out: &Tensor) -> bool {
    match out.device {
        Device::Cpu => true,
        Device::Cuda(_) => cuda::operand(out).is_some_and(|o| !o.col_major),
    }
}

/// Runs a validated packed product into the target `c` (shape `plan.out_shape`).
///
/// # Safety
/// As [`packed`]; `offs_vals` passed [`shape::check_offs`] (CPU).
unsafe fn run_packed<R: Runtime>(
    rt: &mut R,
    plan: &PackedDims,
    a: &Tensor,
    b: &Tensor,
    offs: Option<&IntTensor>,
    offs_vals: Option<&[i32]>,
    c: &Tensor,
) -> Result<()> {
    match a.device {
        Device::Cuda(_) => {
            // SAFETY: forwarded contract.
            unsafe { cuda::packed(rt, plan, a, b, offs, &cuda::Fusion::default(), c) }.map(|_| ())
        }
        Device::Cpu => {
            let problems = cpu::packed_problems(plan, &a.layout, &b.layout, &c.layout, offs_vals);
            let (pa, pb, pc) = (a.ptr, b.ptr, c.ptr);
            with_types!(a.dtype, c.dtype, |TI, TO| {
                rt.run_cpu(&mut || {
                    // SAFETY: problems from packed_problems on the layouts of the live
                    // arrays behind the pointers (offs checked), `c` non-overlapping and
                    // disjoint from the inputs (fresh, or checked by check_out).
                    unsafe {
                        cpu::run_packed::<TI, TO>(
                            &problems,
                            pa as *const TI,
                            pb as *const TI,
                            pc as *mut TO,
                        )
                    }
                });
            });
            Ok(())
        }
    }
}

// ---------------------------------------------------------------------------------
// List form
// ---------------------------------------------------------------------------------

/// The checks of a list product: shapes fit group by group, every operand has the
/// dtype and device of `As[0]`.
fn validate_list(a: &[Tensor], b: &[Tensor]) -> Result<Vec<GroupDims>> {
    let dims = shape::plan_list(a, b)?;
    if let Some(first) = a.first() {
        for (i, x) in a.iter().enumerate().skip(1) {
            shape::check_like(Item("As", i), x.like(), "As[0]", first.reference())?;
        }
        for (i, x) in b.iter().enumerate() {
            shape::check_like(Item("Bs", i), x.like(), "As[0]", first.reference())?;
        }
    }
    Ok(dims)
}

/// List product `out[i] = a[i] · b[i]` into `outs` (allocated when `None`).
///
/// # Safety
/// As [`packed`].
pub unsafe fn list<R: Runtime>(
    rt: &mut R,
    a: &[Tensor],
    b: &[Tensor],
    out_dtype: Option<DType>,
    outs: Option<Vec<Output<R::Out>>>,
) -> Result<Vec<R::Out>> {
    let dims = validate_list(a, b)?;
    let Some(first) = a.first() else {
        let outs = outs.unwrap_or_default();
        shape::check_len("out", 0, outs.len(), "outputs (one per group)")?;
        return Ok(Vec::new());
    };
    let dtype = out_dtype.unwrap_or(first.dtype);
    if let Some(o) = &outs {
        shape::check_len("out", dims.len(), o.len(), "outputs (one per group)")?;
        for (i, ((_, oi), d)) in o.iter().zip(&dims).enumerate() {
            let inputs = (a.iter().enumerate().map(|(j, x)| (Item("As", j), x)))
                .chain(b.iter().enumerate().map(|(j, x)| (Item("Bs", j), x)));
            check_out(
                Item("out", i),
                oi,
                &[d.m, d.n],
                dtype,
                ("As[0]", first),
                inputs,
            )?;
            let range = oi.byte_range();
            for (j, (_, oj)) in o[..i].iter().enumerate() {
                shape::check_disjoint(Item("out", i), range, Item("out", j), oj.byte_range())?;
            }
        }
    }
    let refs: Vec<&Tensor> = a.iter().chain(b).collect();
    let ops = Operands::prepare(rt, &refs, None)?;
    let (a, b) = ops.t.split_at(a.len());
    // SAFETY: forwarded contract.
    unsafe { run_list_into(rt, &dims, a, b, dtype, first.device, outs) }
}

/// Backward of the list product: `dA[i] = grads[i]·b[i]ᵀ`, `dB[i] = a[i]ᵀ·grads[i]`,
/// each list only when asked for.
///
/// # Safety
/// As [`packed`].
pub unsafe fn list_backward<R: Runtime>(
    rt: &mut R,
    grads: &[Tensor],
    a: &[Tensor],
    b: &[Tensor],
    need_a: bool,
    need_b: bool,
    out_dtype: Option<DType>,
) -> Result<Grads<Vec<R::Out>>> {
    let dims = validate_list(a, b)?;
    shape::check_len(
        "grads",
        dims.len(),
        grads.len(),
        "gradients (one per output)",
    )?;
    let Some(first) = a.first() else {
        return Ok((need_a.then(Vec::new), need_b.then(Vec::new)));
    };
    for (i, (g, d)) in grads.iter().zip(&dims).enumerate() {
        shape::check_like(Item("grads", i), g.like(), "As[0]", first.reference())?;
        shape::check_grad(Item("grads", i), &g.layout, &[d.m, d.n])?;
    }
    if !(need_a || need_b) {
        return Ok((None, None));
    }
    let dtype = out_dtype.unwrap_or(first.dtype);
    let g_len = grads.len();
    let refs: Vec<&Tensor> = grads.iter().chain(a).chain(b).collect();
    let ops = Operands::prepare(rt, &refs, None)?;
    let (grads, rest) = ops.t.split_at(g_len);
    let (a, b) = rest.split_at(g_len);
    let mut products: [(Vec<Tensor>, Vec<Tensor>); 2] = Default::default();
    for ((g, x), y) in grads.iter().zip(a).zip(b) {
        // list outputs are fresh per-group arrays: the gradients stay row-major
        let [(ga, gb), (ha, hb)] = shape::backward_layouts(g, x, y, [false; 2]);
        products[0].0.push(ga);
        products[0].1.push(gb);
        products[1].0.push(ha);
        products[1].1.push(hb);
    }
    let device = first.device;
    let product = |rt: &mut R, (x, y): &(Vec<Tensor>, Vec<Tensor>)| -> Result<Vec<R::Out>> {
        let dims = shape::plan_list(x, y)?;
        // SAFETY: forwarded contract.
        unsafe { run_list_into(rt, &dims, x, y, dtype, device, None) }
    };
    let da = if need_a {
        Some(product(rt, &products[0])?)
    } else {
        None
    };
    let db = if need_b {
        Some(product(rt, &products[1])?)
    } else {
        None
    };
    Ok((da, db))
}

/// Runs a validated list product into `outs` (checked) or fresh outputs.
///
/// # Safety
/// As [`packed`].
unsafe fn run_list_into<R: Runtime>(
    rt: &mut R,
    dims: &[GroupDims],
    a: &[Tensor],
    b: &[Tensor],
    dtype: DType,
    device: Device,
    outs: Option<Vec<Output<R::Out>>>,
) -> Result<Vec<R::Out>> {
    let outs: Vec<Output<R::Out>> = match outs {
        Some(o) => o,
        None => dims
            .iter()
            .map(|d| rt.alloc(&[d.m, d.n], dtype, device))
            .collect::<Result<_>>()?,
    };
    // Targets the kernels write: the outputs themselves, except (CUDA) outputs that are
    // not contiguous, which get a fresh target and a copy afterwards.
    let mut temps: Vec<Option<Output<R::Out>>> = Vec::with_capacity(outs.len());
    for ((_, o), d) in outs.iter().zip(dims) {
        temps.push(if writes_in_place(o) {
            None
        } else {
            Some(rt.alloc(&[d.m, d.n], dtype, device)?)
        });
    }
    let targets: Vec<&Tensor> = outs
        .iter()
        .zip(&temps)
        .map(|((_, o), t)| t.as_ref().map_or(o, |(_, t)| t))
        .collect();
    match device {
        Device::Cuda(_) => {
            // SAFETY: forwarded contract.
            unsafe { cuda::list(rt, a, b, &targets)? }
        }
        Device::Cpu => {
            let problems = cpu::list_problems(dims, a, b, &targets);
            let pa: Vec<usize> = a.iter().map(|x| x.ptr).collect();
            let pb: Vec<usize> = b.iter().map(|x| x.ptr).collect();
            let pc: Vec<usize> = targets.iter().map(|x| x.ptr).collect();
            let ti = a.first().map_or(dtype, |x| x.dtype);
            with_types!(ti, dtype, |TI, TO| {
                rt.run_cpu(&mut || {
                    let pa: Vec<*const TI> = pa.iter().map(|&p| p as *const TI).collect();
                    let pb: Vec<*const TI> = pb.iter().map(|&p| p as *const TI).collect();
                    let pc: Vec<*mut TO> = pc.iter().map(|&p| p as *mut TO).collect();
                    // SAFETY: problems from list_problems on the layouts of the live
                    // arrays behind the pointers; outputs fresh, or checked
                    // non-overlapping with each other and with the inputs.
                    unsafe { cpu::run_list::<TI, TO>(&problems, &pa, &pb, &pc) }
                });
            });
        }
    }
    outs.into_iter()
        .zip(temps)
        .map(|((o, _), t)| {
            if let Some((t, _)) = t {
                rt.copy_into(&o, &t)?;
            }
            Ok(o)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Layout;

    /// Host float64 outputs filled with NaN (every element must be written); any other
    /// loan fails the test.
    struct Host;
    impl Runtime for Host {
        type Out = Vec<f64>;
        fn alloc(
            &mut self,
            shape: &[usize],
            dtype: DType,
            device: Device,
        ) -> Result<Output<Vec<f64>>> {
            assert_eq!((dtype, device), (DType::F64, Device::Cpu));
            let v = vec![f64::NAN; shape.iter().product()];
            let t = tensor(v.as_ptr() as usize, shape, dtype, device);
            Ok((v, t))
        }
        fn contiguous(&mut self, _: usize) -> Result<(usize, Layout)> {
            panic!("copied")
        }
        fn int32(&mut self, _: usize) -> Result<usize> {
            panic!("converted")
        }
    }

    fn tensor(ptr: usize, shape: &[usize], dtype: DType, device: Device) -> Tensor {
        Tensor {
            ptr,
            dtype,
            layout: Layout::contiguous(shape),
            device,
            id: 0,
            transposed: false,
        }
    }

    fn index(v: &[i32], device: Device) -> IntTensor {
        IntTensor {
            ptr: v.as_ptr() as usize,
            layout: Layout::contiguous(&[v.len()]),
            device,
            id: 0,
            int32: true,
        }
    }

    /// `Σ a_rᵀ · b_r` per group, the rows as `gathered_b` says, from the definition.
    fn reference(
        (a, k): (&[f64], usize),
        (b, n): (&[f64], usize),
        ends: &[i32],
        src: &[i32],
        gathered_b: bool,
    ) -> Vec<f64> {
        let mut out = vec![0.0; ends.len() * k * n];
        let mut start = 0;
        for (g, &end) in ends.iter().enumerate() {
            for (r, &s) in src.iter().enumerate().take(end as usize).skip(start) {
                let (ra, rb) = match gathered_b {
                    false => (s as usize, r),
                    true => (r, s as usize),
                };
                for i in 0..k {
                    for j in 0..n {
                        out[(g * k + i) * n + j] += a[ra * k + i] * b[rb * n + j];
                    }
                }
            }
            start = end as usize;
        }
        out
    }

    #[test]
    fn gather_k_on_the_cpu_matches_the_definition() {
        let (k, n) = (3usize, 2usize);
        let src = [4i32, 0, 0, 2, 5, 1, 3];
        let ends = [2i32, 2, 6]; // an empty group, a row past the last group
        let (r, t) = (src.len(), 6usize);
        let (offs_v, cpu) = (ends.to_vec(), Device::Cpu);
        let vals = |len: usize, seed: f64| -> Vec<f64> {
            (0..len).map(|i| ((i as f64 + seed) * 0.37).sin()).collect()
        };
        for gathered_b in [false, true] {
            let (ta, tb) = if gathered_b { (r, t) } else { (t, r) };
            let (a, b) = (vals(ta * k, 1.0), vals(tb * n, 2.0));
            let at = tensor(a.as_ptr() as usize, &[ta, k], DType::F64, cpu);
            let bt = tensor(b.as_ptr() as usize, &[tb, n], DType::F64, cpu);
            let (offs, idx) = (index(&offs_v, cpu), index(&src, cpu));
            // SAFETY: live host arrays of the shapes described.
            let out = unsafe {
                packed_gather_k(&mut Host, &at, &bt, &offs, &idx, gathered_b, false, None)
            }
            .unwrap();
            let expect = reference((&a, k), (&b, n), &ends, &src, gathered_b);
            assert_eq!(out.len(), expect.len());
            for (o, e) in out.iter().zip(&expect) {
                assert!(
                    (o - e).abs() <= 1e-12,
                    "{o} != {e} (gathered_b {gathered_b})"
                );
            }
            assert!(
                out[k * n..2 * k * n].iter().all(|&v| v == 0.0),
                "empty group"
            );
        }
    }

    #[test]
    fn gather_k_writes_a_slab_of_a_larger_output_in_place() {
        // out: rows 1..1+k of each group's [k+2, n] block (strides [(k+2)n, n, 1]); the
        // rows around the slab keep their sentinel
        let (k, n, t) = (3usize, 2usize, 5usize);
        let src = [4i32, 0, 0, 2, 1, 3];
        let ends = [2i32, 2, 6];
        let (r, cpu, g) = (src.len(), Device::Cpu, ends.len());
        let a: Vec<f64> = (0..t * k).map(|i| (i as f64 * 0.29).cos()).collect();
        let b: Vec<f64> = (0..r * n).map(|i| (i as f64 * 0.41).sin()).collect();
        let mut big = vec![7.0f64; g * (k + 2) * n];
        let at = tensor(a.as_ptr() as usize, &[t, k], DType::F64, cpu);
        let bt = tensor(b.as_ptr() as usize, &[r, n], DType::F64, cpu);
        let slab = Tensor {
            layout: Layout {
                shape: vec![g, k, n],
                strides: vec![((k + 2) * n) as isize, n as isize, 1],
            },
            ..tensor(
                big.as_mut_ptr() as usize + n * 8,
                &[g, k, n],
                DType::F64,
                cpu,
            )
        };
        let (offs, idx) = (index(&ends, cpu), index(&src, cpu));
        // SAFETY: live host arrays of the shapes described; `big` outlives the call.
        let o = unsafe {
            packed_gather_k(
                &mut Host,
                &at,
                &bt,
                &offs,
                &idx,
                false,
                false,
                Some((vec![-1.0], slab)),
            )
        }
        .unwrap();
        assert_eq!(o, vec![-1.0], "out's own object comes back");
        let expect = reference((&a, k), (&b, n), &ends, &src, false);
        for gi in 0..g {
            for row in 0..k + 2 {
                for j in 0..n {
                    let got = big[(gi * (k + 2) + row) * n + j];
                    let want = match row {
                        0 => 7.0,
                        _ if row == k + 1 => 7.0,
                        _ => expect[(gi * k + row - 1) * n + j],
                    };
                    assert!(
                        (got - want).abs() <= 1e-12,
                        "group {gi} row {row}: {got} != {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn gather_k_errors_name_the_argument() {
        let (a, b, src, ends) = ([0.0f64; 12], [0.0f64; 8], [0i32, 1, 2, 3], [4i32]);
        let cpu = Device::Cpu;
        let run = |a: &Tensor, b: &Tensor, offs: &IntTensor, src: &IntTensor| {
            // SAFETY: live host arrays; the errors come before anything is read.
            unsafe { packed_gather_k(&mut Host, a, b, offs, src, false, false, None) }
                .map(|_| ())
                .unwrap_err()
                .to_string()
        };
        let at = tensor(a.as_ptr() as usize, &[4, 3], DType::F64, cpu);
        let bt = tensor(b.as_ptr() as usize, &[4, 2], DType::F64, cpu);
        let (offs, idx) = (index(&ends, cpu), index(&src, cpu));
        let b32 = Tensor {
            dtype: DType::F32,
            ..bt.clone()
        };
        assert_eq!(
            run(&at, &b32, &offs, &idx),
            "b: expected dtype torch.float64 (the dtype of a), found torch.float32"
        );
        let gpu = |i: &IntTensor| IntTensor {
            device: Device::Cuda(0),
            ..i.clone()
        };
        assert!(run(&at, &bt, &offs, &gpu(&idx))
            .starts_with("src: expected a tensor on cpu (the device of a)"));
        assert!(run(&at, &bt, &gpu(&offs), &idx)
            .starts_with("offs: expected a tensor on cpu (the device of a)"));
        let b3 = tensor(b.as_ptr() as usize, &[3, 2], DType::F64, cpu);
        assert!(run(&at, &b3, &offs, &idx).starts_with("b: expected shape [R=4, N]"));
        // offs values: the GroupedK rule over the R routed rows
        let past = [5i32];
        assert!(run(&at, &bt, &index(&past, cpu), &idx).starts_with("offs:"));
        // index values: the row ops' host rule
        let bad = [0i32, 4, 1, 2];
        assert_eq!(
            run(&at, &bt, &offs, &index(&bad, cpu)),
            "src/inverse: routing index 4 at position 1 is out of range: expected a row in [0, 4)"
        );
    }
}
