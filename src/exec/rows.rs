//! The row ops of the MoE glue: the memory-bound steps around the grouped GEMMs of a
//! routed SwiGLU expert block (`groupmm.fused`, `groupmm.moe`), each one pass over its
//! rows, deterministic (fixed summation order, no atomics).
//!
//! | op | operands | computes |
//! | --- | --- | --- |
//! | `Swiglu` | `pre [R, 2F]` → `out [R, F]` | `silu(gate) * up`, `pre = [gate \| up]` |
//! | `SwigluBackward` | `grad [R, F]`, `pre [R, 2F]` → `out [R, 2F]` | `[d gate \| d up]` |
//! | `GatherSum` | `y [R, D]`, `inverse [T, k]`, `weights?` → `out [T, D]` | `sum_j w[t, j] * y[inverse[t, j]]` |
//! | `ScatterRows` | `grad [T, D]`, `inverse`, `weights?` → `out [R, D]` | `out[inverse[t, j]] = w[t, j] * grad[t]` |
//! | `RowDots` | `grad [T, D]`, `y [R, D]`, `inverse` → `out [T, k]` | `<grad[t], y[inverse[t, j]]>` |
//!
//! Every operand is contiguous, on one device; `inverse` is int32; `weights` (absent:
//! weight 1) and RowDots' `out` have the rows' dtype or float32. An index outside
//! `[0, R)` adds nothing and writes nothing (RowDots: 0), on every device, so a bad index
//! never reads or writes out of bounds. ScatterRows writes every row of `out` once, in row
//! order, through the inverse permutation of `inverse` (zeros for rows no index names;
//! if two indices name one row, one of them wins). Arithmetic: fp32 on
//! CUDA (fp64 for float64) and fp64 on the CPU, one rounding per output element.
//!
//! The checks here are the only ones: the CUDA kernels (cuda/device/rows.cu) and the CPU
//! loops below trust them.

use super::ffi::RowsOp;
use super::{Device, Memory, Offs, Tensor};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::shape::fmt_shape;
use half::{bf16, f16};
use rayon::prelude::*;

/// One row op: its operands as the face described them (outputs allocated by the caller).
pub struct RowsCall<'a> {
    pub op: RowsOp,
    pub x: &'a Tensor,
    pub y: Option<&'a Tensor>,
    pub index: Option<&'a Offs>,
    pub weights: Option<&'a Tensor>,
    pub out: &'a Tensor,
}

/// The extents of a validated call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowsDims {
    /// Rows of `inverse` (`T`; 0 for the SwiGLU ops).
    pub tokens: usize,
    /// Columns of `inverse` (`k`; 0 for the SwiGLU ops).
    pub top_k: usize,
    /// Rows `R` of the expert-ordered operand.
    pub rows: usize,
    /// `F` for the SwiGLU ops, `D` for the others.
    pub cols: usize,
}

/// The argument names of each op, as the Python functions spell them: `(x, y)`.
fn names(op: RowsOp) -> (&'static str, &'static str) {
    match op {
        RowsOp::Swiglu => ("pre", ""),
        RowsOp::SwigluBackward => ("grad", "pre"),
        RowsOp::GatherSum => ("y", ""),
        RowsOp::ScatterRows => ("grad", ""),
        _ => ("grad", "y"),
    }
}

fn matrix(name: &str, l: &super::Layout, device: Device, like: Device) -> Result<(usize, usize)> {
    if device != like {
        return Err(Error::Device(format!(
            "{name}: expected a tensor on {like} (the device of the other operands), found one \
             on {device}"
        )));
    }
    if l.ndim() != 2 {
        return Err(Error::Shape(format!(
            "{name}: expected a 2-D tensor, found shape {}",
            fmt_shape(&l.shape)
        )));
    }
    if l.numel() > 0 && !l.is_contiguous() {
        return Err(Error::Value(format!(
            "{name}: expected a contiguous tensor, found shape {} with strides {:?}",
            fmt_shape(&l.shape),
            l.strides
        )));
    }
    Ok((l.shape[0], l.shape[1]))
}

fn expect_shape(
    name: &str,
    found: (usize, usize),
    expected: (usize, usize),
    why: &str,
) -> Result<()> {
    if found != expected {
        return Err(Error::Shape(format!(
            "{name}: expected shape [{}, {}] ({why}), found [{}, {}]",
            expected.0, expected.1, found.0, found.1
        )));
    }
    Ok(())
}

