//! The products of the MoE layer through the engine, one ladder for all (rule and table:
//! [`shape::plan_product`]): a GroupedM product over routed rows (`gather_mm`), alone or
//! with an epilogue that writes the glue around it (the fused expert products
//! `swiglu_mm`, `dgated_mm`), or a GroupedK product over them (`gather_k_mm`, the weight
//! gradient), each reading its rows in order or through the routed-row index `src`.
//!
//! validate (on every device) → `out` checked → an epilogue on the CPU: `None` (no
//! memory read, nothing allocated) → the operands normalised once (the index converted
//! to int32 once) → the outputs → one request with everything asked (`src` and the
//! epilogue, [`run`]) → where no kernel reads the rows through `src` (in-GEMM gathering is
//! off by default; the CPU), the rows gathered first ([`gather_rows`]) and the request
//! asked again without `src` → where no kernel runs the epilogue, `None`: the caller's to
//! compose from plain products and row ops (`groupmm.fused` in Python, where the
//! formulas live with the glue); a plain product always runs. No host sync on CUDA:
//! `offs` is read on the device only, and an earlier call's invalid `offs` or routed-row
//! index is raised as every packed call raises it; on the CPU a bad index is an error at
//! once (the row op's host rule, [`shape::check_indices`]).

use super::cuda;
use super::operands::{check_out, host_offs, writes_in_place, Operands};
use super::packed::run;
use super::rows::gather_rows;
use super::vocab::{contiguous, contiguous_int32, Device, IntTensor, Output, Runtime, Tensor};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Transposable;
use crate::shape::{self, Epilogue, Form, Gathered, PackedDims, ProductDims};
use std::borrow::Cow;

/// One product of the MoE layer as a face asks it (built on the stack, per call).
#[derive(Debug)]
pub struct ProductRequest<'a, O> {
    /// GroupedM (groups along the routed rows: `gather_mm`, `swiglu_mm`, `dgated_mm`) or
    /// GroupedK (groups along the reduction over them: `gather_k_mm`).
    pub form: Form,
    /// The first operand: `x`, `dy` (DGated) or `a` (GroupedK); every other operand has
    /// its device and, but `offs`, `src` and `scale`, its dtype.
    pub a: &'a Tensor,
    /// The second: `w` (DGated reads it transposed, in place) or `b` (GroupedK).
    pub b: &'a Tensor,
    /// int32 `[G]`, the group ends over the routed rows.
    pub offs: &'a IntTensor,
    /// The routed-row index (any integer dtype, converted to int32 once) and the operand
    /// it gathers; absent: the rows in order.
    pub src: Option<(&'a IntTensor, Gathered)>,
    /// The epilogue with its operands (GroupedM only).
    pub epilogue: Epilogue<&'a Tensor>,
    /// GroupedK only: the same values computed as `(Σ b_rᵀ · a_r)ᵀ`, the transposed view
    /// of a fresh contiguous `[G, N, K]` (the gradient of a column-major weight in its own
    /// layout, as `packed_backward` gives it).
    pub transposed: bool,
    /// The dtype of `c` (default: `a`'s).
    pub out_dtype: Option<DType>,
    /// Written instead of a fresh `c` (checked as every output is, [`check_out`]; for
    /// DGated it may be `pre` itself, [`shape::check_same_or_disjoint`]) and returned in
    /// its place: in place wherever the kernels can write it as it is (GroupedK: any
    /// row-major layout, e.g. a slab of a larger gradient; else contiguous), else through
    /// a fresh output copied into it after the product ran.
    pub out: Option<Output<O>>,
}

impl<'a, O> ProductRequest<'a, O> {
    /// The plain product of `form` over `a`, `b` and `offs`, the rows in order, a fresh
    /// output of `a`'s dtype: the base that a face's request updates.
    pub fn new(form: Form, a: &'a Tensor, b: &'a Tensor, offs: &'a IntTensor) -> Self {
        ProductRequest {
            form,
            a,
            b,
            offs,
            src: None,
            epilogue: Epilogue::Plain,
            transposed: false,
            out_dtype: None,
            out: None,
        }
    }
}

