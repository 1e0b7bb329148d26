//! The packed forms through the engine (forms: [`crate::shape::Form`]): validate, the
//! operands normalised once, the output target, and one product, or for the backward two
//! products of the same kinds on transposed descriptions (no copies); and [`run`], the
//! one dispatch of a validated packed product to the CPU kernels or across the seam,
//! which the products of the MoE layer (`super::product`) share.

use super::operands::{check_out, host_offs, into_target, Operands};
use super::vocab::{Device, Grads, IntTensor, Output, Runtime, Tensor};
use super::{cpu, cuda};
use crate::dtype::DType;
use crate::error::Result;
use crate::shape::{self, PackedDims};

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
    let (a, b, offs) = (&ops.t[0], &ops.t[1], ops.offs.as_ref());
    let plain = cuda::Fusion::default();
    into_target(rt, out, &plan.out_shape, dtype, a.device, |rt, c| {
        // SAFETY: forwarded contract; `c` is a fresh output or the checked `out`.
        unsafe { run(rt, &plan, a, b, offs, offs_vals.as_deref(), &plain, c) }.map(drop)
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
    let (offs_len, plain) = (offs.map(|o| o.layout.shape[0]), cuda::Fusion::default());
    let product = |rt: &mut R, x: &Tensor, y: &Tensor, swapped: bool| -> Result<R::Out> {
        let plan = shape::plan_packed(&x.layout, &y.layout, offs_len)?;
        let o = into_target(rt, None, &plan.out_shape, dtype, x.device, |rt, c| {
            let offs = ops.offs.as_ref();
            // SAFETY: forwarded contract; `c` is a fresh output.
            unsafe { run(rt, &plan, x, y, offs, offs_vals.as_deref(), &plain, c) }.map(drop)
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

/// Runs a validated packed product into the target `c` (shape `plan.out_shape`, or the
/// epilogue's `[m, 2F]`), with what `fusion` asks beyond `c = a · b` (see
/// [`cuda::Fusion`]). `Ok(false)`: no kernel here does what `fusion` asks, and nothing
/// ran (no CPU kernel reads rows through `src` or runs an epilogue; on CUDA the bridge
/// answered `Unsupported`); a plain product always runs.
///
/// # Safety
/// As [`packed`]; `offs_vals` passed [`shape::check_offs`] (CPU).
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn run<R: Runtime>(
    rt: &mut R,
    plan: &PackedDims,
    a: &Tensor,
    b: &Tensor,
    offs: Option<&IntTensor>,
    offs_vals: Option<&[i32]>,
    fusion: &cuda::Fusion<'_>,
    c: &Tensor,
) -> Result<bool> {
    match a.device {
        // SAFETY: forwarded contract.
        Device::Cuda(_) => unsafe { cuda::packed(rt, plan, a, b, offs, fusion, c) },
        Device::Cpu if fusion.is_plain() => {
            // SAFETY: forwarded contract.
            unsafe { cpu::packed(rt, plan, a, b, offs_vals, c) };
            Ok(true)
        }
        Device::Cpu => Ok(false),
    }
}
