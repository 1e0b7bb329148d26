//! The fused expert products of a routed SwiGLU block through the engine: one GroupedM
//! product whose epilogue writes every output (shapes: [`crate::shape::FusedDims`]; what
//! each epilogue computes, element by element: the bridge's `Fusion`, [`super::ffi`]).
//!
//! validate (the rules of [`crate::shape`], on every device) → on the CPU, `None` (no
//! memory read, nothing allocated) → on CUDA: operands normalised once, fresh contiguous
//! outputs, one [`cuda::packed`] request with the epilogue → the outputs, or `None` when
//! the bridge answers `Unsupported` (no kernel for the device, dtype or alignment; nothing
//! ran). `swiglu_mm` and `dgated_mm` with `src` first ask for the rows read through
//! `src` inside the product; where no kernel does that (in-GEMM gathering is off by
//! default) they gather them first, as `gather_mm` does ([`super::rows::gather_rows`]), and ask
//! for the epilogue alone. A `None` is the caller's to compose from plain products and row ops
//! (`groupmm.fused` in Python, where the composition's formulas live with the glue): the
//! engine composes nothing here. No host sync: `offs` is read on the device only, and an
//! earlier call's invalid `offs` is raised as every packed call raises it.

use super::cuda;
use super::operands::{check_out, contiguous, contiguous_int32, writes_in_place, Operands};
use super::rows::gather_rows;
use super::vocab::{Device, IntTensor, Output, Runtime, Tensor};
use crate::dtype::DType;
use crate::error::Result;
use crate::layout::Transposable;
use crate::shape;

/// The up projection with its activation: `pre = x[src] · w[g]` (`[R, 2F]`, `[gate | up]`)
/// and `act = silu(gate) * up` (`[R, F]`, from the fp32 product), both fresh, contiguous,
/// of `x`'s dtype; `src` absent: `R = T`, the rows of `x` in order. `None` on the CPU and
/// where no kernel runs the epilogue (with `src`: after gathering the rows first, when no
/// kernel reads them through `src`).
///
/// # Safety
/// As [`super::packed`].
pub unsafe fn swiglu_mm<R: Runtime>(
    rt: &mut R,
    x: &Tensor,
    w: &Tensor,
    offs: &IntTensor,
    src: Option<&IntTensor>,
) -> Result<Option<[R::Out; 2]>> {
    shape::check_like("w", w.like(), "x", x.reference())?;
    if let Some(s) = src {
        shape::check_like("src", (None, s.device), "x", x.reference())?;
    }
    shape::check_like("offs", (None, offs.device), "x", x.reference())?;
    let dims = shape::plan_swiglu_mm(
        &x.layout,
        &w.layout,
        src.map(|s| &s.layout),
        shape::offs_len(&offs.layout)?,
    )?;
    if x.device == Device::Cpu {
        return Ok(None);
    }
    let ops = Operands::prepare(rt, &[x, w], Some(offs))?;
    let src = src.map(|s| contiguous_int32(rt, s)).transpose()?;
    let shapes = dims.out_shapes();
    let (pre, pre_t) = rt.alloc(&shapes[0], x.dtype, x.device)?;
    let (act, act_t) = rt.alloc(&shapes[1], x.dtype, x.device)?;
    if dims.is_empty() {
        return Ok(Some([pre, act]));
    }
    let fusion = |src| cuda::Fusion {
        src,
        src_b: false,
        epilogue: cuda::Epilogue::SwiGLU { act: &act_t },
    };
    let (x, w, offs) = (&ops.t[0], &ops.t[1], ops.offs.as_ref());
    let (plan, asked) = (&dims.product, fusion(src.as_ref()));
    // SAFETY: forwarded contract; the outputs are fresh and contiguous.
    if unsafe { cuda::packed(rt, plan, x, w, offs, &asked, &pre_t)? } {
        return Ok(Some([pre, act]));
    }
    let Some(src) = &src else {
        return Ok(None);
    };
    // No kernel reads the rows through `src` inside this product (in-GEMM gathering is
    // off by default): gather them first, as gather_mm does, and ask for the epilogue
    // alone.
    // SAFETY: forwarded contract; `src` contiguous int32.
    let (_keep, rows) = unsafe { gather_rows(rt, x, src)? };
    // SAFETY: as above; `rows` lives until `_keep` drops, after the call.
    let ran = unsafe { cuda::packed(rt, plan, &rows, w, offs, &fusion(None), &pre_t)? };
    Ok(ran.then_some([pre, act]))
}