/// The outputs of a product: `c` (the product; with an epilogue the pre-activation
/// `pre`, or its gradient `dpre`), then the epilogue's: `act` (SwiGLU, DGated) and
/// `partial` (DGated); fresh and contiguous but an `out` given.
#[derive(Debug)]
pub struct Outputs<O> {
    /// The product, `pre` or `dpre`.
    pub c: O,
    /// `act [R, F]`, of `c`'s dtype.
    pub act: Option<O>,
    /// float32 `partial [⌈F/64⌉, R]`.
    pub partial: Option<O>,
}

impl<O> Outputs<O> {
    fn new(c: O, act: Option<Output<O>>, partial: Option<Output<O>>) -> Self {
        Outputs {
            c,
            act: act.map(|(o, _)| o),
            partial: partial.map(|(o, _)| o),
        }
    }
}

/// The one output of a plain product, which always runs (`None` only where an epilogue
/// was asked).
pub fn plain<O>(o: Option<Outputs<O>>) -> Result<O> {
    o.map(|o| o.c)
        .ok_or_else(|| Error::Cuda("internal: a plain product did not run".into()))
}

/// Where `c` is written: the caller's `out` itself, or a fresh output (copied into the
/// caller's `out`, when given, after the product ran).
enum Target<O> {
    Out(O),
    Fresh(O, Option<O>),
}

impl<O> Target<O> {
    /// `out` where the kernels write it as it is (its transposed view when the product
    /// runs transposed; [`writes_as_is`]), else a fresh output of `shape`; with the
    /// description of what the product writes.
    fn new<R: Runtime<Out = O>>(
        rt: &mut R,
        out: Option<Output<O>>,
        (form, transposed): (Form, bool),
        shape: &[usize],
        (dtype, device): (DType, Device),
    ) -> Result<(Self, Tensor)> {
        let out = match out {
            Some((o, t)) => {
                let t = if transposed { t.transposed() } else { t };
                if writes_as_is(form, &t) {
                    return Ok((Target::Out(o), t));
                }
                Some(o)
            }
            None => None,
        };
        let (fresh, c) = rt.alloc(shape, dtype, device)?;
        Ok((Target::Fresh(fresh, out), c))
    }

    /// The output the caller gets, as it is: nothing ran (no element to write).
    fn unwritten(self) -> O {
        match self {
            Target::Out(o) | Target::Fresh(_, Some(o)) | Target::Fresh(o, None) => o,
        }
    }

    /// The output the caller gets after the product ran: `out`, or the fresh output
    /// (its transposed view when the product ran transposed), copied into `out` if given.
    fn finish<R: Runtime<Out = O>>(self, rt: &mut R, transposed: bool) -> Result<O> {
        let Target::Fresh(fresh, out) = self else {
            return Ok(self.unwritten());
        };
        let fresh = if transposed {
            rt.transposed(fresh)?
        } else {
            fresh
        };
        match out {
            Some(o) => {
                rt.copy_into(&o, &fresh)?;
                Ok(o)
            }
            None => Ok(fresh),
        }
    }
}

/// The shape of `c`: the product's output, or an epilogue's first (`pre`, `dpre`).
fn c_shape<'p>(plan: &'p ProductDims, shapes: &'p [[usize; 2]]) -> &'p [usize] {
    shapes.first().map_or(&plan.product.out_shape, |s| s)
}

