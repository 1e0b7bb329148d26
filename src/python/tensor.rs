//! Reading torch tensors and numpy arrays as Python objects (no libtorch link).
//!
//! The torch module, its dtype objects and the few functions we call are looked up once
//! and cached; attribute names are interned.

use crate::error::Error;
use crate::exec::Device;
use crate::layout::Layout;
use crate::DType;
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;
use std::fmt::Display;

/// Cached torch objects.
pub(crate) struct Torch {
    pub tensor_type: Py<PyType>,
    /// float16, bfloat16, float32, float64 (order of [`dtype_index`]).
    pub dtypes: [Py<PyAny>; 4],
    pub int32: Py<PyAny>,
    pub int64: Py<PyAny>,
    pub bool_: Py<PyAny>,
    #[cfg_attr(not(groupmm_cuda), allow(dead_code))]
    pub uint8: Py<PyAny>,
    #[cfg_attr(not(groupmm_cuda), allow(dead_code))]
    pub empty: Py<PyAny>,
    /// `torch._C._cuda_getCurrentRawStream(device) -> int`, when torch has CUDA.
    pub raw_stream: Option<Py<PyAny>>,
    /// `torch._C._get_cublas_allow_tf32() -> bool`.
    pub allow_tf32: Option<Py<PyAny>>,
}

static TORCH: PyOnceLock<Torch> = PyOnceLock::new();

fn dtype_index(d: DType) -> usize {
    match d {
        DType::F16 => 0,
        DType::BF16 => 1,
        DType::F32 => 2,
        DType::F64 => 3,
    }
}

const DTYPES: [DType; 4] = [DType::F16, DType::BF16, DType::F32, DType::F64];

impl Torch {
    /// The cached torch module objects, or `None` when torch was never imported (then no
    /// argument can be a tensor).
    pub fn get(py: Python<'_>) -> PyResult<Option<&Torch>> {
        if let Some(t) = TORCH.get(py) {
            return Ok(Some(t));
        }
        let modules = py
            .import(intern!(py, "sys"))?
            .getattr(intern!(py, "modules"))?;
        if !modules.contains(intern!(py, "torch"))? {
            return Ok(None);
        }
        let t = TORCH.get_or_try_init(py, || -> PyResult<Torch> {
            let torch = py.import("torch")?;
            let c = torch.getattr("_C")?;
            let get = |n: &str| -> PyResult<Py<PyAny>> { Ok(torch.getattr(n)?.unbind()) };
            Ok(Torch {
                tensor_type: torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind(),
                dtypes: [
                    get("float16")?,
                    get("bfloat16")?,
                    get("float32")?,
                    get("float64")?,
                ],
                int32: get("int32")?,
                int64: get("int64")?,
                bool_: get("bool")?,
                uint8: get("uint8")?,
                empty: get("empty")?,
                raw_stream: c
                    .getattr("_cuda_getCurrentRawStream")
                    .ok()
                    .map(Bound::unbind),
                allow_tf32: c.getattr("_get_cublas_allow_tf32").ok().map(Bound::unbind),
            })
        })?;
        Ok(Some(t))
    }

    pub fn dtype_obj<'py>(&self, py: Python<'py>, d: DType) -> &Bound<'py, PyAny> {
        self.dtypes[dtype_index(d)].bind(py)
    }

    /// Maps a `torch.dtype` object to a [`DType`], if it is one we support.
    pub fn dtype_of(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> Option<DType> {
        self.dtypes
            .iter()
            .position(|d| d.bind(py).is(obj))
            .map(|i| DTYPES[i])
    }
}

/// Torch tensor or numpy array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Torch,
    Numpy,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Torch => "torch.Tensor",
            Kind::Numpy => "numpy.ndarray",
        }
    }
}

/// What an array argument must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Want {
    /// A float dtype groupmm supports.
    Float,
    /// int32 (`offs`).
    Int32,
    /// Any integer dtype (an index, `src` or `inverse`; the engine has it converted to
    /// int32 unless it is).
    Index,
}

