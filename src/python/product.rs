//! The products of the MoE layer in `_native`: each function reads its arguments and
//! asks the engine for one [`ProductRequest`] (`crate::exec::product`); the functions
//! differ only in the request they make.

use super::runtime::PyRuntime;
use super::{guard, not_none, required_offs, resolve_out_dtype, Obj};
use crate::exec::{self, Outputs, ProductRequest};
use crate::shape::{Epilogue, Form, Gathered};
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

/// The fused up projection of a routed SwiGLU expert: `(pre, act)` with
/// `pre = x[src] @ w[g]` (`[R, 2F]`; with `up`, `w` is the gate `[G, K, F]` and
/// `pre = x[src] @ [w[g] | up[g]]`) and `act = silu(gate) * up` (`[R, F]`), or `None`
/// where no fused kernel runs (CPU, `up` of other strides than `w`, or `Unsupported`).
#[pyfunction]
#[pyo3(signature = (x, w, offs, src=None, up=None))]
pub(super) fn swiglu_mm<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    w: &Bound<'py, PyAny>,
    offs: &Bound<'py, PyAny>,
    src: Option<&Bound<'py, PyAny>>,
    up: Option<&Bound<'py, PyAny>>,
) -> Fused<(Obj<'py>, Obj<'py>)> {
    guard(|| {
        let mut rt = PyRuntime::new(py);
        let x = rt.reference("x", x)?;
        let w = rt.input(&"w", w)?;
        let offs = required_offs(&mut rt, offs)?;
        let src = not_none(src).map(|s| rt.index("src", s)).transpose()?;
        let up = not_none(up).map(|u| rt.input(&"up", u)).transpose()?;
        let req = ProductRequest {
            src: src.as_ref().map(|s| (s, Gathered::A)),
            epilogue: Epilogue::SwiGLU { up: up.as_ref() },
            ..ProductRequest::new(Form::GroupedM, &x, &w, &offs)
        };
        Ok(run(&mut rt, req)?.and_then(|o| Some((o.c, o.act?))))
    })
}

/// The fused backward of a routed SwiGLU expert's down projection: `(dpre, act,
/// partial)`, or `None` where no fused kernel runs (CPU, or `Unsupported`). With `src`,
/// `dy` is in token order and row `r` of the product reads `dy[src[r]]`. `out`: `dpre` is
/// written there instead (`[R, 2F]` of `dy`'s dtype) and returned as the first item; it
/// may be `pre` itself (the backward's last read of it: each tile reads its part of `pre`
/// before writing the same part), not otherwise overlap an input.
#[pyfunction]
#[pyo3(signature = (dy, w, offs, pre, scale, src=None, out=None))]
#[allow(clippy::too_many_arguments)]
pub(super) fn dgated_mm<'py>(
    py: Python<'py>,
    dy: &Bound<'py, PyAny>,
    w: &Bound<'py, PyAny>,
    offs: &Bound<'py, PyAny>,
    pre: &Bound<'py, PyAny>,
    scale: &Bound<'py, PyAny>,
    src: Option<&Bound<'py, PyAny>>,
    out: Option<&Bound<'py, PyAny>>,
) -> Fused<(Obj<'py>, Obj<'py>, Obj<'py>)> {
    guard(|| {
        let mut rt = PyRuntime::new(py);
        let dy = rt.reference("dy", dy)?;
        let w = rt.input(&"w", w)?;
        let offs = required_offs(&mut rt, offs)?;
        let pre = rt.input(&"pre", pre)?;
        let scale = rt.input(&"scale", scale)?;
        let src = not_none(src).map(|s| rt.index("src", s)).transpose()?;
        let out = not_none(out).map(|o| rt.output(&"out", o)).transpose()?;
        let req = ProductRequest {
            src: src.as_ref().map(|s| (s, Gathered::A)),
            epilogue: Epilogue::DGated {
                pre: &pre,
                scale: &scale,
            },
            out,
            ..ProductRequest::new(Form::GroupedM, &dy, &w, &offs)
        };
        Ok(run(&mut rt, req)?.and_then(|o| Some((o.c, o.act?, o.partial?))))
    })
}

/// A GroupedM product scaled per row: `out[r] = scale[r] * (x[src[r]] @ w[g])`
/// (`scale` float32 `[R]`, rounded once from the float32 product), or `None` where no
/// fused kernel runs (CPU, or `Unsupported`). Without `src`, the rows of `x` in order.
#[pyfunction]
#[pyo3(signature = (x, w, offs, scale, src=None))]
pub(super) fn row_scaled_mm<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    w: &Bound<'py, PyAny>,
    offs: &Bound<'py, PyAny>,
    scale: &Bound<'py, PyAny>,
    src: Option<&Bound<'py, PyAny>>,
) -> Fused<Obj<'py>> {
    guard(|| {
        let mut rt = PyRuntime::new(py);
        let x = rt.reference("x", x)?;
        let w = rt.input(&"w", w)?;
        let offs = required_offs(&mut rt, offs)?;
        let scale = rt.input(&"scale", scale)?;
        let src = not_none(src).map(|s| rt.index("src", s)).transpose()?;
        let req = ProductRequest {
            src: src.as_ref().map(|s| (s, Gathered::A)),
            epilogue: Epilogue::RowScale { scale: &scale },
            ..ProductRequest::new(Form::GroupedM, &x, &w, &offs)
        };
        Ok(run(&mut rt, req)?.map(|o| o.c))
    })
}