/// Every check of a request: agreement with the first operand (dtype and device; `scale`
/// float32), the shape rule, then `out`. Nothing is read, allocated or written. Returns
/// the extents and the epilogue's output shapes ([`ProductDims::out_shapes`]).
fn validate<O>(req: &ProductRequest<'_, O>) -> Result<(ProductDims, Vec<[usize; 2]>)> {
    let (a, like) = (req.a, req.a.reference());
    let [na, nb] = shape::operand_names(req.form, &req.epilogue);
    shape::check_like(nb, req.b.like(), na, like)?;
    if let Some((s, _)) = req.src {
        shape::check_like("src", (None, s.device), na, like)?;
    }
    shape::check_like("offs", (None, req.offs.device), na, like)?;
    if let Epilogue::SwiGLU { up: Some(up) } = req.epilogue {
        shape::check_like("up", up.like(), na, like)?;
    }
    let (pre, scale) = match req.epilogue {
        Epilogue::DGated { pre, scale } => {
            (Some(pre), Some((scale, "the router weight of each row")))
        }
        Epilogue::RowScale { scale } => (None, Some((scale, "the scale of each row"))),
        _ => (None, None),
    };
    if let Some(pre) = pre {
        shape::check_like("pre", pre.like(), na, like)?;
    }
    if let Some((scale, what)) = scale {
        shape::check_like("scale", (None, scale.device), na, like)?;
        shape::check_f32("scale", scale.dtype, what)?;
    }
    let scale = scale.map(|(s, _)| s);
    let plan = shape::plan_product(&shape::ProductShape {
        form: req.form,
        a: &a.layout,
        b: &req.b.layout,
        offs_len: shape::offs_len(&req.offs.layout)?,
        src: req.src.map(|(s, g)| (&s.layout, g)),
        epilogue: req.epilogue.map(|t| &t.layout),
        transposed: req.transposed,
    })?;
    let shapes = plan.out_shapes();
    if let Some((_, t)) = &req.out {
        // A transposed result is the view of `c` with its last two dimensions swapped
        // (GroupedK: `[G, N, K]`).
        let (swapped, c) = (&mut [0; 3], c_shape(&plan, &shapes));
        let shape = match (req.transposed, c) {
            (true, &[g, n, k]) => {
                *swapped = [g, k, n];
                &swapped[..]
            }
            _ => c,
        };
        let dtype = req.out_dtype.unwrap_or(a.dtype);
        let inputs = [(na, a), (nb, req.b)].into_iter();
        let inputs = inputs.chain(scale.map(|s| ("scale", s)));
        check_out("out", t, shape, dtype, (na, a), inputs)?;
        if let Some(p) = pre {
            let (o, p) = (
                (t.ptr, &t.layout, t.byte_range()),
                (p.ptr, &p.layout, p.byte_range()),
            );
            shape::check_same_or_disjoint("out", o, "pre", p)?;
        }
    }
    Ok((plan, shapes))
}

