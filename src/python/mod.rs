//! The PyO3 module `groupmm._native`.
//!
//! Torch tensors arrive as Python objects: we read their data pointer, shape, strides,
//! dtype and device, validate through [`crate::shape`], allocate outputs through torch
//! and run the CPU kernels with the GIL released (or the CUDA launchers on torch's
//! current stream). numpy arrays take the same path on the CPU and return numpy
//! arrays. No Rust panic reaches Python: every entry point catches them.

mod cuda_path;
mod tensor;

use crate::cpu;
use crate::error::{Error, Result};
use crate::shape::{self, PackedPlan, Problem};
use crate::DType;
use half::{bf16, f16};
use numpy::PyArrayDyn;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use tensor::{Arg, Dev, Kind, Torch};

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

/// Raw pointers moved into a GIL-free closure.
struct SendPtrs<T>(T);
// SAFETY: the pointers address memory of Python objects the calling frame keeps alive
// for the whole GIL-free section; they are only used inside it.
unsafe impl<T> Send for SendPtrs<T> {}

/// Resolves `out_dtype` (a `torch.dtype`, numpy dtype, or None) against the input dtype.
fn resolve_out_dtype(
    py: Python<'_>,
    kind: Kind,
    input: DType,
    out_dtype: Option<&Bound<'_, PyAny>>,
) -> PyResult<DType> {
    let Some(od) = out_dtype.filter(|o| !o.is_none()) else {
        return Ok(input);
    };
    let found = match kind {
        Kind::Torch => Torch::get(py)?.and_then(|t| t.dtype_of(py, od)),
        Kind::Numpy => {
            let np = py.import("numpy")?;
            let d = np.call_method1("dtype", (od,)).map_err(|_| {
                Error::Dtype(format!(
                    "out_dtype: expected None or a numpy float dtype, found {}",
                    od.str()
                        .map(|s| s.to_string())
                        .unwrap_or_else(|_| "?".into())
                ))
            })?;
            [
                ("float16", DType::F16),
                ("float32", DType::F32),
                ("float64", DType::F64),
            ]
            .into_iter()
            .find(|(n, _)| d.eq(*n).unwrap_or(false))
            .map(|(_, t)| t)
        }
    };
    match found {
        Some(d) if d == input || (d == DType::F32 && input.is_16bit()) => Ok(d),
        _ => Err(Error::Dtype(format!(
            "out_dtype: expected None or the input dtype {}{}, found {}",
            input.torch_name(),
            if input.is_16bit() {
                " or torch.float32"
            } else {
                ""
            },
            od.str()?
        ))
        .into()),
    }
}

/// Checks that `x` matches `reference` in kind, dtype and device.
fn same_as(x: &Arg<'_>, reference: &Arg<'_>) -> Result<()> {
    if x.kind != reference.kind {
        let k = |k: Kind| match k {
            Kind::Torch => "torch.Tensor",
            Kind::Numpy => "numpy.ndarray",
        };
        return Err(Error::Type(format!(
            "{}: expected a {} like {}, found a {}",
            x.name,
            k(reference.kind),
            reference.name,
            k(x.kind)
        )));
    }
    if x.dtype.is_some() && x.dtype != reference.dtype {
        return Err(Error::Dtype(format!(
            "{}: expected dtype {} (the dtype of {}), found {}",
            x.name,
            reference.dtype().torch_name(),
            reference.name,
            x.dtype().torch_name()
        )));
    }
    if x.dev != reference.dev {
        return Err(Error::Device(format!(
            "{}: expected a tensor on {} (the device of {}), found one on {}",
            x.name, reference.dev, reference.name, x.dev
        )));
    }
    Ok(())
}

fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::Torch => "torch.Tensor",
        Kind::Numpy => "numpy.ndarray",
    }
}

/// `out.flags.writeable` of a numpy output (true when it cannot be read).
fn is_writeable(out: &Arg<'_>) -> bool {
    out.obj
        .getattr("flags")
        .and_then(|f| f.getattr("writeable"))
        .and_then(|w| w.extract::<bool>())
        .unwrap_or(true)
}

