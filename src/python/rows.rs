//! The row ops of the MoE glue in `_native` (`crate::exec::rows`): one typed function
//! each, its arguments read into a [`RowArgs`] and run as one `RowsCall`.

use super::runtime::PyRuntime;
use super::{dtype_of, guard, not_none};
use crate::exec;
use crate::shape;
use crate::DType;
use pyo3::prelude::*;

/// Runs one row op of the MoE glue (`crate::exec::rows`) on the arguments `read` reads
/// into `rt`; returns its fresh output.
fn row_op<'py>(
    py: Python<'py>,
    read: impl FnOnce(&mut PyRuntime<'py>) -> PyResult<RowArgs>,
) -> PyResult<Bound<'py, PyAny>> {
    guard(|| {
        let mut rt = PyRuntime::new(py);
        let a = read(&mut rt)?;
        let call = a.call();
        // SAFETY: the descriptions are of the argument objects, alive for the call.
        unsafe { exec::rows::run(&mut rt, call) }.map_err(|e| rt.raise(e))
    })
}

/// The arguments of a row op as read (owned), in the order of [`exec::rows::RowsCall`].
enum RowArgs {
    Swiglu(exec::Tensor),
    SwigluBackward(exec::Tensor, exec::Tensor),
    GatherSum(exec::Tensor, exec::IntTensor, Option<exec::Tensor>),
    ScatterRows(exec::Tensor, exec::IntTensor, Option<exec::Tensor>, usize),
    RowDots(exec::Tensor, exec::Tensor, exec::IntTensor, DType),
    TopK(exec::Tensor, i64),
}

impl RowArgs {
    fn call(&self) -> exec::rows::RowsCall<'_> {
        use exec::rows::RowsCall as C;
        match self {
            RowArgs::Swiglu(pre) => C::Swiglu { pre },
            RowArgs::SwigluBackward(grad, pre) => C::SwigluBackward { grad, pre },
            RowArgs::GatherSum(y, inverse, w) => C::GatherSum {
                y,
                inverse,
                weights: w.as_ref(),
            },
            RowArgs::ScatterRows(grad, inverse, w, rows) => C::ScatterRows {
                grad,
                inverse,
                weights: w.as_ref(),
                rows: *rows,
            },
            RowArgs::RowDots(grad, y, inverse, out_dtype) => C::RowDots {
                grad,
                y,
                inverse,
                out_dtype: *out_dtype,
            },
            RowArgs::TopK(scores, k) => C::TopK { scores, k: *k },
        }
    }
}

/// Reads the optional router weights.
fn weights<'py>(
    rt: &mut PyRuntime<'py>,
    w: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<exec::Tensor>> {
    not_none(w).map(|t| rt.input(&"weights", t)).transpose()
}

/// `silu(gate) * up` of `pre = [gate | up]` (`[R, 2F]` → `[R, F]`).
#[pyfunction]
pub(super) fn swiglu<'py>(py: Python<'py>, pre: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    row_op(py, |rt| Ok(RowArgs::Swiglu(rt.reference("pre", pre)?)))
}

/// `[d gate | d up]` of `swiglu` from its output gradient `grad [R, F]`.
#[pyfunction]
pub(super) fn swiglu_backward<'py>(
    py: Python<'py>,
    grad: &Bound<'py, PyAny>,
    pre: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    row_op(py, |rt| {
        let grad = rt.reference("grad", grad)?;
        Ok(RowArgs::SwigluBackward(grad, rt.input(&"pre", pre)?))
    })
}

/// `out[t] = sum_j weights[t, j] * y[inverse[t, j]]` (weight 1 without `weights`).
#[pyfunction]
#[pyo3(signature = (y, inverse, weights=None))]
pub(super) fn gather_sum<'py>(
    py: Python<'py>,
    y: &Bound<'py, PyAny>,
    inverse: &Bound<'py, PyAny>,
    weights: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    row_op(py, |rt| {
        let y = rt.reference("y", y)?;
        let inverse = rt.index("inverse", inverse)?;
        Ok(RowArgs::GatherSum(y, inverse, self::weights(rt, weights)?))
    })
}

/// `out[inverse[t, j]] = weights[t, j] * grad[t]` into `[rows, D]`, written row by row
/// (zeros for rows no index names).
#[pyfunction]
#[pyo3(signature = (grad, inverse, weights, rows))]
pub(super) fn scatter_rows<'py>(
    py: Python<'py>,
    grad: &Bound<'py, PyAny>,
    inverse: &Bound<'py, PyAny>,
    weights: Option<&Bound<'py, PyAny>>,
    rows: usize,
) -> PyResult<Bound<'py, PyAny>> {
    row_op(py, |rt| {
        let grad = rt.reference("grad", grad)?;
        let inverse = rt.index("inverse", inverse)?;
        let w = self::weights(rt, weights)?;
        Ok(RowArgs::ScatterRows(grad, inverse, w, rows))
    })
}

/// `out[t, j] = <grad[t], y[inverse[t, j]]>` as `out_dtype` (`grad`'s dtype or float32).
#[pyfunction]
#[pyo3(signature = (grad, y, inverse, out_dtype=None))]
pub(super) fn row_dots<'py>(
    py: Python<'py>,
    grad: &Bound<'py, PyAny>,
    y: &Bound<'py, PyAny>,
    inverse: &Bound<'py, PyAny>,
    out_dtype: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    row_op(py, |rt| {
        let grad = rt.reference("grad", grad)?;
        let y = rt.input(&"y", y)?;
        let inverse = rt.index("inverse", inverse)?;
        let od = match not_none(out_dtype) {
            None => grad.dtype,
            Some(od) => {
                let found = dtype_of(py, rt.kind(), od)?;
                shape::resolve_out_dtype_or_f32(grad.dtype, found, od.str()?)?
            }
        };
        Ok(RowArgs::RowDots(grad, y, inverse, od))
    })
}

/// The router's top-k: int64 `[T, k]`, row `t` the columns of the `k` largest values of
/// `scores[t]` (`[T, E]`), best first (NaN above every number, ties to the lower column).
#[pyfunction]
pub(super) fn topk_ids<'py>(
    py: Python<'py>,
    scores: &Bound<'py, PyAny>,
    k: i64,
) -> PyResult<Bound<'py, PyAny>> {
    row_op(py, |rt| {
        Ok(RowArgs::TopK(rt.reference("scores", scores)?, k))
    })
}
