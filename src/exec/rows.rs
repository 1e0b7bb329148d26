//! The row ops of the MoE glue through the engine (what each computes:
//! [`crate::shape::RowsOp`]): validate (the row rules of [`crate::shape`], and the dtype
//! and device agreement every call has), normalise the operands once (contiguous rows,
//! int32 indices, through the face's [`Runtime`]), allocate the output through the face,
//! and dispatch: the CPU loops of [`crate::cpu`] (GIL released), or one CUDA launch
//! ([`super::cuda::rows`], `cuda/device/rows.cu`) on the current stream, no sync.
//!
//! Arithmetic: fp32 on CUDA (fp64 for float64) and fp64 on the CPU, one rounding per
//! output element; fixed summation order, no atomics (deterministic). TopK compares the
//! values as they are (exactly) and writes int64 ids into an output the face lends
//! ([`Runtime::alloc_int64`]).

use super::cuda;
use super::vocab::{contiguous, contiguous_int32, Device, IntTensor, Output, Runtime, Tensor};
use crate::dtype::DType;
use crate::error::Result;
use crate::shape::{self, RowPtrs, RowsDims};

/// One row op with its operands, as the face described them (names as the Python
/// functions spell them).
#[derive(Debug, Clone, Copy)]
pub enum RowsCall<'a> {
    /// `silu(gate) * up` of `pre = [gate | up]`.
    Swiglu {
        /// `[R, 2F]`.
        pre: &'a Tensor,
    },
    /// `[d gate | d up]` of `Swiglu` from its output gradient.
    SwigluBackward {
        /// `[R, F]`.
        grad: &'a Tensor,
        /// `[R, 2F]`.
        pre: &'a Tensor,
    },
    /// `out[t] = sum_j weights[t, j] * y[inverse[t, j]]`.
    GatherSum {
        /// `[R, D]`.
        y: &'a Tensor,
        /// `[T, k]`.
        inverse: &'a IntTensor,
        /// `[T, k]` of `y`'s dtype or float32; absent: weight 1.
        weights: Option<&'a Tensor>,
    },
    /// `out[inverse[t, j]] = weights[t, j] * grad[t]` into `[rows, D]`.
    ScatterRows {
        /// `[T, D]`.
        grad: &'a Tensor,
        /// `[T, k]`.
        inverse: &'a IntTensor,
        /// `[T, k]` of `grad`'s dtype or float32; absent: weight 1.
        weights: Option<&'a Tensor>,
        /// Rows `R` of the output.
        rows: usize,
    },
    /// `out[t, j] = <grad[t], y[inverse[t, j]]>` as `out_dtype`.
    RowDots {
        /// `[T, D]`.
        grad: &'a Tensor,
        /// `[R, D]`.
        y: &'a Tensor,
        /// `[T, k]`.
        inverse: &'a IntTensor,
        /// `grad`'s dtype or float32 (resolved by the face,
        /// [`shape::resolve_out_dtype_or_f32`]).
        out_dtype: DType,
    },
    /// `out[t, j]` (int64): the column of the `j`-th largest of the `k` largest values of
    /// `scores[t]` ([`shape::topk_before`]'s order).
    TopK {
        /// `[T, E]`.
        scores: &'a Tensor,
        /// `1 <= k <= E` (checked by [`shape::plan_topk`]; signed, so that a negative `k`
        /// gets the rule's message).
        k: i64,
    },
}

/// A validated call: its extents and its operands in the order the kernels take them.
struct Checked<'a> {
    dims: RowsDims,
    x: &'a Tensor,
    y: Option<&'a Tensor>,
    inverse: Option<&'a IntTensor>,
    weights: Option<&'a Tensor>,
    /// The output's dtype.
    out_dtype: DType,
    /// Of the weights and of RowDots' output: `x`'s dtype or float32.
    w_dtype: DType,
}

/// `inverse` and `weights` agree with `x` (named `like`) in device and dtype.
fn check_routing(
    like: &str,
    x: &Tensor,
    inverse: &IntTensor,
    weights: Option<&Tensor>,
) -> Result<()> {
    shape::check_like("inverse", (None, inverse.device), like, x.reference())?;
    if let Some(w) = weights {
        shape::check_like("weights", (None, w.device), like, x.reference())?;
        shape::check_like_or_f32("weights", w.dtype, like, x.dtype)?;
    }
    Ok(())
}

