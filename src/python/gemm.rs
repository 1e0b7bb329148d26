//! The grouped GEMMs of `_native`: the packed forms and the list form, forward and
//! backward (`crate::exec::packed`, `crate::exec::list`).

use super::runtime::PyRuntime;
use super::{guard, not_none, resolve_out_dtype};
use crate::error::Error;
use crate::exec;
use crate::shape::Item;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// `(dA, dB)` of a backward call, each `None` when not requested.
type Grads<'py, T> = (Option<Bound<'py, T>>, Option<Bound<'py, T>>);

/// The items of a sequence argument (`As`, `Bs`, `out`, `grads`).
fn items<'py>(name: &str, seq: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if seq.is_instance_of::<pyo3::types::PyString>() || !seq.hasattr("__len__")? {
        return Err(Error::Type(format!(
            "{name}: expected a sequence of 2-D tensors, found {}",
            seq.get_type().name()?
        ))
        .into());
    }
    seq.try_iter()?.collect()
}

/// Reads the arrays of a sequence argument as inputs; `As[0]` becomes the reference.
fn inputs<'py>(
    rt: &mut PyRuntime<'py>,
    name: &'static str,
    seq: &Bound<'py, PyAny>,
) -> PyResult<Vec<exec::Tensor>> {
    items(name, seq)?
        .iter()
        .enumerate()
        .map(|(i, x)| match (name, i) {
            ("As", 0) => rt.reference("As[0]", x),
            _ => rt.input(&Item(name, i), x),
        })
        .collect()
}

/// Packed grouped product `out = grouped_mm(a, b, offs)`; see ARCHITECTURE.md for the
/// forms.
#[pyfunction]
#[pyo3(signature = (a, b, offs=None, out_dtype=None, out=None))]
pub(super) fn grouped_mm<'py>(
    py: Python<'py>,
    a: &Bound<'py, PyAny>,
    b: &Bound<'py, PyAny>,
    offs: Option<&Bound<'py, PyAny>>,
    out_dtype: Option<&Bound<'py, PyAny>>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    guard(|| {
        let mut rt = PyRuntime::new(py);
        let a = rt.reference("a", a)?;
        let b = rt.input(&"b", b)?;
        let offs = rt.offs(offs)?;
        let od = resolve_out_dtype(py, rt.kind(), a.dtype, out_dtype)?;
        let out = not_none(out).map(|o| rt.output(&"out", o)).transpose()?;
        // SAFETY: the descriptions are of the argument objects, which `rt` and the
        // caller keep alive for the call; `rt` lends the rest.
        unsafe { exec::packed(&mut rt, &a, &b, offs.as_ref(), Some(od), out) }
            .map_err(|e| rt.raise(e))
    })
}

/// Both backward products of a packed product: `(dA, dB)` with `dA = grad·bᵀ`,
/// `dB = aᵀ·grad` (same `offs`); an entry is `None` when not requested.
#[pyfunction]
#[pyo3(signature = (grad, a, b, offs=None, need_a=true, need_b=true))]
pub(super) fn grouped_mm_backward<'py>(
    py: Python<'py>,
    grad: &Bound<'py, PyAny>,
    a: &Bound<'py, PyAny>,
    b: &Bound<'py, PyAny>,
    offs: Option<&Bound<'py, PyAny>>,
    need_a: bool,
    need_b: bool,
) -> PyResult<Grads<'py, PyAny>> {
    guard(|| {
        let mut rt = PyRuntime::new(py);
        let a = rt.reference("a", a)?;
        let grad = rt.input(&"grad", grad)?;
        let b = rt.input(&"b", b)?;
        let offs = rt.offs(offs)?;
        // SAFETY: as in grouped_mm.
        unsafe {
            exec::packed_backward(&mut rt, &grad, &a, &b, offs.as_ref(), need_a, need_b, None)
        }
        .map_err(|e| rt.raise(e))
    })
}

/// List product: `Cs[i] = As[i] · Bs[i]` for every group.
#[pyfunction]
#[pyo3(signature = (a_list, b_list, out_dtype=None, out=None))]
pub(super) fn grouped_mm_list<'py>(
    py: Python<'py>,
    a_list: &Bound<'py, PyAny>,
    b_list: &Bound<'py, PyAny>,
    out_dtype: Option<&Bound<'py, PyAny>>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyList>> {
    guard(|| {
        let mut rt = PyRuntime::new(py);
        let a = inputs(&mut rt, "As", a_list)?;
        let b = inputs(&mut rt, "Bs", b_list)?;
        let outs = match not_none(out) {
            Some(o) => Some(
                items("out", o)?
                    .iter()
                    .enumerate()
                    .map(|(i, x)| rt.output(&Item("out", i), x))
                    .collect::<PyResult<Vec<_>>>()?,
            ),
            None => None,
        };
        let od = match a.first() {
            Some(first) => Some(resolve_out_dtype(py, rt.kind(), first.dtype, out_dtype)?),
            None => None,
        };
        // SAFETY: as in grouped_mm.
        let outs = unsafe { exec::list(&mut rt, &a, &b, od, outs) }.map_err(|e| rt.raise(e))?;
        PyList::new(py, outs)
    })
}

/// Backward of the list product: `(dAs, dBs)`, each `None` when not requested.
#[pyfunction]
#[pyo3(signature = (grads, a_list, b_list, need_a=true, need_b=true))]
pub(super) fn grouped_mm_list_backward<'py>(
    py: Python<'py>,
    grads: &Bound<'py, PyAny>,
    a_list: &Bound<'py, PyAny>,
    b_list: &Bound<'py, PyAny>,
    need_a: bool,
    need_b: bool,
) -> PyResult<Grads<'py, PyList>> {
    guard(|| {
        let mut rt = PyRuntime::new(py);
        let a = inputs(&mut rt, "As", a_list)?;
        let b = inputs(&mut rt, "Bs", b_list)?;
        let g = inputs(&mut rt, "grads", grads)?;
        // SAFETY: as in grouped_mm.
        let (da, db) = unsafe { exec::list_backward(&mut rt, &g, &a, &b, need_a, need_b, None) }
            .map_err(|e| rt.raise(e))?;
        let list = |v: Option<Vec<Bound<'py, PyAny>>>| v.map(|v| PyList::new(py, v)).transpose();
        Ok((list(da)?, list(db)?))
    })
}