fn expect_dtype(name: &str, found: DType, dtype: DType, or_f32: bool) -> Result<()> {
    if found == dtype || (or_f32 && found == DType::F32) {
        return Ok(());
    }
    let also = if or_f32 && dtype != DType::F32 {
        " or torch.float32"
    } else {
        ""
    };
    Err(Error::Dtype(format!(
        "{name}: expected dtype {}{also}, found {}",
        dtype.torch_name(),
        found.torch_name()
    )))
}

fn internal(what: &str) -> Error {
    Error::Type(format!("internal: row op without its {what} operand"))
}

/// Every check of a row op; nothing is read or written.
pub fn validate(c: &RowsCall<'_>) -> Result<RowsDims> {
    let (xn, yn) = names(c.op);
    let dev = c.x.device;
    let dt = c.x.dtype;
    let x = matrix(xn, &c.x.layout, dev, dev)?;
    let out = matrix("out", &c.out.layout, c.out.device, dev)?;
    let out_f32_ok = c.op == RowsOp::RowDots;
    expect_dtype("out", c.out.dtype, dt, out_f32_ok)?;
    let y = match c.y {
        Some(y) => {
            expect_dtype(yn, y.dtype, dt, false)?;
            Some(matrix(yn, &y.layout, y.device, dev)?)
        }
        None => None,
    };
    let index = match c.index {
        Some(i) => Some(matrix("inverse", &i.layout, i.device, dev)?),
        None => None,
    };
    if let Some(w) = c.weights {
        expect_dtype("weights", w.dtype, dt, true)?;
        let ws = matrix("weights", &w.layout, w.device, dev)?;
        let i = index.ok_or_else(|| internal("index"))?;
        expect_shape("weights", ws, i, "the shape of inverse")?;
    }
    match c.op {
        RowsOp::Swiglu | RowsOp::SwigluBackward => {
            let (rows, f) = if c.op == RowsOp::Swiglu {
                if x.1 % 2 != 0 {
                    return Err(Error::Shape(format!(
                        "pre: expected an even last dimension [gate | up], found [{}, {}]",
                        x.0, x.1
                    )));
                }
                (x.0, x.1 / 2)
            } else {
                let pre = y.ok_or_else(|| internal("pre"))?;
                expect_shape(
                    "pre",
                    pre,
                    (x.0, 2 * x.1),
                    "[rows of grad, 2 x its columns]",
                )?;
                x
            };
            let want = if c.op == RowsOp::Swiglu { f } else { 2 * f };
            expect_shape("out", out, (rows, want), "the result's shape")?;
            Ok(RowsDims {
                tokens: 0,
                top_k: 0,
                rows,
                cols: f,
            })
        }
        RowsOp::GatherSum | RowsOp::ScatterRows | RowsOp::RowDots => {
            let (tokens, top_k) = index.ok_or_else(|| internal("index"))?;
            let (rows, cols) = match c.op {
                RowsOp::GatherSum => {
                    expect_shape("out", out, (tokens, x.1), "[rows of inverse, columns of y]")?;
                    x
                }
                RowsOp::ScatterRows => {
                    expect_shape(xn, x, (tokens, out.1), "[rows of inverse, columns of out]")?;
                    out
                }
                _ => {
                    let y = y.ok_or_else(|| internal("y"))?;
                    expect_shape(xn, x, (tokens, y.1), "[rows of inverse, columns of y]")?;
                    expect_shape("out", out, (tokens, top_k), "the shape of inverse")?;
                    y
                }
            };
            Ok(RowsDims {
                tokens,
                top_k,
                rows,
                cols,
            })
        }
        _ => Err(Error::Value("internal: unknown row op".into())),
    }
}