/// Every check of a row op; nothing is read, allocated or written.
fn validate<'a>(call: &RowsCall<'a>) -> Result<Checked<'a>> {
    // The operands' dtype for the output and the weights, no index, no weights.
    let plain = |dims, x: &'a Tensor, y| Checked {
        dims,
        x,
        y,
        inverse: None,
        weights: None,
        out_dtype: x.dtype,
        w_dtype: x.dtype,
    };
    // Weighted by `weights` (absent: weight 1, read as `x`'s dtype).
    let routed = |dims, x: &'a Tensor, inverse, weights: Option<&'a Tensor>| Checked {
        inverse: Some(inverse),
        weights,
        w_dtype: weights.map_or(x.dtype, |w| w.dtype),
        ..plain(dims, x, None)
    };
    Ok(match *call {
        RowsCall::Swiglu { pre } => plain(shape::plan_swiglu(&pre.layout)?, pre, None),
        RowsCall::SwigluBackward { grad, pre } => {
            shape::check_like("pre", pre.like(), "grad", grad.reference())?;
            let dims = shape::plan_swiglu_backward(&grad.layout, &pre.layout)?;
            plain(dims, grad, Some(pre))
        }
        RowsCall::GatherSum {
            y,
            inverse,
            weights,
        } => {
            check_routing("y", y, inverse, weights)?;
            let w = weights.map(|w| &w.layout);
            let dims = shape::plan_gather_sum(&y.layout, &inverse.layout, w)?;
            routed(dims, y, inverse, weights)
        }
        RowsCall::ScatterRows {
            grad,
            inverse,
            weights,
            rows,
        } => {
            check_routing("grad", grad, inverse, weights)?;
            let w = weights.map(|w| &w.layout);
            let dims = shape::plan_scatter_rows(&grad.layout, &inverse.layout, w, rows)?;
            routed(dims, grad, inverse, weights)
        }
        RowsCall::RowDots {
            grad,
            y,
            inverse,
            out_dtype,
        } => {
            shape::check_like("y", y.like(), "grad", grad.reference())?;
            check_routing("grad", grad, inverse, None)?;
            let dims = shape::plan_row_dots(&grad.layout, &y.layout, &inverse.layout)?;
            Checked {
                y: Some(y),
                out_dtype,
                w_dtype: out_dtype,
                ..routed(dims, grad, inverse, None)
            }
        }
        RowsCall::TopK { scores, k } => {
            let dims = shape::plan_topk(&scores.layout, k)?;
            if let Device::Cuda(_) = scores.device {
                shape::check_topk_cuda(&dims)?;
            }
            plain(dims, scores, None)
        }
    })
}

/// Runs a row op into a fresh output, which it returns.
///
/// # Safety
/// The descriptions are of live arrays that stay alive (and, on CUDA, in use on the
/// current stream) for the call.
pub unsafe fn run<R: Runtime>(rt: &mut R, call: RowsCall<'_>) -> Result<R::Out> {
    let c = validate(&call)?;
    let device = c.x.device;
    if let Device::Cuda(_) = device {
        cuda::check_compiled()?;
    }
    let x = contiguous(rt, c.x)?;
    let y = c.y.map(|t| contiguous(rt, t)).transpose()?;
    let inverse = c.inverse.map(|i| contiguous_int32(rt, i)).transpose()?;
    let weights = c.weights.map(|t| contiguous(rt, t)).transpose()?;
    let shape = c.dims.out_shape();
    let (o, out) = if c.dims.writes_index() {
        rt.alloc_int64(&shape, device)?
    } else {
        let (o, out) = rt.alloc(&shape, c.out_dtype, device)?;
        (o, out.ptr)
    };
    let p = RowPtrs {
        x: x.ptr,
        y: y.map_or(0, |t| t.ptr),
        inverse: inverse.map_or(0, |i| i.ptr),
        weights: weights.map_or(0, |t| t.ptr),
        out,
    };
    // SAFETY: validated extents over live contiguous operands (contract, or copies the
    // face keeps for the call); `out` is fresh.
    unsafe { launch(rt, &c.dims, device, (x.dtype, c.w_dtype), p)? };
    Ok(o)
}