fn overlaps(x: &Arg<'_>, y: &Arg<'_>) -> bool {
    let (a0, a1) = x.byte_range();
    let (b0, b1) = y.byte_range();
    a0 < b1 && b0 < a1
}

/// Validates a user-supplied output.
fn check_out_arg(
    out: &Arg<'_>,
    shape: &[usize],
    dtype: DType,
    like: &Arg<'_>,
    inputs: &[&Arg<'_>],
) -> Result<()> {
    if out.kind != like.kind {
        return Err(Error::Type(format!(
            "{}: expected a {} like the inputs, found a {}",
            out.name,
            kind_name(like.kind),
            kind_name(out.kind)
        )));
    }
    if out.kind == Kind::Numpy && !is_writeable(out) {
        return Err(Error::Value(format!(
            "{}: the numpy array is read-only (flags.writeable is False)",
            out.name
        )));
    }
    if out.dev != like.dev {
        return Err(Error::Device(format!(
            "{}: expected a tensor on {} like the inputs, found one on {}",
            out.name, like.dev, out.dev
        )));
    }
    if out.dtype != Some(dtype) {
        return Err(Error::Dtype(format!(
            "{}: expected dtype {}, found {}",
            out.name,
            dtype.torch_name(),
            out.dtype().torch_name()
        )));
    }
    shape::check_out(&out.name, &out.layout, shape)?;
    for i in inputs {
        if overlaps(out, i) {
            return Err(Error::Value(format!(
                "{}: must not share memory with the input {}",
                out.name, i.name
            )));
        }
    }
    Ok(())
}

/// Runs CPU problems with the GIL released, dispatching on (input, output) dtype.
///
/// # Safety
/// As [`cpu::run_list`]: problems built from the layouts of the live arrays behind the
/// pointers, non-overlapping outputs.
unsafe fn run_cpu(
    py: Python<'_>,
    ti: DType,
    to: DType,
    problems: &[Problem],
    a: &[usize],
    b: &[usize],
    c: &[usize],
) -> Result<()> {
    let ptrs = SendPtrs((a.to_vec(), b.to_vec(), c.to_vec()));
    macro_rules! go {
        ($TI:ty, $TO:ty) => {
            py.detach(move || {
                let p = ptrs;
                let (a, b, c) = &p.0;
                let a: Vec<*const $TI> = a.iter().map(|&x| x as *const $TI).collect();
                let b: Vec<*const $TI> = b.iter().map(|&x| x as *const $TI).collect();
                let c: Vec<*mut $TO> = c.iter().map(|&x| x as *mut $TO).collect();
                // SAFETY: forwarded contract of `run_cpu`.
                unsafe { cpu::run_list::<$TI, $TO>(problems, &a, &b, &c) }
            })
        };
    }
    match (ti, to) {
        (DType::F64, DType::F64) => go!(f64, f64),
        (DType::F32, DType::F32) => go!(f32, f32),
        (DType::F16, DType::F16) => go!(f16, f16),
        (DType::BF16, DType::BF16) => go!(bf16, bf16),
        (DType::F16, DType::F32) => go!(f16, f32),
        (DType::BF16, DType::F32) => go!(bf16, f32),
        _ => {
            return Err(Error::Dtype(format!(
                "out_dtype: {} output from {} inputs is not supported",
                to.torch_name(),
                ti.torch_name()
            )))
        }
    }
    Ok(())
}

/// Allocates an output array like `like` (torch tensor or numpy array).
fn alloc_like<'py>(
    py: Python<'py>,
    like: &Arg<'py>,
    name: &str,
    shape: &[usize],
    dtype: DType,
    zero: bool,
) -> PyResult<Arg<'py>> {
    let obj = match like.kind {
        Kind::Torch => {
            let t = Torch::get(py)?.expect("torch tensors imply torch");
            if !zero {
                // `like.new_empty` keeps like's device; we know everything about the
                // fresh contiguous tensor but its address, so only that is read back.
                let kw = PyDict::new(py);
                kw.set_item(pyo3::intern!(py, "dtype"), t.dtype_obj(py, dtype))?;
                let obj = like.obj.call_method(
                    pyo3::intern!(py, "new_empty"),
                    (shape.to_vec(),),
                    Some(&kw),
                )?;
                let ptr: usize = obj.call_method0(pyo3::intern!(py, "data_ptr"))?.extract()?;
                return Ok(Arg {
                    name: name.to_string(),
                    obj,
                    kind: Kind::Torch,
                    ptr,
                    layout: shape::Layout::contiguous(shape),
                    dtype: Some(dtype),
                    dev: like.dev,
                    transposed: false,
                });
            }
            let dev = match like.dev {
                Dev::Cpu => None,
                Dev::Cuda(_) => Some(like.obj.getattr(pyo3::intern!(py, "device"))?),
            };
            t.alloc(py, shape, t.dtype_obj(py, dtype), dev.as_ref(), zero)?
        }
        Kind::Numpy => match dtype {
            DType::F64 => PyArrayDyn::<f64>::zeros(py, shape, false).into_any(),
            DType::F32 => PyArrayDyn::<f32>::zeros(py, shape, false).into_any(),
            DType::F16 => PyArrayDyn::<f16>::zeros(py, shape, false).into_any(),
            DType::BF16 => {
                return Err(Error::Dtype("numpy has no bfloat16 output".into()).into());
            }
        },
    };
    tensor::read(py, name, &obj, false)
}