/// Runs a row op after [`validate`]: on the CPU here, on CUDA through the bridge (on the
/// face's current stream, no sync).
///
/// # Safety
/// The descriptions are of live arrays that stay alive (and, on CUDA, in use on the
/// current stream) for the call; `out` is disjoint from the inputs.
pub unsafe fn run<M: Memory>(mem: &mut M, c: &RowsCall<'_>) -> Result<()> {
    let d = validate(c)?;
    let w_dtype = match c.op {
        RowsOp::RowDots => c.out.dtype,
        _ => c.weights.map_or(c.x.dtype, |w| w.dtype),
    };
    match c.x.device {
        Device::Cuda(device) => {
            super::cuda::check_compiled()?;
            let stream = mem.stream(device)?;
            let scratch = match c.op {
                RowsOp::ScatterRows if d.rows > 0 => mem.device_bytes(device, d.rows * 4)?,
                _ => 0,
            };
            let r = super::ffi::RowsRequest {
                op: c.op,
                dtype: super::cuda::ffi_dtype(c.x.dtype),
                w_dtype: super::cuda::ffi_dtype(w_dtype),
                device,
                tokens: d.tokens as i64,
                top_k: d.top_k as i64,
                rows: d.rows as i64,
                cols: d.cols as i64,
                x: c.x.ptr as u64,
                y: c.y.map_or(0, |t| t.ptr as u64),
                index: c.index.map_or(0, |t| t.ptr as u64),
                weights: c.weights.map_or(0, |t| t.ptr as u64),
                out: c.out.ptr as u64,
                scratch,
                stream,
            };
            // SAFETY: validated request over live device memory (caller's contract).
            unsafe { super::cuda::launch_rows(&r) }
        }
        Device::Cpu => {
            let p = Ptrs {
                x: c.x.ptr,
                y: c.y.map_or(0, |t| t.ptr),
                index: c.index.map_or(0, |t| t.ptr),
                weights: c.weights.map_or(0, |t| t.ptr),
                out: c.out.ptr,
            };
            let op = c.op;
            macro_rules! go {
                ($T:ty) => {
                    match w_dtype {
                        DType::F32 => mem.run_cpu(&mut || unsafe { cpu_rows::<$T, f32>(op, d, p) }),
                        _ => mem.run_cpu(&mut || unsafe { cpu_rows::<$T, $T>(op, d, p) }),
                    }
                };
            }
            match c.x.dtype {
                DType::F16 => go!(f16),
                DType::BF16 => go!(bf16),
                DType::F32 => go!(f32),
                DType::F64 => go!(f64),
            }
            Ok(())
        }
    }
}

/// Addresses of a CPU call (0: absent).
#[derive(Clone, Copy)]
struct Ptrs {
    x: usize,
    y: usize,
    index: usize,
    weights: usize,
    out: usize,
}