/// Runs one product of the MoE layer: its outputs, or `None` where no kernel runs the
/// epilogue asked (on the CPU always, before anything is read or allocated; on CUDA
/// after the bridge answered `Unsupported`, nothing ran and `out` is as it was). A
/// plain product always runs ([`plain`]).
///
/// # Safety
/// Every description is of live memory on its device for the whole call (inputs
/// readable, `out` writable), as [`Runtime`] promises for what it lends.
pub unsafe fn product<R: Runtime>(
    rt: &mut R,
    req: ProductRequest<'_, R::Out>,
) -> Result<Option<Outputs<R::Out>>> {
    let (plan, shapes) = validate(&req)?;
    let ProductRequest {
        form,
        a,
        b,
        offs,
        src,
        epilogue,
        transposed,
        out_dtype,
        out,
    } = req;
    let (device, dtype) = (a.device, out_dtype.unwrap_or(a.dtype));
    if device == Device::Cpu && plan.epilogue != Epilogue::Plain {
        return Ok(None);
    }
    // SAFETY: forwarded contract.
    let offs_vals = unsafe { host_offs(Some(offs), &plan.product)? };
    // The operands in the order the product reads them: swapped when GroupedK runs
    // transposed (and with them the one `src` gathers); DGated's `w` transposed
    // (`p = dy · wᵀ`), read in place as the backward's dA reads b.
    let (first, second) = if transposed { (b, a) } else { (a, b) };
    let src_b = matches!(src, Some((_, Gathered::B))) != transposed;
    let wt;
    let second = match epilogue {
        Epilogue::DGated { .. } => {
            wt = second.transposed();
            &wt
        }
        _ => second,
    };
    // SwiGLU's `up` is a second `b`: read in place as `b` is, never made contiguous
    let up = match epilogue {
        Epilogue::SwiGLU { up } => up,
        _ => None,
    };
    let ops = Operands::prepare(
        rt,
        &[&[first, second][..], up.as_slice()].concat(),
        Some(offs),
    )?;
    if up.is_some() && !same_strides(&ops.t[1], &ops.t[2]) {
        // the kernels read both weights with `b`'s strides: the caller composes
        return Ok(None);
    }
    let src = src.map(|(s, _)| contiguous_int32(rt, s)).transpose()?;
    let epilogue = match epilogue {
        Epilogue::SwiGLU { up: Some(_) } => Epilogue::SwiGLU {
            up: Some(ops.t[2].clone()),
        },
        e => e.try_map(|t| contiguous(rt, t))?,
    };
    // GroupedK on CUDA reads its first operand (transposed, as the backward's dB = aᵀ·grad
    // reads it) and the gathered one row-major (the bridge's `Fusion`); rows gathered
    // below are read from the same tensors (no second copy).
    let (x, y) = (&ops.t[0], &ops.t[1]);
    let (x, y) = match (form, device) {
        (Form::GroupedK, Device::Cuda(_)) => (
            Cow::Owned(cuda::row_major(rt, x)?),
            match src_b {
                true => Cow::Owned(cuda::row_major(rt, y)?),
                false => Cow::Borrowed(y),
            },
        ),
        _ => (Cow::Borrowed(x), Cow::Borrowed(y)),
    };
    let shape = c_shape(&plan, &shapes);
    let (target, c) = Target::new(rt, out, (form, transposed), shape, (dtype, device))?;
    let mut alloc = |i: usize, dtype| shapes.get(i).map(|s| rt.alloc(s, dtype, device));
    let act = alloc(1, dtype).transpose()?;
    let partial = alloc(2, DType::F32).transpose()?;
    if plan.is_empty() {
        return Ok(Some(Outputs::new(target.unwritten(), act, partial)));
    }
    let fusion = |src, retry| cuda::Fusion {
        src,
        retry,
        src_b,
        epilogue: epilogue.as_ref(),
        act: act.as_ref().map(|(_, t)| t),
        partial: partial.as_ref().map(|(_, t)| t),
    };
    let (p, offs) = (&plan.product, (ops.offs.as_ref(), offs_vals.as_deref()));
    // SAFETY: forwarded contract; the operands live (or copies the face keeps for the
    // call), the epilogue's contiguous, the outputs fresh and contiguous or `out`, which
    // is disjoint from every input or (DGated) `pre` itself (checked above).
    let mut ran = unsafe { submit(rt, p, &x, &y, offs, &fusion(src.as_ref(), false), &c)? };
    if let (false, Some(src)) = (ran, &src) {
        // No kernel reads the rows through `src` here: gather them first and ask again
        // without it.
        // SAFETY: forwarded contract; `src` contiguous int32.
        let (_keep, rows) = unsafe { gather_rows(rt, if src_b { &y } else { &x }, src)? };
        let (x, y) = if src_b { (&*x, &rows) } else { (&rows, &*y) };
        // SAFETY: as above; `rows` lives until `_keep` drops, after the call.
        ran = unsafe { submit(rt, p, x, y, offs, &fusion(None, true), &c)? };
    }
    if !ran {
        return Ok(None);
    }
    let c = target.finish(rt, transposed)?;
    Ok(Some(Outputs::new(c, act, partial)))
}

/// [`run`] of the product over `x` and `y`: GroupedK `Σ x_rᵀ · y_r` (`x` read
/// transposed), GroupedM `x · y`.
///
/// # Safety
/// As [`run`].
unsafe fn submit<R: Runtime>(
    rt: &mut R,
    plan: &PackedDims,
    x: &Tensor,
    y: &Tensor,
    (offs, offs_vals): (Option<&IntTensor>, Option<&[i32]>),
    fusion: &cuda::Fusion<'_>,
    c: &Tensor,
) -> Result<bool> {
    let xt;
    let x = match plan.form {
        Form::GroupedK => {
            xt = x.transposed();
            &xt
        }
        _ => x,
    };
    // SAFETY: forwarded contract.
    unsafe { run(rt, plan, x, y, offs, offs_vals, fusion, c) }
}

