//! The fused products (the SwiGLU and DGated epilogues): their argument errors, the CPU's
//! `None` without touching anything, and CUDA calls validated first.

use super::super::*;
use crate::error::Error;
use crate::exec::vocab::Output;
use crate::layout::Layout;
use crate::shape::{find_epilogue, Epilogue};

/// The SwiGLU epilogue's request: `(pre, act)`.
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
        epilogue: Epilogue::new(find_epilogue("swiglu")?, [None]),
        transposed: false,
        out_dtype: None,
        out: None,
    };
    let o = unsafe { product(rt, req) }?;
    Ok(o.map(|o| o.all().try_into().ok().expect("pre, act")))
}

/// The DGated epilogue's request: `(dpre, act, partial)`.
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
        epilogue: Epilogue::new(find_epilogue("dgated")?, [Some(pre), Some(scale)]),
        transposed: false,
        out_dtype: None,
        out,
    };
    let o = unsafe { product(rt, req) }?;
    Ok(o.map(|o| o.all().try_into().ok().expect("dpre, act, partial")))
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
    unsafe { dgated_mm(&mut Untouched, dy, w, offs, pre, s, Some(src), None) }.map(|o| o.is_some())
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
    assert!(
        err(up(&t(&[10], BF, CPU), &w, &offs, None)).starts_with("x: expected a 2-D tensor [T, K]")
    );
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
