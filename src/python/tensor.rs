//! Reading torch tensors and numpy arrays as Python objects (no libtorch link).
//!
//! The torch module, its dtype objects and the few functions we call are looked up once
//! and cached; attribute names are interned.

use crate::error::Error;
use crate::exec::Device;
use crate::shape::Layout;
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

/// One array argument, read once.
pub(crate) struct Arg<'py> {
    /// The object (for numpy, an aligned copy when the original was not aligned).
    pub obj: Bound<'py, PyAny>,
    pub kind: Kind,
    /// Address of element `[0, ...]`.
    pub ptr: usize,
    pub layout: Layout,
    /// `None` for int32 (offs).
    pub dtype: Option<DType>,
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

/// Reads a float tensor/array argument (`int32 = false`) or an int32 offsets argument.
pub(crate) fn read<'py>(
    py: Python<'py>,
    name: &dyn Display,
    obj: &Bound<'py, PyAny>,
    int32: bool,
) -> PyResult<Arg<'py>> {
    match kind_of(py, name, obj)? {
        Kind::Torch => read_torch(py, name, obj, int32),
        Kind::Numpy => read_numpy(py, name, obj, int32),
    }
}

fn read_torch<'py>(
    py: Python<'py>,
    name: &dyn Display,
    obj: &Bound<'py, PyAny>,
    int32: bool,
) -> PyResult<Arg<'py>> {
    let t = Torch::get(py)?.expect("a tensor implies torch is imported");
    let dt = obj.getattr(intern!(py, "dtype"))?;
    let dtype = if int32 {
        if !dt.is(t.int32.bind(py)) {
            return Err(Error::Dtype(format!(
                "{name}: expected dtype torch.int32, found {}",
                dt.str()?
            ))
            .into());
        }
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
    int32: bool,
) -> PyResult<Arg<'py>> {
    let mut arr = obj.cast::<PyUntypedArray>()?.clone();
    let descr = arr.dtype();
    let dtype = if int32 {
        if !descr.is_equiv_to(&numpy::dtype::<i32>(py)) {
            return Err(Error::Dtype(format!(
                "{name}: expected dtype int32, found {}",
                descr.str()?
            ))
            .into());
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
    let es = dtype.map(DType::size).unwrap_or(4) as isize;
    let shape = arr.shape().to_vec();
    let strides: Vec<isize> = arr.strides().iter().map(|&s| s / es).collect();
    if arr.strides().iter().any(|&s| s % es != 0) {
        return Err(Error::Value(format!(
            "{name}: strides {:?} bytes are not multiples of the element size",
            arr.strides()
        ))
        .into());
    }
    // SAFETY: `as_array_ptr` points at a live PyArrayObject owned by `arr`.
    let ptr = unsafe { (*arr.as_array_ptr()).data } as usize;
    Ok(Arg {
        obj: arr.into_any(),
        kind: Kind::Numpy,
        ptr,
        layout: Layout::new(&shape, &strides),
        dtype,
        device: Device::Cpu,
    })
}