/// One array argument, read once.
pub(crate) struct Arg<'py> {
    /// The object (for numpy, an aligned copy when the original was not aligned).
    pub obj: Bound<'py, PyAny>,
    pub kind: Kind,
    /// Address of element `[0, ...]`.
    pub ptr: usize,
    pub layout: Layout,
    /// `None` for an integer argument.
    pub dtype: Option<DType>,
    /// An integer argument of dtype int32.
    pub int32: bool,
    pub device: Device,
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// What kind of array `obj` is, or a `TypeError` naming `name`.
pub(crate) fn kind_of(
    py: Python<'_>,
    name: &dyn Display,
    obj: &Bound<'_, PyAny>,
) -> PyResult<Kind> {
    if let Some(t) = Torch::get(py)? {
        if obj.is_instance(t.tensor_type.bind(py))? {
            return Ok(Kind::Torch);
        }
    }
    if obj.is_instance_of::<PyUntypedArray>() {
        return Ok(Kind::Numpy);
    }
    Err(Error::Type(format!(
        "{name}: expected a torch.Tensor or numpy.ndarray, found {}",
        type_name(obj)
    ))
    .into())
}

/// Reads an array argument holding what `want` says.
pub(crate) fn read<'py>(
    py: Python<'py>,
    name: &dyn Display,
    obj: &Bound<'py, PyAny>,
    want: Want,
) -> PyResult<Arg<'py>> {
    match kind_of(py, name, obj)? {
        Kind::Torch => read_torch(py, name, obj, want),
        Kind::Numpy => read_numpy(py, name, obj, want),
    }
}

/// The message for an index argument of a non-integer dtype.
fn not_an_index(name: &dyn Display, found: impl Display) -> PyErr {
    Error::Dtype(format!(
        "{name}: expected an integer dtype (int32, or int64 converted once), found {found}"
    ))
    .into()
}

/// Whether the torch dtype `dt` is an integer type (not bool), and int32.
fn torch_int(py: Python<'_>, t: &Torch, dt: &Bound<'_, PyAny>) -> PyResult<(bool, bool)> {
    if dt.is(t.int32.bind(py)) {
        return Ok((true, true));
    }
    if dt.is(t.int64.bind(py)) {
        return Ok((true, false));
    }
    let flag = |n| -> PyResult<bool> { dt.getattr(n)?.extract() };
    let int = !flag(intern!(py, "is_floating_point"))?
        && !flag(intern!(py, "is_complex"))?
        && !dt.is(t.bool_.bind(py));
    Ok((int, false))
}

fn read_torch<'py>(
    py: Python<'py>,
    name: &dyn Display,
    obj: &Bound<'py, PyAny>,
    want: Want,
) -> PyResult<Arg<'py>> {
    let t = Torch::get(py)?.expect("a tensor implies torch is imported");
    let dt = obj.getattr(intern!(py, "dtype"))?;
    let mut int32 = false;
    let dtype = if want == Want::Int32 {
        if !dt.is(t.int32.bind(py)) {
            return Err(Error::Dtype(format!(
                "{name}: expected dtype torch.int32, found {}",
                dt.str()?
            ))
            .into());
        }
        int32 = true;
        None
    } else if want == Want::Index {
        let (int, is_i32) = torch_int(py, t, &dt)?;
        if !int {
            return Err(not_an_index(name, dt.str()?));
        }
        int32 = is_i32;
        None
    } else {
        match t.dtype_of(py, &dt) {
            Some(d) => Some(d),
            None => {
                return Err(Error::Dtype(format!(
                    "{name}: expected dtype torch.float16, torch.bfloat16, torch.float32 or \
                     torch.float64, found {}",
                    dt.str()?
                ))
                .into())
            }
        }
    };
    let device = if obj.getattr(intern!(py, "is_cuda"))?.extract::<bool>()? {
        Device::Cuda(obj.call_method0(intern!(py, "get_device"))?.extract()?)
    } else if obj.getattr(intern!(py, "is_cpu"))?.extract::<bool>()? {
        Device::Cpu
    } else {
        return Err(Error::Device(format!(
            "{name}: tensors on device '{}' are not supported; expected a cpu or cuda tensor",
            obj.getattr(intern!(py, "device"))?.str()?
        ))
        .into());
    };
    let (ptr, layout) = torch_memory(obj)?;
    Ok(Arg {
        obj: obj.clone(),
        kind: Kind::Torch,
        ptr,
        layout,
        dtype,
        int32,
        device,
    })
}