/// Operands of one packed product after validation.
struct Packed<'py> {
    a: Arg<'py>,
    b: Arg<'py>,
    offs: Option<Arg<'py>>,
    plan: PackedPlan,
    out_dtype: DType,
}

fn prepare_packed<'py>(
    a: Arg<'py>,
    b: Arg<'py>,
    offs: Option<Arg<'py>>,
    out_dtype: DType,
) -> Result<Packed<'py>> {
    same_as(&b, &a)?;
    if let Some(o) = &offs {
        same_as(o, &a)?;
        tensor::need_1d(o)?;
    }
    let plan = shape::plan_packed(
        &a.layout,
        &b.layout,
        offs.as_ref().map(|o| o.layout.shape[0]),
    )?;
    Ok(Packed {
        a,
        b,
        offs,
        plan,
        out_dtype,
    })
}

/// Computes a prepared packed product into `out` (allocated when `None`) and returns
/// the output object.
fn run_packed<'py>(
    py: Python<'py>,
    p: &Packed<'py>,
    out: Option<Arg<'py>>,
) -> PyResult<Bound<'py, PyAny>> {
    if let Some(o) = &out {
        check_out_arg(o, &p.plan.out_shape, p.out_dtype, &p.a, &[&p.a, &p.b])?;
    }
    match p.a.dev {
        Dev::Cuda(_) => cuda_path::packed(py, p, out),
        Dev::Cpu => {
            let offs_vals = p.offs.as_ref().map(tensor::host_i32s);
            if let Some(v) = &offs_vals {
                shape::check_offs(v, &p.plan)?;
            }
            let out = match out {
                Some(o) => o,
                None => alloc_like(py, &p.a, "out", &p.plan.out_shape, p.out_dtype, false)?,
            };
            let problems = shape::packed_problems(
                &p.plan,
                &p.a.layout,
                &p.b.layout,
                &out.layout,
                offs_vals.as_deref(),
            );
            let problems: Vec<Problem> = problems
                .into_iter()
                .map(|q| Problem { group: 0, ..q })
                .collect();
            // SAFETY: problems come from packed_problems on the live arrays' layouts
            // (offs checked), the output was validated non-overlapping and disjoint
            // from the inputs, and every object stays referenced by `p`/`out` here.
            unsafe {
                run_cpu(
                    py,
                    p.a.dtype(),
                    p.out_dtype,
                    &problems,
                    &[p.a.ptr],
                    &[p.b.ptr],
                    &[out.ptr],
                )?;
            }
            Ok(out.obj)
        }
    }
}

fn read_opt<'py>(
    py: Python<'py>,
    name: &str,
    obj: Option<&Bound<'py, PyAny>>,
    int32: bool,
) -> PyResult<Option<Arg<'py>>> {
    match obj.filter(|o| !o.is_none()) {
        Some(o) => Ok(Some(tensor::read(py, name, o, int32)?)),
        None => Ok(None),
    }
}

