//! What `_native` answers without running a product: the output shapes the fake kernels
//! ask the Rust rules for, what this build holds, and the deferred error flag.

use super::guard;
use crate::dtype::DType;
use crate::exec;
use crate::layout::Layout;
use crate::shape;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// Output shape of a packed product from shapes alone (used by the fake kernels), or a
/// `ValueError` from the shape rules.
#[pyfunction]
#[pyo3(signature = (a_shape, b_shape, offs_len=None))]
pub(super) fn packed_out_shape(
    a_shape: Vec<usize>,
    b_shape: Vec<usize>,
    offs_len: Option<usize>,
) -> PyResult<Vec<usize>> {
    guard(|| {
        let la = Layout::contiguous(&a_shape);
        let lb = Layout::contiguous(&b_shape);
        Ok(shape::plan_packed(&la, &lb, offs_len)?.out_shape)
    })
}

/// Output shapes `[M_i, N_i]` of a list product from shapes alone (used by the fake
/// kernels), or a `ValueError` from the shape rules.
#[pyfunction]
pub(super) fn list_out_shapes(
    a_shapes: Vec<Vec<usize>>,
    b_shapes: Vec<Vec<usize>>,
) -> PyResult<Vec<Vec<usize>>> {
    guard(|| {
        let la: Vec<_> = a_shapes.iter().map(|s| Layout::contiguous(s)).collect();
        let lb: Vec<_> = b_shapes.iter().map(|s| Layout::contiguous(s)).collect();
        Ok(shape::plan_list(&la, &lb)?
            .iter()
            .map(|d| vec![d.m, d.n])
            .collect())
    })
}

/// What this build holds: version, CUDA support, archs, CUDA runtime, CUTLASS.
#[pyfunction]
pub(super) fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", crate::VERSION)?;
    let info = exec::cuda::build_info();
    d.set_item("cuda", info.is_some())?;
    match info {
        Some(i) => {
            d.set_item("cuda_archs", i.archs)?;
            d.set_item("cuda_runtime", i.cuda_runtime)?;
            d.set_item("cutlass", i.cutlass)?;
            d.set_item("dev_knobs", i.dev_knobs)?;
        }
        None => {
            d.set_item("cuda_archs", PyList::empty(py))?;
            d.set_item("cuda_runtime", py.None())?;
            d.set_item("cutlass", py.None())?;
            d.set_item("dev_knobs", false)?;
        }
    }
    d.set_item("cpu_gemm", "matrixmultiply")?;
    d.set_item("cpu_threads", rayon::current_num_threads())?;
    d.set_item("abi3", true)?;
    Ok(d)
}

/// Whether products of `dtype` (its torch name, e.g. `"torch.bfloat16"`) on CUDA device
/// `device` read routed rows through `src` inside the GEMM: the fused layer then hands
/// `src` to each product instead of copying the rows once for several of them.
#[pyfunction]
pub(super) fn gathers_in_gemm(device: i32, dtype: &str) -> PyResult<bool> {
    let dt = DType::from_torch_name(dtype).ok_or_else(|| {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "dtype: expected a torch dtype name such as 'torch.bfloat16', found {dtype:?}"
        ))
    })?;
    guard(|| Ok(exec::cuda::gathers_in_gemm(device, dt)?))
}

/// Reads and clears the device's deferred error flag (no sync): true when a launch there
/// met invalid `offs` or a routed-row index out of range since the last read. Its Python
/// name stays `take_offs_error`: the tests call it by that name.
#[pyfunction]
#[pyo3(name = "take_offs_error")]
pub(super) fn take_deferred_error(device: i32) -> PyResult<bool> {
    guard(|| Ok(exec::cuda::take_deferred_error(device)?))
}

/// Limits every later CUDA launch of this process to `sms` SMs (0: all of them).
#[pyfunction]
pub(super) fn set_sm_limit(sms: i32) -> PyResult<()> {
    if sms < 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "sms: expected 0 (every SM) or a positive count, found {sms}"
        )));
    }
    guard(|| Ok(exec::cuda::set_sm_limit(sms)?))
}

/// The SM limit of this process's CUDA launches (0: none).
#[pyfunction]
pub(super) fn sm_limit() -> i32 {
    exec::cuda::sm_limit()
}
