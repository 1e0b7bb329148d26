//! Reading torch tensors and numpy arrays as Python objects (no libtorch link).
//!
//! The torch module, its dtype objects and the few functions we call are looked up once
//! and cached; attribute names are interned.

use crate::error::{Error, Result};
use crate::shape::{fmt_shape, Layout};
use crate::DType;
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};

/// Cached torch objects.
pub(crate) struct Torch {
    pub tensor_type: Py<PyType>,
    /// float16, bfloat16, float32, float64 (order of [`dtype_index`]).
    pub dtypes: [Py<PyAny>; 4],
    pub int32: Py<PyAny>,
    pub uint8: Py<PyAny>,
    pub empty: Py<PyAny>,
    pub zeros: Py<PyAny>,
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
                zeros: get("zeros")?,
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

    /// `torch.empty(shape, dtype=..., device=...)` (zeros when `zero`); `device` is a
    /// `torch.device` (or string), `None` for CPU.
    pub fn alloc<'py>(
        &self,
        py: Python<'py>,
        shape: &[usize],
        dtype: &Bound<'py, PyAny>,
        device: Option<&Bound<'py, PyAny>>,
        zero: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let kw = PyDict::new(py);
        kw.set_item(intern!(py, "dtype"), dtype)?;
        if let Some(d) = device {
            kw.set_item(intern!(py, "device"), d)?;
        }
        let f = if zero { &self.zeros } else { &self.empty };
        f.bind(py).call((shape.to_vec(),), Some(&kw))
    }
}

/// Where a tensor lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dev {
    Cpu,
    Cuda(i32),
}

impl std::fmt::Display for Dev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dev::Cpu => write!(f, "cpu"),
            Dev::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Torch tensor or numpy array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Torch,
    Numpy,
}

/// One array argument, read once.
#[derive(Clone)]
pub(crate) struct Arg<'py> {
    pub name: String,
    pub obj: Bound<'py, PyAny>,
    pub kind: Kind,
    /// Address of element `[0, ...]`.
    pub ptr: usize,
    pub layout: Layout,
    /// `None` for int32 (offs).
    pub dtype: Option<DType>,
    pub dev: Dev,
    /// True when `layout` is `obj`'s layout with the last two dimensions swapped.
    pub transposed: bool,
}

impl<'py> Arg<'py> {
    /// The same memory with the last two dimensions swapped.
    pub fn transposed(&self) -> Arg<'py> {
        Arg {
            layout: self.layout.transposed(),
            transposed: !self.transposed,
            ..self.clone()
        }
    }

    pub fn dtype(&self) -> DType {
        self.dtype.expect("float argument")
    }

    /// Half-open byte range this argument's elements occupy.
    pub fn byte_range(&self) -> (usize, usize) {
        let es = self.dtype.map(DType::size).unwrap_or(4) as isize;
        let (lo, hi) = self.layout.offset_range();
        if self.layout.numel() == 0 {
            return (self.ptr, self.ptr);
        }
        (
            (self.ptr as isize + lo * es) as usize,
            (self.ptr as isize + (hi + 1) * es) as usize,
        )
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// What kind of array `obj` is, or a `TypeError` naming `name`.
pub(crate) fn kind_of(py: Python<'_>, name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Kind> {
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
    name: &str,
    obj: &Bound<'py, PyAny>,
    int32: bool,
) -> PyResult<Arg<'py>> {
    match kind_of(py, name, obj)? {
        Kind::Torch => read_torch(py, name, obj, int32),
        Kind::Numpy => read_numpy(py, name, obj, int32),
    }
}

fn expected_dtypes(int32: bool) -> &'static str {
    if int32 {
        "torch.int32"
    } else {
        "torch.float16, torch.bfloat16, torch.float32 or torch.float64"
    }
}

fn read_torch<'py>(
    py: Python<'py>,
    name: &str,
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
                    "{name}: expected dtype {}, found {}",
                    expected_dtypes(false),
                    dt.str()?
                ))
                .into())
            }
        }
    };
    let dev = if obj.getattr(intern!(py, "is_cuda"))?.extract::<bool>()? {
        Dev::Cuda(obj.call_method0(intern!(py, "get_device"))?.extract()?)
    } else if obj.getattr(intern!(py, "is_cpu"))?.extract::<bool>()? {
        Dev::Cpu
    } else {
        return Err(Error::Device(format!(
            "{name}: tensors on device '{}' are not supported; expected a cpu or cuda tensor",
            obj.getattr(intern!(py, "device"))?.str()?
        ))
        .into());
    };
    let shape: Vec<usize> = obj.getattr(intern!(py, "shape"))?.extract()?;
    let strides: Vec<isize> = obj.call_method0(intern!(py, "stride"))?.extract()?;
    let ptr: usize = obj.call_method0(intern!(py, "data_ptr"))?.extract()?;
    Ok(Arg {
        name: name.to_string(),
        obj: obj.clone(),
        kind: Kind::Torch,
        ptr,
        layout: Layout::new(&shape, &strides),
        dtype,
        dev,
        transposed: false,
    })
}

fn read_numpy<'py>(
    py: Python<'py>,
    name: &str,
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
        name: name.to_string(),
        obj: arr.into_any(),
        kind: Kind::Numpy,
        ptr,
        layout: Layout::new(&shape, &strides),
        dtype,
        dev: Dev::Cpu,
        transposed: false,
    })
}

/// Reads the values of a 1-D int32 offsets argument on the host (CPU tensors and numpy
/// only).
pub(crate) fn host_i32s(arg: &Arg<'_>) -> Vec<i32> {
    let n = arg.layout.shape[0];
    let s = arg.layout.strides[0];
    (0..n)
        // SAFETY: `arg` is a live 1-D int32 CPU array; index i < n with its stride
        // addresses one of its elements.
        .map(|i| unsafe { *((arg.ptr as *const i32).offset(i as isize * s)) })
        .collect()
}

/// Checks that `arg` is 1-D (for offs).
pub(crate) fn need_1d(arg: &Arg<'_>) -> Result<()> {
    if arg.layout.ndim() != 1 {
        return Err(Error::Shape(format!(
            "{}: expected a 1-D tensor of group ends, found shape {}",
            arg.name,
            fmt_shape(&arg.layout.shape)
        )));
    }
    Ok(())
}