/// The backward of a routed SwiGLU expert's down projection through the router weight:
/// with `p = dy[src] · w[g]ᵀ` (`dy [T, D]` in token order and `src [R]` the token of each
/// routed row, or without `src` `dy [R, D]` and its rows in order; `w [G, F, D]` the down
/// projection's weight; `p` `[R, F]` in fp32, never stored), `pre [R, 2F]` the saved
/// pre-activation and `scale [R]` (float32) each row's router weight: `(dpre [R, 2F], act
/// [R, F], partial [ceil(F/64), R])`, fresh and contiguous (`partial` float32, the others
/// `dy`'s dtype): `dpre` the gradient of `pre`, `act = scale * silu(gate) * up`, and
/// `partial` the router weight's gradient of each row in 64-column partial sums. `None` on
/// the CPU and where no kernel runs it (with `src`: after gathering the rows first, when
/// no kernel reads them through `src`); then `out` is left as it was.
///
/// `out`, when given, receives `dpre` (checked as every output is, `operands::check_out`)
/// and is returned in its place. It may be `pre` itself, exactly (same address and
/// layout: [`shape::check_same_or_disjoint`]): the backward's last read of the
/// pre-activation, so that its `[R, 2F]` gradient needs no memory of its own. The DGated
/// epilogue allows it: each tile loads its own 64-column chunks of `pre` (rows of its
/// group only) and stores `dpre` at the same chunks after that load completed, and no
/// other tile reads them.
///
/// # Safety
/// As [`super::packed`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn dgated_mm<R: Runtime>(
    rt: &mut R,
    dy: &Tensor,
    w: &Tensor,
    offs: &IntTensor,
    pre: &Tensor,
    scale: &Tensor,
    src: Option<&IntTensor>,
    out: Option<Output<R::Out>>,
) -> Result<Option<[R::Out; 3]>> {
    shape::check_like("w", w.like(), "dy", dy.reference())?;
    if let Some(s) = src {
        shape::check_like("src", (None, s.device), "dy", dy.reference())?;
    }
    shape::check_like("offs", (None, offs.device), "dy", dy.reference())?;
    shape::check_like("pre", pre.like(), "dy", dy.reference())?;
    shape::check_like("scale", (None, scale.device), "dy", dy.reference())?;
    shape::check_f32("scale", scale.dtype, "the router weight of each row")?;
    let dims = shape::plan_dgated_mm(
        &dy.layout,
        &w.layout,
        &pre.layout,
        &scale.layout,
        src.map(|s| &s.layout),
        shape::offs_len(&offs.layout)?,
    )?;
    let shapes = dims.out_shapes();
    if let Some((_, t)) = &out {
        let inputs = [("dy", dy), ("w", w), ("scale", scale)];
        check_out("out", t, &shapes[0], dy.dtype, ("dy", dy), inputs)?;
        let (o, p) = (
            (t.ptr, &t.layout, t.byte_range()),
            (pre.ptr, &pre.layout, pre.byte_range()),
        );
        shape::check_same_or_disjoint("out", o, "pre", p)?;
    }
    if dy.device == Device::Cpu {
        return Ok(None);
    }
    // p = dy · w[g]ᵀ: the transposed view, read in place (as the backward's dA reads b)
    let wt = w.transposed();
    let ops = Operands::prepare(rt, &[dy, &wt], Some(offs))?;
    let src = src.map(|s| contiguous_int32(rt, s)).transpose()?;
    let pre = contiguous(rt, pre)?;
    let scale = contiguous(rt, scale)?;
    // dpre's target: `out` where the kernels write it as it is (contiguous), else fresh
    // (copied into `out` after the product, `into`)
    let (dpre, dpre_t, into) = match out {
        Some((o, t)) if writes_in_place(&t) => (o, t, None),
        out => {
            let (fresh, t) = rt.alloc(&shapes[0], dy.dtype, dy.device)?;
            (fresh, t, out.map(|(o, _)| o))
        }
    };
    let (act, act_t) = rt.alloc(&shapes[1], dy.dtype, dy.device)?;
    let (partial, partial_t) = rt.alloc(&shapes[2], DType::F32, dy.device)?;
    if dims.is_empty() {
        return Ok(Some([into.unwrap_or(dpre), act, partial]));
    }
    let fusion = |src| cuda::Fusion {
        src,
        src_b: false,
        epilogue: cuda::Epilogue::DGated {
            act: &act_t,
            pre: &pre,
            scale: &scale,
            partial: &partial_t,
        },
    };
    let (dy, wt, offs) = (&ops.t[0], &ops.t[1], ops.offs.as_ref());
    let (plan, asked) = (&dims.product, fusion(src.as_ref()));
    // SAFETY: forwarded contract; `pre` and `scale` contiguous (or copies the face keeps
    // for the call), the outputs contiguous: fresh, or `out`, which is `pre` itself or
    // disjoint from every input (checked above).
    let mut ran = unsafe { cuda::packed(rt, plan, dy, wt, offs, &asked, &dpre_t)? };
    if let (false, Some(src)) = (ran, &src) {
        // No kernel reads the rows through `src` inside this product: gather them first
        // and ask for the epilogue alone.
        // SAFETY: forwarded contract; `src` contiguous int32.
        let (_keep, rows) = unsafe { gather_rows(rt, dy, src)? };
        // SAFETY: as above; `rows` lives until `_keep` drops, after the call.
        ran = unsafe { cuda::packed(rt, plan, &rows, wt, offs, &fusion(None), &dpre_t)? };
    }
    if !ran {
        return Ok(None);
    }
    match into {
        Some(o) => {
            rt.copy_into(&o, &dpre)?;
            Ok(Some([o, act, partial]))
        }
        None => Ok(Some([dpre, act, partial])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::layout::Layout;

    /// A face whose every loan fails the test: the CPU path reads, copies and allocates
    /// nothing.
    struct Untouched;
    impl Runtime for Untouched {
        type Out = ();
        fn alloc(&mut self, _: &[usize], _: DType, _: Device) -> Result<super::super::Output<()>> {
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