/// Address, shape and strides of a torch tensor.
pub(crate) fn torch_memory(obj: &Bound<'_, PyAny>) -> PyResult<(usize, Layout)> {
    let py = obj.py();
    let shape: Vec<usize> = obj.getattr(intern!(py, "shape"))?.extract()?;
    let strides: Vec<isize> = obj.call_method0(intern!(py, "stride"))?.extract()?;
    let ptr: usize = obj.call_method0(intern!(py, "data_ptr"))?.extract()?;
    Ok((ptr, Layout::new(&shape, &strides)))
}

fn read_numpy<'py>(
    py: Python<'py>,
    name: &dyn Display,
    obj: &Bound<'py, PyAny>,
    want: Want,
) -> PyResult<Arg<'py>> {
    let mut arr = obj.cast::<PyUntypedArray>()?.clone();
    let descr = arr.dtype();
    let int32 = descr.is_equiv_to(&numpy::dtype::<i32>(py));
    let dtype = if want == Want::Int32 {
        if !int32 {
            return Err(Error::Dtype(format!(
                "{name}: expected dtype int32, found {}",
                descr.str()?
            ))
            .into());
        }
        None
    } else if want == Want::Index {
        if !matches!(descr.kind(), b'i' | b'u') {
            return Err(not_an_index(name, descr.str()?));
        }
        None
    } else if descr.is_equiv_to(&numpy::dtype::<f64>(py)) {
        Some(DType::F64)
    } else if descr.is_equiv_to(&numpy::dtype::<f32>(py)) {
        Some(DType::F32)
    } else if descr.is_equiv_to(&numpy::dtype::<half::f16>(py)) {
        Some(DType::F16)
    } else {
        return Err(Error::Dtype(format!(
            "{name}: expected a numpy array of dtype float16, float32 or float64 (native byte order), found {}",
            descr.str()?
        ))
        .into());
    };
    if !arr.is_aligned() {
        // rare: an unaligned view; work on an aligned copy (inputs only).
        arr = obj
            .call_method0(intern!(py, "copy"))?
            .cast_into::<PyUntypedArray>()?;
    }
    let (ptr, layout) = numpy_memory(&arr).map_err(|strides| {
        PyErr::from(Error::Value(format!(
            "{name}: strides {strides:?} bytes are not multiples of the element size"
        )))
    })?;
    Ok(Arg {
        obj: arr.into_any(),
        kind: Kind::Numpy,
        ptr,
        layout,
        dtype,
        int32: dtype.is_none() && int32,
        device: Device::Cpu,
    })
}

/// Address, shape and strides (in elements) of a numpy array, or its byte strides when
/// they are not multiples of the element size.
pub(crate) fn numpy_memory(arr: &Bound<'_, PyUntypedArray>) -> Result<(usize, Layout), Vec<isize>> {
    let es = arr.dtype().itemsize().max(1) as isize;
    if arr.strides().iter().any(|&s| s % es != 0) {
        return Err(arr.strides().to_vec());
    }
    let strides: Vec<isize> = arr.strides().iter().map(|&s| s / es).collect();
    // SAFETY: `as_array_ptr` points at a live PyArrayObject owned by `arr`.
    let ptr = unsafe { (*arr.as_array_ptr()).data } as usize;
    Ok((ptr, Layout::new(arr.shape(), &strides)))
}