/// True when `b` and `up` (SwiGLU's two weights) have the same strides, so that the
/// kernels read both through `b`'s.
fn same_strides(b: &Tensor, up: &Tensor) -> bool {
    b.layout.strides == up.layout.strides && b.layout.shape == up.layout.shape
}

/// True when the product writes `c` as it is: any layout on the CPU; on CUDA, GroupedK
/// any layout the kernels describe as row-major ([`cuda::operand`]: unit column stride,
/// rows and groups apart), e.g. a slab of the rows or columns of a larger contiguous
/// gradient; else contiguous.
fn writes_as_is(form: Form, c: &Tensor) -> bool {
    match (form, c.device) {
        (Form::GroupedK, Device::Cuda(_)) => cuda::operand(c).is_some_and(|o| !o.col_major),
        _ => writes_in_place(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Layout;

    /// `gather_k_mm`'s request.
    #[allow(clippy::too_many_arguments)]
    unsafe fn packed_gather_k<R: Runtime>(
        rt: &mut R,
        a: &Tensor,
        b: &Tensor,
        offs: &IntTensor,
        src: &IntTensor,
        gathered_b: bool,
        transposed: bool,
        out: Option<Output<R::Out>>,
    ) -> Result<R::Out> {
        let gathered = if gathered_b { Gathered::B } else { Gathered::A };
        let req = ProductRequest {
            form: Form::GroupedK,
            a,
            b,
            offs,
            src: Some((src, gathered)),
            epilogue: Epilogue::Plain,
            transposed,
            out_dtype: None,
            out,
        };
        unsafe { product(rt, req) }.and_then(plain)
    }

    /// `swiglu_mm`'s request: `(pre, act)`.
    unsafe fn swiglu_mm<R: Runtime>(
        rt: &mut R,
        x: &Tensor,
        w: &Tensor,
        offs: &IntTensor,
        src: Option<&IntTensor>,
    ) -> Result<Option<[R::Out; 2]>> {
        let req = ProductRequest {
            form: Form::GroupedM,
            a: x,
            b: w,
            offs,
            src: src.map(|s| (s, Gathered::A)),
            epilogue: Epilogue::SwiGLU { up: None },
            transposed: false,
            out_dtype: None,
            out: None,
        };
        let o = unsafe { product(rt, req) }?;
        Ok(o.map(|o| [o.c, o.act.expect("act")]))
    }

    /// `dgated_mm`'s request: `(dpre, act, partial)`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn dgated_mm<R: Runtime>(
        rt: &mut R,
        dy: &Tensor,
        w: &Tensor,
        offs: &IntTensor,
        pre: &Tensor,
        scale: &Tensor,
        src: Option<&IntTensor>,
        out: Option<Output<R::Out>>,
    ) -> Result<Option<[R::Out; 3]>> {
        let req = ProductRequest {
            form: Form::GroupedM,
            a: dy,
            b: w,
            offs,
            src: src.map(|s| (s, Gathered::A)),
            epilogue: Epilogue::DGated { pre, scale },
            transposed: false,
            out_dtype: None,
            out,
        };
        let o = unsafe { product(rt, req) }?;
        Ok(o.map(|o| [o.c, o.act.expect("act"), o.partial.expect("partial")]))
    }

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
            let (offs, src_t) = (index(&offs_v, cpu), index(&src, cpu));
            // SAFETY: live host arrays of the shapes described.
            let out = unsafe {
                packed_gather_k(&mut Host, &at, &bt, &offs, &src_t, gathered_b, false, None)
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
        let (offs, src_t) = (index(&ends, cpu), index(&src, cpu));
        // SAFETY: live host arrays of the shapes described; `big` outlives the call.
        let o = unsafe {
            packed_gather_k(
                &mut Host,
                &at,
                &bt,
                &offs,
                &src_t,
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
        let (offs, src_t) = (index(&ends, cpu), index(&src, cpu));
        let b32 = Tensor {
            dtype: DType::F32,
            ..bt.clone()
        };
        assert_eq!(
            run(&at, &b32, &offs, &src_t),
            "b: expected dtype torch.float64 (the dtype of a), found torch.float32"
        );
        let gpu = |i: &IntTensor| IntTensor {
            device: Device::Cuda(0),
            ..i.clone()
        };
        assert!(run(&at, &bt, &offs, &gpu(&src_t))
            .starts_with("src: expected a tensor on cpu (the device of a)"));
        assert!(run(&at, &bt, &gpu(&offs), &src_t)
            .starts_with("offs: expected a tensor on cpu (the device of a)"));
        let b3 = tensor(b.as_ptr() as usize, &[3, 2], DType::F64, cpu);
        assert!(run(&at, &b3, &offs, &src_t).starts_with("b: expected shape [R=4, N]"));
        // offs values: the GroupedK rule over the R routed rows
        let past = [5i32];
        assert!(run(&at, &bt, &index(&past, cpu), &src_t).starts_with("offs:"));
        // index values: the row ops' host rule
        let bad = [0i32, 4, 1, 2];
        assert_eq!(
            run(&at, &bt, &offs, &index(&bad, cpu)),
            "src/inverse: routing index 4 at position 1 is out of range: expected a row in [0, 4)"
        );
    }

    /// A face whose every loan fails the test: the CPU path reads, copies and allocates
    /// nothing.
    struct Untouched;
    impl Runtime for Untouched {
        type Out = ();
        fn alloc(&mut self, _: &[usize], _: DType, _: Device) -> Result<Output<()>> {
            panic!("allocated")
        }
        fn contiguous(&mut self, _: usize) -> Result<(usize, Layout)> {
            panic!("copied")
        }
        fn int32(&mut self, _: usize) -> Result<usize> {
            panic!("converted")
        }
        fn stream(&mut self, _: i32) -> Result<u64> {
            panic!("asked for a stream")
        }
    }

    /// A description of nothing (address 0 is never read: the CPU path reads no memory).
    fn t(shape: &[usize], dtype: DType, device: Device) -> Tensor {
        Tensor {
            ptr: 0,
            dtype,
            layout: Layout::contiguous(shape),
            device,
            id: 0,
            transposed: false,
        }
    }

    fn int(shape: &[usize], device: Device, int32: bool) -> IntTensor {
        IntTensor {
            ptr: 0,
            layout: Layout::contiguous(shape),
            device,
            id: 0,
            int32,
        }
    }

    const CPU: Device = Device::Cpu;
    const GPU: Device = Device::Cuda(0);
    const BF: DType = DType::BF16;

    fn up(x: &Tensor, w: &Tensor, offs: &IntTensor, src: Option<&IntTensor>) -> Result<bool> {
        unsafe { swiglu_mm(&mut Untouched, x, w, offs, src) }.map(|o| o.is_some())
    }

    fn down(dy: &Tensor, w: &Tensor, offs: &IntTensor, pre: &Tensor, s: &Tensor) -> Result<bool> {
        unsafe { dgated_mm(&mut Untouched, dy, w, offs, pre, s, None, None) }.map(|o| o.is_some())
    }

    fn down_src(
        dy: &Tensor,
        w: &Tensor,
        offs: &IntTensor,
        (pre, s): (&Tensor, &Tensor),
        src: &IntTensor,
    ) -> Result<bool> {
        unsafe { dgated_mm(&mut Untouched, dy, w, offs, pre, s, Some(src), None) }
            .map(|o| o.is_some())
    }

    #[track_caller]
    fn err<T: std::fmt::Debug>(r: Result<T>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn cpu_calls_answer_none_without_touching_anything() {
        let (x, w) = (t(&[10, 16], BF, CPU), t(&[3, 16, 8], BF, CPU));
        let offs = int(&[3], CPU, true);
        // any src dtype, any R (int64: would be converted on CUDA, not here)
        assert!(!up(&x, &w, &offs, Some(&int(&[24], CPU, false))).unwrap());
        assert!(!up(&x, &w, &offs, None).unwrap());
        let (dy, wd) = (t(&[24, 16], BF, CPU), t(&[3, 4, 16], BF, CPU));
        let (pre, s) = (t(&[24, 8], BF, CPU), t(&[24], DType::F32, CPU));
        assert!(!down(&dy, &wd, &offs, &pre, &s).unwrap());
        // dy in token order read through src (int64 too: converted on CUDA only)
        let dy_tokens = t(&[10, 16], BF, CPU);
        for int32 in [true, false] {
            let src = int(&[24], CPU, int32);
            assert!(!down_src(&dy_tokens, &wd, &offs, (&pre, &s), &src).unwrap());
        }
        // float64 too: the fused kernels' dtypes are the bridge's business, not a rule
        let x64 = |shape: &[usize]| t(shape, DType::F64, CPU);
        assert!(!up(&x64(&[10, 16]), &x64(&[3, 16, 8]), &offs, None).unwrap());
    }

    #[test]
    fn swiglu_mm_argument_errors() {
        let (x, w) = (t(&[10, 16], BF, CPU), t(&[3, 16, 8], BF, CPU));
        let (offs, src) = (int(&[3], CPU, true), int(&[24], CPU, true));
        let e = err(up(&x, &t(&[3, 16, 8], DType::F16, CPU), &offs, Some(&src)));
        assert_eq!(
            e,
            "w: expected dtype torch.bfloat16 (the dtype of x), found torch.float16"
        );
        assert!(matches!(
            up(&x, &t(&[3, 16, 8], BF, GPU), &offs, Some(&src)),
            Err(Error::Device(m)) if m == "w: expected a tensor on cpu (the device of x), found one on cuda:0"
        ));
        assert!(err(up(&x, &w, &offs, Some(&int(&[24], GPU, true))))
            .starts_with("src: expected a tensor on cpu (the device of x)"));
        assert!(err(up(&x, &w, &int(&[3], GPU, true), None))
            .starts_with("offs: expected a tensor on cpu (the device of x)"));
        assert!(err(up(&x, &w, &int(&[3, 1], CPU, true), None))
            .starts_with("offs: expected a 1-D tensor of group ends"));
        assert_eq!(
            err(up(&x, &t(&[3, 16, 7], BF, CPU), &offs, Some(&src))),
            "w: expected an even last dimension [gate | up], found [3, 16, 7]"
        );
        assert!(matches!(
            up(&x, &t(&[2, 16, 8], BF, CPU), &offs, None),
            Err(Error::Shape(m)) if m == "w: expected shape [G=3, K=16, N] (G = len(offs)), found [2, 16, 8]"
        ));
        assert!(err(up(&x, &t(&[3, 8, 8], BF, CPU), &offs, None))
            .starts_with("w: expected 3-D weights [G, K=16, N]"));
        assert!(err(up(&t(&[10], BF, CPU), &w, &offs, None))
            .starts_with("x: expected a 2-D tensor [T, K]"));
        assert!(err(up(&x, &w, &offs, Some(&int(&[4, 6], CPU, true))))
            .starts_with("src: expected a 1-D tensor [R]"));
    }

    #[test]
    fn dgated_mm_argument_errors() {
        let (dy, w) = (t(&[24, 16], BF, CPU), t(&[3, 4, 16], BF, CPU));
        let (pre, s) = (t(&[24, 8], BF, CPU), t(&[24], DType::F32, CPU));
        let offs = int(&[3], CPU, true);
        assert_eq!(
            err(down(&dy, &t(&[3, 4, 16], DType::F32, CPU), &offs, &pre, &s)),
            "w: expected dtype torch.bfloat16 (the dtype of dy), found torch.float32"
        );
        assert_eq!(
            err(down(&dy, &w, &offs, &t(&[24, 8], DType::F16, CPU), &s)),
            "pre: expected dtype torch.bfloat16 (the dtype of dy), found torch.float16"
        );
        assert!(matches!(
            down(&dy, &w, &offs, &pre, &t(&[24], BF, CPU)),
            Err(Error::Dtype(m)) if m == "scale: expected dtype torch.float32 (the router weight of each row), found torch.bfloat16"
        ));
        assert!(matches!(
            down(&dy, &w, &offs, &pre, &t(&[24], DType::F32, GPU)),
            Err(Error::Device(m)) if m == "scale: expected a tensor on cpu (the device of dy), found one on cuda:0"
        ));
        assert!(err(down(&dy, &w, &offs, &t(&[24, 8], BF, GPU), &s))
            .starts_with("pre: expected a tensor on cpu (the device of dy)"));
        assert!(err(down(&dy, &w, &int(&[3], GPU, true), &pre, &s))
            .starts_with("offs: expected a tensor on cpu (the device of dy)"));
        assert!(err(down(&t(&[24], BF, CPU), &w, &offs, &pre, &s))
            .starts_with("dy: expected a 2-D tensor [R, D]"));
        assert!(err(down(&dy, &t(&[3, 16, 4], BF, CPU), &offs, &pre, &s))
            .starts_with("w: expected 3-D weights [G, F, D=16]"));
        assert!(err(down(&dy, &w, &int(&[2], CPU, true), &pre, &s))
            .starts_with("w: expected shape [G=2, F, D=16] (G = len(offs))"));
        assert!(matches!(
            down(&dy, &w, &offs, &t(&[24, 4], BF, CPU), &s),
            Err(Error::Shape(m)) if m.starts_with("pre: expected shape [24, 8] ([R, 2F]")
        ));
        assert!(err(down(&dy, &w, &offs, &pre, &t(&[23], DType::F32, CPU)))
            .starts_with("scale: expected shape [24]"));
    }

    #[test]
    fn dgated_mm_with_src_argument_errors() {
        let (dy, w) = (t(&[10, 16], BF, CPU), t(&[3, 4, 16], BF, CPU));
        let (pre, s) = (t(&[24, 8], BF, CPU), t(&[24], DType::F32, CPU));
        let (offs, src) = (int(&[3], CPU, true), int(&[24], CPU, true));
        assert!(down_src(&dy, &w, &offs, (&pre, &s), &src).is_ok());
        assert!(matches!(
            down_src(&dy, &w, &offs, (&pre, &s), &int(&[24], GPU, true)),
            Err(Error::Device(m)) if m == "src: expected a tensor on cpu (the device of dy), found one on cuda:0"
        ));
        assert!(err(down_src(
            &dy,
            &w,
            &offs,
            (&pre, &s),
            &int(&[4, 6], CPU, true)
        ))
        .starts_with("src: expected a 1-D tensor [R]"));
        assert!(
            err(down_src(&t(&[10], BF, CPU), &w, &offs, (&pre, &s), &src))
                .starts_with("dy: expected a 2-D tensor [T, D]")
        );
        // R = len(src), not the rows of dy
        assert!(matches!(
            down_src(&dy, &w, &offs, (&t(&[10, 8], BF, CPU), &s), &src),
            Err(Error::Shape(m)) if m.starts_with("pre: expected shape [24, 8] ([R, 2F]: R = len(src)")
        ));
        assert!(err(down_src(
            &dy,
            &w,
            &offs,
            (&pre, &t(&[10], DType::F32, CPU)),
            &src
        ))
        .starts_with("scale: expected shape [24]"));
        assert!(
            err(down_src(&dy, &w, &offs, (&pre, &t(&[24], BF, CPU)), &src))
                .starts_with("scale: expected dtype torch.float32")
        );
    }

    /// A bad argument raises on CUDA as on the CPU: every rule runs before anything else
    /// (and before the build is asked whether it holds CUDA).
    #[test]
    fn cuda_calls_validate_first() {
        let offs = int(&[3], GPU, true);
        let e = up(
            &t(&[10, 16], BF, GPU),
            &t(&[3, 16, 7], BF, GPU),
            &offs,
            None,
        );
        assert!(err(e).starts_with("w: expected an even last dimension"));
        let e = down(
            &t(&[24, 16], BF, GPU),
            &t(&[3, 4, 16], BF, GPU),
            &offs,
            &t(&[24, 8], BF, GPU),
            &t(&[24], BF, GPU),
        );
        assert!(err(e).starts_with("scale: expected dtype torch.float32"));
        if !cuda::compiled() {
            let e = up(
                &t(&[10, 16], BF, GPU),
                &t(&[3, 16, 8], BF, GPU),
                &offs,
                None,
            );
            assert!(
                matches!(e, Err(Error::Cuda(m)) if m.starts_with("groupmm was built without CUDA"))
            );
        }
    }
}
