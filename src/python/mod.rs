//! The PyO3 module `groupmm._native`: the torch/numpy face of the engine.
//!
//! Each function reads its arguments (torch tensors or numpy arrays, as Python objects:
//! data pointer, shape, strides, dtype, device), maps them to the engine's descriptions,
//! calls the engine (`crate::exec`) with a [`runtime::PyRuntime`] that lends what torch's
//! (or numpy's) runtime provides, and maps errors to Python exceptions. The engine runs the CPU kernels
//! with the GIL released and the CUDA kernels on torch's current stream. No Rust panic
//! reaches Python: every entry point catches them.

mod runtime;
mod tensor;

use crate::error::Error;
use crate::exec;
use crate::layout::Layout;
use crate::shape::{self, Item};
use crate::DType;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
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

/// `(dA, dB)` of a backward call, each `None` when not requested.
type Grads<'py, T> = (Option<Bound<'py, T>>, Option<Bound<'py, T>>);

/// The outputs of a fused expert product, `None` where no fused kernel runs.
type Fused<T> = PyResult<Option<T>>;

/// One output object.
type Obj<'py> = Bound<'py, PyAny>;

/// Runs `f`, turning a Rust panic into a `RuntimeError`.
fn guard<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
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
fn dtype_of(py: Python<'_>, kind: Kind, obj: &Bound<'_, PyAny>) -> PyResult<Option<DType>> {
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
fn resolve_out_dtype(
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

fn not_none<'a, 'py>(o: Option<&'a Bound<'py, PyAny>>) -> Option<&'a Bound<'py, PyAny>> {
    o.filter(|o| !o.is_none())
}

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
fn grouped_mm<'py>(
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

/// The GroupedM product with gathered rows: `out[r] = x[src[r]] @ w[g]` for the rows
/// of group `g` (`exec::packed_gather`).
#[pyfunction]
#[pyo3(signature = (x, w, offs, src, out_dtype=None))]
fn gather_mm<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    w: &Bound<'py, PyAny>,
    offs: &Bound<'py, PyAny>,
    src: &Bound<'py, PyAny>,
    out_dtype: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    guard(|| {
        let mut rt = PyRuntime::new(py);
        let x = rt.reference("x", x)?;
        let w = rt.input(&"w", w)?;
        let offs = required_offs(&mut rt, offs)?;
        let src = rt.index("src", src)?;
        let od = resolve_out_dtype(py, rt.kind(), x.dtype, out_dtype)?;
        // SAFETY: the descriptions are of the argument objects, which `rt` and the
        // caller keep alive for the call; `rt` lends the rest.
        unsafe { exec::packed_gather(&mut rt, &x, &src, &w, &offs, Some(od)) }
            .map_err(|e| rt.raise(e))
    })
}

/// The GroupedK product with gathered rows (`exec::packed_gather_k`): `out[g] = Σ a_rᵀ @
/// b_r` over the routed rows `r` of group `g`, with `a_r = a[src[r]]`, `b_r = b[r]` (or,
/// `gathered_b`, `a_r = a[r]`, `b_r = b[src[r]]`); `transposed`: the transposed view of a
/// fresh `[G, N, K]`; `out`: written instead (`[G, K, N]`, any strides; in place where
/// the kernels can, e.g. a slab of a larger gradient) and returned.
#[pyfunction]
#[pyo3(signature = (a, b, offs, src, gathered_b=false, transposed=false, out=None))]
#[allow(clippy::too_many_arguments)]
fn gather_k_mm<'py>(
    py: Python<'py>,
    a: &Bound<'py, PyAny>,
    b: &Bound<'py, PyAny>,
    offs: &Bound<'py, PyAny>,
    src: &Bound<'py, PyAny>,
    gathered_b: bool,
    transposed: bool,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    guard(|| {
        let mut rt = PyRuntime::new(py);
        let a = rt.reference("a", a)?;
        let b = rt.input(&"b", b)?;
        let offs = required_offs(&mut rt, offs)?;
        let src = rt.index("src", src)?;
        let out = not_none(out).map(|o| rt.output(&"out", o)).transpose()?;
        // SAFETY: as in gather_mm.
        unsafe { exec::packed_gather_k(&mut rt, &a, &b, &offs, &src, gathered_b, transposed, out) }
            .map_err(|e| rt.raise(e))
    })
}

/// `offs` of a call that requires it (int32).
fn required_offs<'py>(
    rt: &mut PyRuntime<'py>,
    offs: &Bound<'py, PyAny>,
) -> PyResult<exec::IntTensor> {
    Ok(rt
        .offs(Some(offs))?
        .ok_or_else(|| Error::Value("offs: expected an int32 tensor, found None".into()))?)
}