/// `shape::check_indices` on the op's index, when it reads one (host memory only).
///
/// # Safety
/// `inverse` is 0 or the address of `tokens * top_k` live host int32 values.
unsafe fn check_indices(dims: &RowsDims, inverse: usize) -> Result<()> {
    let n = dims.tokens * dims.top_k;
    if inverse == 0 || n == 0 {
        return Ok(());
    }
    // SAFETY: forwarded contract.
    let idx = unsafe { std::slice::from_raw_parts(inverse as *const i32, n) };
    crate::shape::check_indices(idx, dims.rows)
}

/// Runs a validated row op on contiguous operands: the CPU loops or one CUDA launch.
///
/// # Safety
/// `p` holds live contiguous arrays on `device` of the extents `dims` and the dtypes
/// given (`(operands, weights)`); `out` is disjoint from the inputs.
pub(super) unsafe fn launch<R: Runtime>(
    rt: &mut R,
    dims: &RowsDims,
    device: Device,
    dtypes: (DType, DType),
    p: RowPtrs,
) -> Result<()> {
    match device {
        // SAFETY: forwarded contract.
        Device::Cuda(d) => unsafe { cuda::rows(rt, d, dims, dtypes, p) },
        Device::Cpu => {
            // SAFETY: forwarded contract (host memory).
            unsafe { check_indices(dims, p.inverse) }?;
            // SAFETY: forwarded contract (host memory).
            rt.run_cpu(&mut || unsafe { crate::cpu::rows::run(dims, dtypes.0, dtypes.1, p) });
            Ok(())
        }
    }
}