/// # Safety
/// `p` holds arrays of the validated extents `d` (SAFETY of [`run`]).
unsafe fn cpu_rows<T: Element, W: Element>(op: RowsOp, d: RowsDims, p: Ptrs) {
    let RowsDims {
        tokens,
        top_k,
        rows,
        cols,
    } = d;
    // SAFETY (every slice below): contiguous arrays of these extents (validated).
    let slice = |ptr: usize, len: usize| -> &[T] {
        if len == 0 {
            &[]
        } else {
            unsafe { std::slice::from_raw_parts(ptr as *const T, len) }
        }
    };
    let index: &[i32] = if p.index == 0 || tokens * top_k == 0 {
        &[]
    } else {
        unsafe { std::slice::from_raw_parts(p.index as *const i32, tokens * top_k) }
    };
    let weights: Option<&[W]> = (p.weights != 0 && tokens * top_k > 0)
        .then(|| unsafe { std::slice::from_raw_parts(p.weights as *const W, tokens * top_k) });
    let w = |i: usize| weights.map_or(1.0, |w| w[i].to_f64());
    let row_of = |i: usize| usize::try_from(index[i]).ok().filter(|&r| r < rows);
    let out_len = match op {
        RowsOp::Swiglu => rows * cols,
        RowsOp::SwigluBackward => rows * 2 * cols,
        RowsOp::GatherSum => tokens * cols,
        RowsOp::ScatterRows => rows * cols,
        _ => 0,
    };
    if op == RowsOp::RowDots {
        if tokens * top_k == 0 {
            return;
        }
        let out = unsafe { std::slice::from_raw_parts_mut(p.out as *mut W, tokens * top_k) };
        let (g, y) = (slice(p.x, tokens * cols), slice(p.y, rows * cols));
        out.par_iter_mut().enumerate().for_each(|(i, o)| {
            let s = row_of(i).map_or(0.0, |r| {
                let (a, b) = (&g[(i / top_k) * cols..][..cols], &y[r * cols..][..cols]);
                a.iter().zip(b).map(|(u, v)| u.to_f64() * v.to_f64()).sum()
            });
            *o = W::from_f64(s);
        });
        return;
    }
    if out_len == 0 {
        return;
    }
    let out = unsafe { std::slice::from_raw_parts_mut(p.out as *mut T, out_len) };
    match op {
        RowsOp::Swiglu => {
            let pre = slice(p.x, rows * 2 * cols);
            out.par_chunks_mut(cols).enumerate().for_each(|(r, o)| {
                let (g, u) = pre[r * 2 * cols..][..2 * cols].split_at(cols);
                for c in 0..cols {
                    let gv = g[c].to_f64();
                    o[c] = T::from_f64(gv / (1.0 + (-gv).exp()) * u[c].to_f64());
                }
            });
        }
        RowsOp::SwigluBackward => {
            let (grad, pre) = (slice(p.x, rows * cols), slice(p.y, rows * 2 * cols));
            out.par_chunks_mut(2 * cols).enumerate().for_each(|(r, o)| {
                let (g, u) = pre[r * 2 * cols..][..2 * cols].split_at(cols);
                let dh = &grad[r * cols..][..cols];
                let (dg, du) = o.split_at_mut(cols);
                for c in 0..cols {
                    let (d, gv, uv) = (dh[c].to_f64(), g[c].to_f64(), u[c].to_f64());
                    let s = 1.0 / (1.0 + (-gv).exp());
                    dg[c] = T::from_f64(d * uv * s * (1.0 + gv * (1.0 - s)));
                    du[c] = T::from_f64(d * gv * s);
                }
            });
        }
        RowsOp::GatherSum => {
            let y = slice(p.x, rows * cols);
            out.par_chunks_mut(cols).enumerate().for_each(|(t, o)| {
                let mut acc = vec![0.0f64; cols];
                for j in 0..top_k {
                    if let Some(r) = row_of(t * top_k + j) {
                        let wj = w(t * top_k + j);
                        for (a, v) in acc.iter_mut().zip(&y[r * cols..][..cols]) {
                            *a += wj * v.to_f64();
                        }
                    }
                }
                for (o, a) in o.iter_mut().zip(acc) {
                    *o = T::from_f64(a);
                }
            });
        }
        RowsOp::ScatterRows => {
            // Row by row through the inverse permutation, as on the GPU.
            let grad = slice(p.x, tokens * cols);
            let mut assign = vec![usize::MAX; rows];
            for i in 0..tokens * top_k {
                if let Some(r) = row_of(i) {
                    assign[r] = i;
                }
            }
            out.par_chunks_mut(cols).zip(assign).for_each(|(o, a)| {
                if a == usize::MAX {
                    o.fill(T::zero());
                } else {
                    let wa = w(a);
                    for (o, g) in o.iter_mut().zip(&grad[(a / top_k) * cols..][..cols]) {
                        *o = T::from_f64(wa * g.to_f64());
                    }
                }
            });
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::Layout;

    fn t(shape: &[usize], dtype: DType, data: &[f32]) -> (Vec<f32>, Tensor) {
        let v = data.to_vec();
        let tensor = Tensor {
            ptr: v.as_ptr() as usize,
            dtype,
            layout: Layout::contiguous(shape),
            device: Device::Cpu,
            id: 0,
            transposed: false,
        };
        (v, tensor)
    }

    struct Host;
    impl Memory for Host {
        type Out = ();
        fn alloc(&mut self, _: &[usize], _: DType, _: Device) -> Result<super::super::Output<()>> {
            unreachable!()
        }
    }

    fn index(data: &[i32], shape: &[usize]) -> (Vec<i32>, Offs) {
        let v = data.to_vec();
        let o = Offs {
            ptr: v.as_ptr() as usize,
            layout: Layout::contiguous(shape),
            device: Device::Cpu,
            id: 0,
        };
        (v, o)
    }

    fn rows_call<'a>(
        op: RowsOp,
        x: &'a Tensor,
        y: Option<&'a Tensor>,
        index: Option<&'a Offs>,
        weights: Option<&'a Tensor>,
        out: &'a Tensor,
    ) -> RowsCall<'a> {
        RowsCall {
            op,
            x,
            y,
            index,
            weights,
            out,
        }
    }

    #[test]
    fn gather_sum_and_scatter_rows_against_loops() {
        // 2 tokens, k = 2, 4 rows of 3 columns; row 3 unnamed, one index out of range.
        let (_y, y) = t(
            &[4, 3],
            DType::F32,
            &[1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12.],
        );
        let (_i, inv) = index(&[2, 0, 1, 9], &[2, 2]);
        let (_w, w) = t(&[2, 2], DType::F32, &[0.5, 2.0, -1.0, 3.0]);
        let (out_v, out) = t(&[2, 3], DType::F32, &[0.0; 6]);
        let call = rows_call(RowsOp::GatherSum, &y, None, Some(&inv), Some(&w), &out);
        unsafe { run(&mut Host, &call) }.unwrap();
        // token 0: 0.5*row2 + 2*row0; token 1: -row1 (row 9 ignored)
        assert_eq!(out_v, vec![5.5, 8.0, 10.5, -4.0, -5.0, -6.0]);

        let (_g, g) = t(&[2, 3], DType::F32, &[1., 2., 3., 4., 5., 6.]);
        let (dy_v, dy) = t(&[4, 3], DType::F32, &[f32::NAN; 12]);
        let call = rows_call(RowsOp::ScatterRows, &g, None, Some(&inv), Some(&w), &dy);
        unsafe { run(&mut Host, &call) }.unwrap();
        assert_eq!(
            dy_v,
            vec![2., 4., 6., -4., -5., -6., 0.5, 1., 1.5, 0., 0., 0.]
        );

        let (dots_v, dots) = t(&[2, 2], DType::F32, &[9.0; 4]);
        let call = rows_call(RowsOp::RowDots, &g, Some(&y), Some(&inv), None, &dots);
        unsafe { run(&mut Host, &call) }.unwrap();
        assert_eq!(
            dots_v,
            vec![7. + 16. + 27., 1. + 4. + 9., 4. * 4. + 25. + 36., 0.]
        );
    }

    #[test]
    fn bad_shapes_and_dtypes_name_the_argument() {
        let (_y, y) = t(&[4, 3], DType::F32, &[0.0; 12]);
        let (_i, inv) = index(&[0, 1, 2, 3], &[2, 2]);
        let (_o, out) = t(&[2, 4], DType::F32, &[0.0; 8]);
        let call = rows_call(RowsOp::GatherSum, &y, None, Some(&inv), None, &out);
        let e = validate(&call).unwrap_err().to_string();
        assert!(e.starts_with("out: expected shape [2, 3]"), "{e}");
        let (_p, pre) = t(&[2, 3], DType::F32, &[0.0; 6]);
        let call = rows_call(RowsOp::Swiglu, &pre, None, None, None, &out);
        let e = validate(&call).unwrap_err().to_string();
        assert!(e.starts_with("pre: expected an even last dimension"), "{e}");
        let (_w, w) = t(&[2, 2], DType::F64, &[0.0; 4]);
        let (_o2, out2) = t(&[2, 3], DType::F32, &[0.0; 6]);
        let call = rows_call(RowsOp::GatherSum, &y, None, Some(&inv), Some(&w), &out2);
        let e = validate(&call).unwrap_err().to_string();
        assert!(
            e.starts_with("weights: expected dtype torch.float32, found torch.float64"),
            "{e}"
        );
    }

    #[test]
    fn swiglu_and_its_backward_match_finite_differences() {
        let pre = [0.3f32, -1.2, 2.0, 0.7, 1.5, -0.4];
        let (_p, p) = t(&[1, 6], DType::F32, &pre);
        let (act_v, act) = t(&[1, 3], DType::F32, &[0.0; 3]);
        let call = rows_call(RowsOp::Swiglu, &p, None, None, None, &act);
        unsafe { run(&mut Host, &call) }.unwrap();
        let f = |v: &[f64]| -> Vec<f64> {
            (0..3)
                .map(|c| v[c] / (1.0 + (-v[c]).exp()) * v[3 + c])
                .collect()
        };
        let pre64: Vec<f64> = pre.iter().map(|&v| v as f64).collect();
        for (a, b) in act_v.iter().zip(f(&pre64)) {
            assert!((*a as f64 - b).abs() < 1e-6);
        }
        let grad = [1.0f32, -2.0, 0.5];
        let (_g, g) = t(&[1, 3], DType::F32, &grad);
        let (d_v, d) = t(&[1, 6], DType::F32, &[0.0; 6]);
        let call = rows_call(RowsOp::SwigluBackward, &g, Some(&p), None, None, &d);
        unsafe { run(&mut Host, &call) }.unwrap();
        for i in 0..6 {
            let (mut hi, mut lo) = (pre64.clone(), pre64.clone());
            hi[i] += 1e-6;
            lo[i] -= 1e-6;
            let fd: f64 = f(&hi)
                .iter()
                .zip(f(&lo))
                .zip(grad)
                .map(|((a, b), g)| (a - b) / 2e-6 * g as f64)
                .sum();
            assert!((d_v[i] as f64 - fd).abs() < 1e-4, "{i}: {} vs {fd}", d_v[i]);
        }
    }
}
