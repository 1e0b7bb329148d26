//! The products of the MoE layer in `_native`: each function reads its arguments and
//! asks the engine for one [`ProductRequest`] (`crate::exec::product`); the functions
//! differ only in the request they make. Every fused epilogue goes through one function,
//! [`product`], by the name of its rule.

use super::runtime::PyRuntime;
use super::{guard, not_none, required_offs, resolve_out_dtype, Obj};
use crate::exec::{self, Outputs, ProductRequest};
use crate::shape::{self, Epilogue, Form, Gathered, MAX_OPERANDS};
use pyo3::prelude::*;

/// The outputs of a fused expert product, `None` where no fused kernel runs.
type Fused<T> = PyResult<Option<T>>;

/// Runs `req` on the arguments `rt` read.
fn run<'py>(
    rt: &mut PyRuntime<'py>,
    req: ProductRequest<'_, Obj<'py>>,
) -> PyResult<Option<Outputs<Obj<'py>>>> {
    // SAFETY: the descriptions are of the argument objects, which `rt` and the caller keep
    // alive for the call; `rt` lends the rest.
    unsafe { exec::product(rt, req) }.map_err(|e| rt.raise(e))
}

/// The GroupedM product with gathered rows: `out[r] = x[src[r]] @ w[g]` for the rows
/// of group `g`.
#[pyfunction]
#[pyo3(signature = (x, w, offs, src, out_dtype=None))]
pub(super) fn gather_mm<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    w: &Bound<'py, PyAny>,
    offs: &Bound<'py, PyAny>,
    src: &Bound<'py, PyAny>,
    out_dtype: Option<&Bound<'py, PyAny>>,
) -> PyResult<Obj<'py>> {
    guard(|| {
        let mut rt = PyRuntime::new(py);
        let x = rt.reference("x", x)?;
        let w = rt.input(&"w", w)?;
        let offs = required_offs(&mut rt, offs)?;
        let src = rt.index("src", src)?;
        let od = resolve_out_dtype(py, rt.kind(), x.dtype, out_dtype)?;
        let req = ProductRequest {
            src: Some((&src, Gathered::A)),
            out_dtype: Some(od),
            ..ProductRequest::new(Form::GroupedM, &x, &w, &offs)
        };
        Ok(exec::plain(run(&mut rt, req)?)?)
    })
}

/// The GroupedK product with gathered rows: `out[g] = Σ a_rᵀ @ b_r` over the routed rows
/// `r` of group `g`, with `a_r = a[src[r]]`, `b_r = b[r]` (or, `gathered_b`, `a_r = a[r]`,
/// `b_r = b[src[r]]`); `transposed`: the transposed view of a fresh `[G, N, K]`; `out`:
/// written instead (`[G, K, N]`, any strides; in place where the kernels can, e.g. a slab
/// of a larger gradient) and returned.
#[pyfunction]
#[pyo3(signature = (a, b, offs, src, gathered_b=false, transposed=false, out=None))]
#[allow(clippy::too_many_arguments)]
pub(super) fn gather_k_mm<'py>(
    py: Python<'py>,
    a: &Bound<'py, PyAny>,
    b: &Bound<'py, PyAny>,
    offs: &Bound<'py, PyAny>,
    src: &Bound<'py, PyAny>,
    gathered_b: bool,
    transposed: bool,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Obj<'py>> {
    guard(|| {
        let mut rt = PyRuntime::new(py);
        let a = rt.reference("a", a)?;
        let b = rt.input(&"b", b)?;
        let offs = required_offs(&mut rt, offs)?;
        let src = rt.index("src", src)?;
        let out = not_none(out).map(|o| rt.output(&"out", o)).transpose()?;
        let gathered = if gathered_b { Gathered::B } else { Gathered::A };
        let req = ProductRequest {
            src: Some((&src, gathered)),
            transposed,
            out,
            ..ProductRequest::new(Form::GroupedK, &a, &b, &offs)
        };
        Ok(exec::plain(run(&mut rt, req)?)?)
    })
}

/// A GroupedM product with the fused epilogue named `epilogue` (a rule of
/// `crate::shape::EPILOGUES`, which lists its operands, outputs and what it computes):
/// `x` (or the rule's name for it, e.g. `dy`), `w`, `offs`, the rule's `operands` in its
/// order (`None` for an absent optional one), `src` gathering `x`'s rows, `out` written
/// instead of the first output. Returns every output, the first one first, or `None` where
/// no fused kernel runs (CPU, a second weight of other strides than `w`, or
/// `Unsupported`): the caller composes.
#[pyfunction]
#[pyo3(signature = (epilogue, x, w, offs, operands=None, src=None, out=None))]
#[allow(clippy::too_many_arguments)]
pub(super) fn product<'py>(
    py: Python<'py>,
    epilogue: &str,
    x: &Bound<'py, PyAny>,
    w: &Bound<'py, PyAny>,
    offs: &Bound<'py, PyAny>,
    operands: Option<Vec<Option<Bound<'py, PyAny>>>>,
    src: Option<&Bound<'py, PyAny>>,
    out: Option<&Bound<'py, PyAny>>,
) -> Fused<Vec<Obj<'py>>> {
    guard(|| {
        let rule = shape::find_epilogue(epilogue)?;
        let given = operands.unwrap_or_default();
        if given.len() > MAX_OPERANDS {
            shape::check_operands(rule, &given)?;
        }
        let mut rt = PyRuntime::new(py);
        let x = rt.reference(rule.a, x)?;
        let w = rt.input(&"w", w)?;
        let offs = required_offs(&mut rt, offs)?;
        let mut tensors = Vec::with_capacity(given.len());
        for (i, o) in given.iter().enumerate() {
            let name = rule.operands.get(i).map_or("operand", |o| o.name);
            let t = not_none(o.as_ref()).map(|o| rt.input(&name, o));
            tensors.push(t.transpose()?);
        }
        let src = not_none(src).map(|s| rt.index("src", s)).transpose()?;
        let out = not_none(out).map(|o| rt.output(&"out", o)).transpose()?;
        let req = ProductRequest {
            src: src.as_ref().map(|s| (s, Gathered::A)),
            epilogue: Epilogue::new(rule, tensors.iter().map(Option::as_ref)),
            out,
            ..ProductRequest::new(Form::GroupedM, &x, &w, &offs)
        };
        Ok(run(&mut rt, req)?.map(Outputs::all))
    })
}