/// The rows `x[src[r]]` of a gathered product in a fresh contiguous `[R, K]` (a row
/// whose `src` is out of range: zeros on CUDA, where the device's deferred flag reports
/// it; an error on the CPU, [`shape::check_indices`]): the row op `GatherSum` with `src`
/// as a one-column `inverse` (row `r` sums the one row `src[r]`). The output object keeps
/// the rows alive.
///
/// # Safety
/// As [`run`]; `x` is 2-D and `src` contiguous int32 (validated by
/// [`shape::plan_product`], made so by [`contiguous_int32`]).
pub(super) unsafe fn gather_rows<R: Runtime>(
    rt: &mut R,
    x: &Tensor,
    src: &IntTensor,
) -> Result<Output<R::Out>> {
    let x = contiguous(rt, x)?;
    let (rows, k) = (src.layout.shape[0], x.layout.shape[1]);
    let out = rt.alloc(&[rows, k], x.dtype, x.device)?;
    let gather = shape::RowsDims {
        op: shape::RowsOp::GatherSum,
        tokens: rows,
        top_k: 1,
        rows: x.layout.shape[0],
        cols: k,
    };
    let p = RowPtrs {
        x: x.ptr,
        inverse: src.ptr,
        out: out.1.ptr,
        ..Default::default()
    };
    // SAFETY: forwarded contract; `x` and `src` contiguous, the output fresh `[R, K]`.
    unsafe { launch(rt, &gather, x.device, (x.dtype, x.dtype), p)? };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::layout::Layout;

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

    /// Fresh float32 outputs filled with NaN (every element must be written).
    struct Host;
    impl Runtime for Host {
        type Out = Vec<f32>;
        fn alloc(
            &mut self,
            shape: &[usize],
            dtype: DType,
            device: Device,
        ) -> Result<Output<Vec<f32>>> {
            assert_eq!((dtype, device), (DType::F32, Device::Cpu));
            let (v, t) = t(shape, dtype, &vec![f32::NAN; shape.iter().product()]);
            Ok((v, t))
        }
    }

    fn index(data: &[i32], shape: &[usize]) -> (Vec<i32>, IntTensor) {
        let v = data.to_vec();
        let o = IntTensor {
            ptr: v.as_ptr() as usize,
            layout: Layout::contiguous(shape),
            device: Device::Cpu,
            id: 0,
            int32: true,
        };
        (v, o)
    }

    fn run(call: RowsCall<'_>) -> Vec<f32> {
        unsafe { super::run(&mut Host, call) }.unwrap()
    }

    #[test]
    fn gather_sum_and_scatter_rows_against_loops() {
        // 2 tokens, k = 2, 4 rows of 3 columns.
        let (_y, y) = t(
            &[4, 3],
            DType::F32,
            &[1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12.],
        );
        let (_i, inv) = index(&[2, 0, 1, 3], &[2, 2]);
        let (_w, w) = t(&[2, 2], DType::F32, &[0.5, 2.0, -1.0, 3.0]);
        let out = run(RowsCall::GatherSum {
            y: &y,
            inverse: &inv,
            weights: Some(&w),
        });
        // token 0: 0.5*row2 + 2*row0; token 1: -row1 + 3*row3
        assert_eq!(out, vec![5.5, 8.0, 10.5, 26.0, 28.0, 30.0]);

        let (_g, g) = t(&[2, 3], DType::F32, &[1., 2., 3., 4., 5., 6.]);
        let dy = run(RowsCall::ScatterRows {
            grad: &g,
            inverse: &inv,
            weights: Some(&w),
            rows: 4,
        });
        assert_eq!(
            dy,
            vec![2., 4., 6., -4., -5., -6., 0.5, 1., 1.5, 12., 15., 18.]
        );

        let dots = run(RowsCall::RowDots {
            grad: &g,
            y: &y,
            inverse: &inv,
            out_dtype: DType::F32,
        });
        assert_eq!(
            dots,
            vec![
                7. + 16. + 27.,
                1. + 4. + 9.,
                16. + 25. + 36.,
                40. + 55. + 72.
            ]
        );
    }

    /// An index outside `[0, rows)` is an error on the host, naming the index and its
    /// position, for every op that reads one (never a silent zero row).
    #[test]
    fn routing_index_out_of_range_is_an_error() {
        let (_y, y) = t(&[4, 3], DType::F32, &[0.0; 12]);
        let (_g, g) = t(&[2, 3], DType::F32, &[0.0; 6]);
        for bad in [9, 4, -1] {
            let (_i, inv) = index(&[2, 0, 1, bad], &[2, 2]);
            let calls = [
                RowsCall::GatherSum {
                    y: &y,
                    inverse: &inv,
                    weights: None,
                },
                RowsCall::ScatterRows {
                    grad: &g,
                    inverse: &inv,
                    weights: None,
                    rows: 4,
                },
                RowsCall::RowDots {
                    grad: &g,
                    y: &y,
                    inverse: &inv,
                    out_dtype: DType::F32,
                },
            ];
            for call in calls {
                let msg = match unsafe { super::run(&mut Host, call) } {
                    Err(e) => e.to_string(),
                    Ok(_) => panic!("index {bad} accepted"),
                };
                assert!(
                    msg.contains(&format!("routing index {bad} at position 3")),
                    "{msg}"
                );
                assert!(msg.contains("[0, 4)"), "{msg}");
            }
        }
    }

    #[test]
    fn bad_dtypes_and_devices_name_the_argument() {
        let (_y, y) = t(&[4, 3], DType::F32, &[0.0; 12]);
        let (_i, inv) = index(&[0, 1, 2, 3], &[2, 2]);
        let (_w, w) = t(&[2, 2], DType::F64, &[0.0; 4]);
        let call = RowsCall::GatherSum {
            y: &y,
            inverse: &inv,
            weights: Some(&w),
        };
        let e = validate(&call).err().unwrap().to_string();
        assert_eq!(
            e,
            "weights: expected dtype torch.float32 (the dtype of y), found torch.float64"
        );
        let (_p, pre) = t(&[2, 6], DType::F64, &[0.0; 12]);
        let (_g, g) = t(&[2, 3], DType::F32, &[0.0; 6]);
        let call = RowsCall::SwigluBackward {
            grad: &g,
            pre: &pre,
        };
        let e = validate(&call).err().unwrap().to_string();
        assert_eq!(
            e,
            "pre: expected dtype torch.float32 (the dtype of grad), found torch.float64"
        );
        let mut on_gpu = inv.clone();
        on_gpu.device = Device::Cuda(0);
        let call = RowsCall::RowDots {
            grad: &g,
            y: &y,
            inverse: &on_gpu,
            out_dtype: DType::F32,
        };
        assert!(matches!(
            validate(&call).err().unwrap(),
            Error::Device(m) if m == "inverse: expected a tensor on cpu (the device of grad), found one on cuda:0"
        ));
        let call = RowsCall::Swiglu { pre: &g };
        let e = validate(&call).err().unwrap().to_string();
        assert!(e.starts_with("pre: expected an even last dimension"), "{e}");
    }

    /// TopK through the engine: its int64 output comes from `alloc_int64` (never `alloc`)
    /// and every id is written; wide rows are refused on CUDA only, before anything runs.
    #[test]
    fn topk_through_the_engine() {
        struct Ids;
        impl Runtime for Ids {
            type Out = Vec<i64>;
            fn alloc(&mut self, _: &[usize], _: DType, _: Device) -> Result<Output<Vec<i64>>> {
                panic!("TopK's output is int64")
            }
            fn alloc_int64(
                &mut self,
                shape: &[usize],
                device: Device,
            ) -> Result<(Vec<i64>, usize)> {
                assert_eq!(device, Device::Cpu);
                let v = vec![-7i64; shape.iter().product()];
                let ptr = v.as_ptr() as usize;
                Ok((v, ptr))
            }
        }
        let (inf, nan) = (f32::INFINITY, f32::NAN);
        let rows = [
            [0.5, 2.0, -1.0, 2.0, nan], // NaN first, then the tie by column
            [-inf, -0.0, 0.0, inf, 1.0],
            [3.0, 2.0, 1.0, 0.0, -1.0],
        ];
        let (_s, scores) = t(&[3, 5], DType::F32, rows.as_flattened());
        let topk =
            |scores: &Tensor, k| unsafe { super::run(&mut Ids, RowsCall::TopK { scores, k }) };
        assert_eq!(topk(&scores, 3).unwrap(), vec![4, 1, 3, 3, 4, 1, 0, 1, 2]);
        let e = topk(&scores, 6).unwrap_err().to_string();
        assert!(e.starts_with("k: expected an integer in [1, 5]"), "{e}");

        let (_w, mut wide) = t(&[2, 1025], DType::F32, &[0.0; 2 * 1025]);
        assert_eq!(topk(&wide, 2).unwrap(), vec![0, 1, 0, 1]);
        wide.device = Device::Cuda(0);
        let e = validate(&RowsCall::TopK {
            scores: &wide,
            k: 2,
        })
        .err()
        .unwrap();
        assert!(matches!(e, Error::Shape(ref m)
            if m.starts_with("scores: expected at most 1024 columns on CUDA")));
    }

    #[test]
    fn swiglu_and_its_backward_match_finite_differences() {
        let pre = [0.3f32, -1.2, 2.0, 0.7, 1.5, -0.4];
        let (_p, p) = t(&[1, 6], DType::F32, &pre);
        let act = run(RowsCall::Swiglu { pre: &p });
        let f = |v: &[f64]| -> Vec<f64> {
            (0..3)
                .map(|c| v[c] / (1.0 + (-v[c]).exp()) * v[3 + c])
                .collect()
        };
        let pre64: Vec<f64> = pre.iter().map(|&v| v as f64).collect();
        for (a, b) in act.iter().zip(f(&pre64)) {
            assert!((*a as f64 - b).abs() < 1e-6);
        }
        let grad = [1.0f32, -2.0, 0.5];
        let (_g, g) = t(&[1, 3], DType::F32, &grad);
        let d = run(RowsCall::SwigluBackward { grad: &g, pre: &p });
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
            assert!((d[i] as f64 - fd).abs() < 1e-4, "{i}: {} vs {fd}", d[i]);
        }
    }
}