/// The fused up projection of a routed SwiGLU expert (`exec::fused::swiglu_mm`):
/// `(pre, act)` with `pre = x[src] @ w[g]` (`[R, 2F]`) and `act = silu(gate) * up`
/// (`[R, F]`), or `None` where no fused kernel runs (CPU, or `Unsupported`).
#[pyfunction]
#[pyo3(signature = (x, w, offs, src=None))]
fn swiglu_mm<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    w: &Bound<'py, PyAny>,
    offs: &Bound<'py, PyAny>,
    src: Option<&Bound<'py, PyAny>>,
) -> Fused<(Obj<'py>, Obj<'py>)> {
    guard(|| {
        let mut rt = PyRuntime::new(py);
        let x = rt.reference("x", x)?;
        let w = rt.input(&"w", w)?;
        let offs = required_offs(&mut rt, offs)?;
        let src = not_none(src).map(|s| rt.index("src", s)).transpose()?;
        // SAFETY: the descriptions are of the argument objects, which `rt` and the
        // caller keep alive for the call; `rt` lends the rest.
        let r = unsafe { exec::fused::swiglu_mm(&mut rt, &x, &w, &offs, src.as_ref()) }
            .map_err(|e| rt.raise(e))?;
        Ok(r.map(|[pre, act]| (pre, act)))
    })
}

/// The fused backward of a routed SwiGLU expert's down projection
/// (`exec::fused::dgated_mm`): `(dpre, act, partial)`, or `None` where no fused kernel
/// runs (CPU, or `Unsupported`). With `src`, `dy` is in token order and row `r` of the
/// product reads `dy[src[r]]`. `out`: `dpre` is written there instead (`[R, 2F]` of `dy`'s
/// dtype) and returned as the first item; it may be `pre` itself (the backward's last read
/// of it: each tile reads its part of `pre` before writing the same part), not otherwise
/// overlap an input.
#[pyfunction]
#[pyo3(signature = (dy, w, offs, pre, scale, src=None, out=None))]
#[allow(clippy::too_many_arguments)]
fn dgated_mm<'py>(
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
        // SAFETY: as in swiglu_mm.
        let r = unsafe {
            exec::fused::dgated_mm(&mut rt, &dy, &w, &offs, &pre, &scale, src.as_ref(), out)
        }
        .map_err(|e| rt.raise(e))?;
        Ok(r.map(|[dpre, act, partial]| (dpre, act, partial)))
    })
}

/// Both backward products of a packed product: `(dA, dB)` with `dA = grad·bᵀ`,
/// `dB = aᵀ·grad` (same `offs`); an entry is `None` when not requested.
#[pyfunction]
#[pyo3(signature = (grad, a, b, offs=None, need_a=true, need_b=true))]
fn grouped_mm_backward<'py>(
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
fn grouped_mm_list<'py>(
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
fn grouped_mm_list_backward<'py>(
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
fn swiglu<'py>(py: Python<'py>, pre: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    row_op(py, |rt| Ok(RowArgs::Swiglu(rt.reference("pre", pre)?)))
}

/// `[d gate | d up]` of `swiglu` from its output gradient `grad [R, F]`.
#[pyfunction]
fn swiglu_backward<'py>(
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
fn gather_sum<'py>(
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
fn scatter_rows<'py>(
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
fn row_dots<'py>(
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

/// Output shape of a packed product from shapes alone (used by the fake kernels), or a
/// `ValueError` from the shape rules.
#[pyfunction]
#[pyo3(signature = (a_shape, b_shape, offs_len=None))]
fn packed_out_shape(
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
fn list_out_shapes(
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
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", crate::VERSION)?;
    let info = exec::cuda::build_info();
    d.set_item("cuda", info.is_some())?;
    match info {
        Some(i) => {
            d.set_item("cuda_archs", i.archs)?;
            d.set_item("cuda_runtime", i.cuda_runtime)?;
            d.set_item("cutlass", i.cutlass)?;
        }
        None => {
            d.set_item("cuda_archs", PyList::empty(py))?;
            d.set_item("cuda_runtime", py.None())?;
            d.set_item("cutlass", py.None())?;
        }
    }
    d.set_item("cpu_gemm", "matrixmultiply")?;
    d.set_item("cpu_threads", rayon::current_num_threads())?;
    d.set_item("abi3", true)?;
    Ok(d)
}

/// Reads and clears the flag CUDA kernels raise on invalid `offs` (no sync).
#[pyfunction]
fn take_offs_error(device: i32) -> PyResult<bool> {
    guard(|| Ok(exec::cuda::take_offs_error(device)?))
}

#[pymodule]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(grouped_mm, m)?)?;
    m.add_function(wrap_pyfunction!(grouped_mm_backward, m)?)?;
    m.add_function(wrap_pyfunction!(grouped_mm_list, m)?)?;
    m.add_function(wrap_pyfunction!(grouped_mm_list_backward, m)?)?;
    m.add_function(wrap_pyfunction!(gather_mm, m)?)?;
    m.add_function(wrap_pyfunction!(gather_k_mm, m)?)?;
    m.add_function(wrap_pyfunction!(swiglu_mm, m)?)?;
    m.add_function(wrap_pyfunction!(dgated_mm, m)?)?;
    m.add_function(wrap_pyfunction!(swiglu, m)?)?;
    m.add_function(wrap_pyfunction!(swiglu_backward, m)?)?;
    m.add_function(wrap_pyfunction!(gather_sum, m)?)?;
    m.add_function(wrap_pyfunction!(scatter_rows, m)?)?;
    m.add_function(wrap_pyfunction!(row_dots, m)?)?;
    m.add_function(wrap_pyfunction!(packed_out_shape, m)?)?;
    m.add_function(wrap_pyfunction!(list_out_shapes, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(take_offs_error, m)?)?;
    m.add("__version__", crate::VERSION)?;
    Ok(())
}