/// Packed grouped product `out = grouped_mm(a, b, offs)`; see DESIGN.md for the forms.
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
        let a = tensor::read(py, "a", a, false)?;
        let b = tensor::read(py, "b", b, false)?;
        let offs = read_opt(py, "offs", offs, true)?;
        let od = resolve_out_dtype(py, a.kind, a.dtype(), out_dtype)?;
        let out = read_opt(py, "out", out, false)?;
        let p = prepare_packed(a, b, offs, od)?;
        run_packed(py, &p, out)
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
        let grad = tensor::read(py, "grad", grad, false)?;
        let a = tensor::read(py, "a", a, false)?;
        let b = tensor::read(py, "b", b, false)?;
        let offs = read_opt(py, "offs", offs, true)?;
        same_as(&grad, &a)?;
        // validate the forward first so errors name the forward's arguments
        let fwd = prepare_packed(a.clone(), b.clone(), offs.clone(), a.dtype())?;
        if grad.layout.shape != fwd.plan.out_shape {
            return Err(Error::Shape(format!(
                "grad: expected shape {} (the output's), found {}",
                shape::fmt_shape(&fwd.plan.out_shape),
                shape::fmt_shape(&grad.layout.shape)
            ))
            .into());
        }
        let dt = a.dtype();
        let da = if need_a {
            let p = prepare_packed(grad.clone(), b.transposed(), offs.clone(), dt)?;
            Some(run_packed(py, &p, None)?)
        } else {
            None
        };
        let db = if need_b {
            let p = prepare_packed(a.transposed(), grad.clone(), offs.clone(), dt)?;
            Some(run_packed(py, &p, None)?)
        } else {
            None
        };
        Ok((da, db))
    })
}

fn read_seq<'py>(py: Python<'py>, name: &str, seq: &Bound<'py, PyAny>) -> PyResult<Vec<Arg<'py>>> {
    if seq.is_instance_of::<pyo3::types::PyString>() || !seq.hasattr("__len__")? {
        return Err(Error::Type(format!(
            "{name}: expected a sequence of 2-D tensors, found {}",
            seq.get_type().name()?
        ))
        .into());
    }
    let mut v = Vec::new();
    for (i, item) in seq.try_iter()?.enumerate() {
        v.push(tensor::read(py, &format!("{name}[{i}]"), &item?, false)?);
    }
    Ok(v)
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
        let a = read_seq(py, "As", a_list)?;
        let b = read_seq(py, "Bs", b_list)?;
        let outs = match out.filter(|o| !o.is_none()) {
            Some(o) => Some(read_seq(py, "out", o)?),
            None => None,
        };
        list_impl(py, &a, &b, out_dtype, outs)
    })
}

