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
mod tests;
