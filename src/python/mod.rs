//! The PyO3 module `groupmm._native`: the torch/numpy face of the engine.
//!
//! Each function reads its arguments (torch tensors or numpy arrays, as Python objects:
//! data pointer, shape, strides, dtype, device), maps them to the engine's descriptions,
//! calls the engine (`crate::exec`) with a [`runtime::PyRuntime`] that lends what torch's
//! (or numpy's) runtime provides, and maps errors to Python exceptions. The engine runs
//! the CPU kernels with the GIL released and the CUDA kernels on torch's current stream.
//! No Rust panic reaches Python: every entry point catches them.
//!
//! By what the functions do: `gemm` (the grouped GEMMs and their backwards), `product`
//! (the products of the MoE layer: gathered rows, the fused expert products), `rows` (the
//! row ops of the MoE glue), `info` (what the build holds, the shape rules the fakes ask,
//! the deferred error flag); this file holds what they share and the module itself.

mod gemm;
mod info;
mod product;
mod rows;
mod runtime;
mod tensor;

use crate::error::Error;
use crate::exec;
use crate::shape;
use crate::DType;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use runtime::PyRuntime;
use tensor::{Kind, Torch};

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        match e {
            Error::Shape(m) | Error::Value(m) => PyValueError::new_err(m),
            Error::Dtype(m) | Error::Type(m) => PyTypeError::new_err(m),
            Error::Device(m) | Error::Cuda(m) => PyRuntimeError::new_err(m),
        }
    }
}

/// One output object.
pub(super) type Obj<'py> = Bound<'py, PyAny>;

/// Runs `f`, turning a Rust panic into a `RuntimeError`.
pub(super) fn guard<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(PyRuntimeError::new_err(format!(
                "groupmm internal error (please report): {msg}"
            )))
        }
    }
}

/// The [`DType`] of a `torch.dtype` or numpy dtype object, if it is one groupmm knows.
pub(super) fn dtype_of(
    py: Python<'_>,
    kind: Kind,
    obj: &Bound<'_, PyAny>,
) -> PyResult<Option<DType>> {
    Ok(match kind {
        Kind::Torch => Torch::get(py)?.and_then(|t| t.dtype_of(py, obj)),
        Kind::Numpy => match py.import("numpy")?.call_method1("dtype", (obj,)) {
            Ok(d) => [
                ("float16", DType::F16),
                ("float32", DType::F32),
                ("float64", DType::F64),
            ]
            .into_iter()
            .find(|(n, _)| d.eq(*n).unwrap_or(false))
            .map(|(_, t)| t),
            Err(_) => None,
        },
    })
}

/// Resolves `out_dtype` (a `torch.dtype`, numpy dtype, or None) against the input dtype
/// with the rule of [`shape::resolve_out_dtype`].
pub(super) fn resolve_out_dtype(
    py: Python<'_>,
    kind: Kind,
    input: DType,
    out_dtype: Option<&Bound<'_, PyAny>>,
) -> PyResult<DType> {
    let Some(od) = out_dtype.filter(|o| !o.is_none()) else {
        return Ok(input);
    };
    let found = dtype_of(py, kind, od)?;
    Ok(shape::resolve_out_dtype(input, found, od.str()?)?)
}

/// An optional argument, `None` when absent or Python's `None`.
pub(super) fn not_none<'a, 'py>(o: Option<&'a Bound<'py, PyAny>>) -> Option<&'a Bound<'py, PyAny>> {
    o.filter(|o| !o.is_none())
}

/// `offs` of a call that requires it (int32).
pub(super) fn required_offs<'py>(
    rt: &mut PyRuntime<'py>,
    offs: &Bound<'py, PyAny>,
) -> PyResult<exec::IntTensor> {
    Ok(rt
        .offs(Some(offs))?
        .ok_or_else(|| Error::Value("offs: expected an int32 tensor, found None".into()))?)
}

#[pymodule]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(gemm::grouped_mm, m)?)?;
    m.add_function(wrap_pyfunction!(gemm::grouped_mm_backward, m)?)?;
    m.add_function(wrap_pyfunction!(gemm::grouped_mm_list, m)?)?;
    m.add_function(wrap_pyfunction!(gemm::grouped_mm_list_backward, m)?)?;
    m.add_function(wrap_pyfunction!(product::gather_mm, m)?)?;
    m.add_function(wrap_pyfunction!(product::gather_k_mm, m)?)?;
    m.add_function(wrap_pyfunction!(product::product, m)?)?;
    m.add_function(wrap_pyfunction!(rows::swiglu, m)?)?;
    m.add_function(wrap_pyfunction!(rows::swiglu_backward, m)?)?;
    m.add_function(wrap_pyfunction!(rows::gather_sum, m)?)?;
    m.add_function(wrap_pyfunction!(rows::scatter_rows, m)?)?;
    m.add_function(wrap_pyfunction!(rows::row_dots, m)?)?;
    m.add_function(wrap_pyfunction!(rows::topk_ids, m)?)?;
    m.add_function(wrap_pyfunction!(info::packed_out_shape, m)?)?;
    m.add_function(wrap_pyfunction!(info::list_out_shapes, m)?)?;
    m.add_function(wrap_pyfunction!(info::build_info, m)?)?;
    m.add_function(wrap_pyfunction!(info::gathers_in_gemm, m)?)?;
    m.add_function(wrap_pyfunction!(info::take_deferred_error, m)?)?;
    m.add_function(wrap_pyfunction!(info::set_sm_limit, m)?)?;
    m.add_function(wrap_pyfunction!(info::sm_limit, m)?)?;
    m.add("__version__", crate::VERSION)?;
    m.add("TOPK_CUDA_MAX_COLS", shape::TOPK_CUDA_MAX_COLS)?;
    Ok(())
}