fn list_impl<'py>(
    py: Python<'py>,
    a: &[Arg<'py>],
    b: &[Arg<'py>],
    out_dtype: Option<&Bound<'py, PyAny>>,
    outs: Option<Vec<Arg<'py>>>,
) -> PyResult<Bound<'py, PyList>> {
    let la: Vec<_> = a.iter().map(|x| x.layout.clone()).collect();
    let lb: Vec<_> = b.iter().map(|x| x.layout.clone()).collect();
    let dims = shape::plan_list(&la, &lb)?;
    if a.is_empty() {
        if let Some(o) = &outs {
            if !o.is_empty() {
                return Err(
                    Error::Shape(format!("out: expected 0 tensors, found {}", o.len())).into(),
                );
            }
        }
        return Ok(PyList::empty(py));
    }
    let first = &a[0];
    for x in a.iter().skip(1).chain(b.iter()) {
        same_as(x, first)?;
    }
    let od = resolve_out_dtype(py, first.kind, first.dtype(), out_dtype)?;
    if let Some(o) = &outs {
        if o.len() != a.len() {
            return Err(Error::Shape(format!(
                "out: expected a sequence of {} tensors (one per group), found {}",
                a.len(),
                o.len()
            ))
            .into());
        }
        let inputs: Vec<&Arg<'_>> = a.iter().chain(b.iter()).collect();
        for (i, oi) in o.iter().enumerate() {
            check_out_arg(oi, &[dims[i].m, dims[i].n], od, first, &inputs)?;
            for oj in &o[..i] {
                if overlaps(oi, oj) {
                    return Err(Error::Value(format!(
                        "{}: must not share memory with {}",
                        oi.name, oj.name
                    ))
                    .into());
                }
            }
        }
    }
    if let Dev::Cuda(_) = first.dev {
        return cuda_path::list(py, a, b, &dims, od, outs);
    }
    let outs = match outs {
        Some(o) => o,
        None => dims
            .iter()
            .enumerate()
            .map(|(i, d)| alloc_like(py, first, &format!("out[{i}]"), &[d.m, d.n], od, false))
            .collect::<PyResult<Vec<_>>>()?,
    };
    let lc: Vec<_> = outs.iter().map(|x| x.layout.clone()).collect();
    let problems = shape::list_problems(&dims, &la, &lb, &lc);
    let pa: Vec<usize> = a.iter().map(|x| x.ptr).collect();
    let pb: Vec<usize> = b.iter().map(|x| x.ptr).collect();
    let pc: Vec<usize> = outs.iter().map(|x| x.ptr).collect();
    // SAFETY: problems from list_problems on the live arrays' layouts; outputs validated
    // (fresh, or checked non-overlapping with each other and the inputs).
    unsafe { run_cpu(py, first.dtype(), od, &problems, &pa, &pb, &pc)? };
    PyList::new(py, outs.into_iter().map(|o| o.obj))
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
        let g = read_seq(py, "grads", grads)?;
        let a = read_seq(py, "As", a_list)?;
        let b = read_seq(py, "Bs", b_list)?;
        let la: Vec<_> = a.iter().map(|x| x.layout.clone()).collect();
        let lb: Vec<_> = b.iter().map(|x| x.layout.clone()).collect();
        let dims = shape::plan_list(&la, &lb)?;
        if g.len() != a.len() {
            return Err(Error::Shape(format!(
                "grads: expected {} gradients (one per group), found {}",
                a.len(),
                g.len()
            ))
            .into());
        }
        for (i, gi) in g.iter().enumerate() {
            if gi.layout.shape != [dims[i].m, dims[i].n] {
                return Err(Error::Shape(format!(
                    "grads[{i}]: expected shape {}, found {}",
                    shape::fmt_shape(&[dims[i].m, dims[i].n]),
                    shape::fmt_shape(&gi.layout.shape)
                ))
                .into());
            }
        }
        let bt: Vec<_> = b.iter().map(Arg::transposed).collect();
        let at: Vec<_> = a.iter().map(Arg::transposed).collect();
        let da = if need_a {
            Some(list_impl(py, &g, &bt, None, None)?)
        } else {
            None
        };
        let db = if need_b {
            Some(list_impl(py, &at, &g, None, None)?)
        } else {
            None
        };
        Ok((da, db))
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
        let la = shape::Layout::contiguous(&a_shape);
        let lb = shape::Layout::contiguous(&b_shape);
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
        let la: Vec<_> = a_shapes
            .iter()
            .map(|s| shape::Layout::contiguous(s))
            .collect();
        let lb: Vec<_> = b_shapes
            .iter()
            .map(|s| shape::Layout::contiguous(s))
            .collect();
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
    let info = crate::cuda::build_info();
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
    guard(|| Ok(crate::cuda::take_offs_error(device)?))
}

#[pymodule]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(grouped_mm, m)?)?;
    m.add_function(wrap_pyfunction!(grouped_mm_backward, m)?)?;
    m.add_function(wrap_pyfunction!(grouped_mm_list, m)?)?;
    m.add_function(wrap_pyfunction!(grouped_mm_list_backward, m)?)?;
    m.add_function(wrap_pyfunction!(packed_out_shape, m)?)?;
    m.add_function(wrap_pyfunction!(list_out_shapes, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(take_offs_error, m)?)?;
    m.add("__version__", crate::VERSION)?;
    Ok(())
}
