//! The torch/numpy face's side of the engine: arguments read into descriptions, and what
//! the engine borrows from torch's (or numpy's) runtime — outputs from torch's caching
//! allocator (`like.new_empty`) or numpy, CUDA workspaces (one kept per device and
//! stream), argument blocks uploaded from pinned memory, contiguous and int32 copies, the
//! current stream, the TF32 flag, and `py.detach` (the GIL released) around CPU kernels.
//! Nothing here waits for the GPU.

// In a build without CUDA the CUDA half of the memory has no caller.
#![cfg_attr(not(groupmm_cuda), allow(dead_code))]

use super::tensor::{self, Arg, Kind, Torch, Want};
use crate::error::{Error, Result};
use crate::exec::{Device, IntTensor, Output, Runtime, Tensor};
use crate::layout::Layout;
use crate::DType;
use half::f16;
use numpy::{PyArrayDyn, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::cell::RefCell;
use std::fmt::Display;
use std::sync::Mutex;

/// The objects of one call and the memory lent to the engine for it. Everything it
/// keeps (copies, workspaces, argument blocks) lives until the call returns, after its
/// launches are enqueued; torch frees such memory stream-ordered.
pub(crate) struct PyRuntime<'py> {
    py: Python<'py>,
    /// The objects behind the descriptions, indexed by `Tensor::id`.
    objs: Vec<Bound<'py, PyAny>>,
    /// The reference argument (`a`, `As[0]`): its name, kind and object (outputs and
    /// device memory are made `like` it, on its device).
    like: Option<(&'static str, Kind, Bound<'py, PyAny>)>,
    /// The reference argument's dtype (outputs of that dtype need not name it).
    like_dtype: Option<DType>,
    keep: Vec<Bound<'py, PyAny>>,
    /// A Python exception met while lending memory (e.g. torch's out-of-memory error),
    /// raised as it is instead of the engine's error that carried its message.
    raised: RefCell<Option<PyErr>>,
}

impl<'py> PyRuntime<'py> {
    pub fn new(py: Python<'py>) -> Self {
        PyRuntime {
            py,
            objs: Vec::new(),
            like: None,
            like_dtype: None,
            keep: Vec::new(),
            raised: RefCell::new(None),
        }
    }

    /// Keeps a Python exception to raise as it is; the engine gets its message.
    fn fail(&self, e: PyErr) -> Error {
        let msg = e.to_string();
        *self.raised.borrow_mut() = Some(e);
        Error::Cuda(msg)
    }

    /// The exception to raise for an engine error: the Python exception behind it, if
    /// one was kept, else the engine's error mapped to its Python class.
    pub fn raise(&self, e: Error) -> PyErr {
        self.raised.borrow_mut().take().unwrap_or_else(|| e.into())
    }

    /// The kind of the call's arrays (of its reference argument).
    pub fn kind(&self) -> Kind {
        self.like.as_ref().map_or(Kind::Torch, |l| l.1)
    }

    fn register(&mut self, obj: Bound<'py, PyAny>) -> usize {
        self.objs.push(obj);
        self.objs.len() - 1
    }

    /// Every array argument is of the kind of the reference argument.
    fn check_kind(&self, name: &dyn Display, kind: Kind) -> Result<()> {
        match &self.like {
            Some((like, k, _)) if *k != kind => Err(Error::Type(format!(
                "{name}: expected a {} like {like}, found a {}",
                k.name(),
                kind.name()
            ))),
            _ => Ok(()),
        }
    }

    fn tensor(&mut self, name: &dyn Display, obj: &Bound<'py, PyAny>) -> PyResult<(Tensor, Kind)> {
        let Arg {
            obj,
            kind,
            ptr,
            layout,
            dtype,
            device,
            ..
        } = tensor::read(self.py, name, obj, Want::Float)?;
        let id = self.register(obj);
        let t = Tensor {
            ptr,
            dtype: dtype.expect("a float argument"),
            layout,
            device,
            id,
            transposed: false,
        };
        Ok((t, kind))
    }

    /// Reads the reference argument of the call (`a`, `As[0]`).
    pub fn reference(&mut self, name: &'static str, obj: &Bound<'py, PyAny>) -> PyResult<Tensor> {
        let (t, kind) = self.tensor(&name, obj)?;
        self.like = Some((name, kind, self.objs[t.id].clone()));
        self.like_dtype = Some(t.dtype);
        Ok(t)
    }

    /// Reads an input array of the kind of the reference argument.
    pub fn input(&mut self, name: &dyn Display, obj: &Bound<'py, PyAny>) -> PyResult<Tensor> {
        let (t, kind) = self.tensor(name, obj)?;
        self.check_kind(name, kind)?;
        Ok(t)
    }

    /// Reads `offs` (int32), if given.
    pub fn offs(&mut self, obj: Option<&Bound<'py, PyAny>>) -> PyResult<Option<IntTensor>> {
        match obj.filter(|o| !o.is_none()) {
            Some(o) => self.int_arg("offs", o, Want::Int32).map(Some),
            None => Ok(None),
        }
    }

    /// Reads an index argument named `name` (`src`, `inverse`): any integer dtype, which
    /// the engine has converted to int32 (through [`Runtime::int32`]) unless it is.
    pub fn index(&mut self, name: &'static str, obj: &Bound<'py, PyAny>) -> PyResult<IntTensor> {
        self.int_arg(name, obj, Want::Index)
    }

    fn int_arg(
        &mut self,
        name: &'static str,
        obj: &Bound<'py, PyAny>,
        want: Want,
    ) -> PyResult<IntTensor> {
        let a = tensor::read(self.py, &name, obj, want)?;
        self.check_kind(&name, a.kind)?;
        let (ptr, layout, device, int32) = (a.ptr, a.layout, a.device, a.int32);
        let id = self.register(a.obj);
        Ok(IntTensor {
            ptr,
            layout,
            device,
            id,
            int32,
        })
    }

    /// Reads a user-supplied output (`out=`): an array of the call's kind that can be
    /// written.
    pub fn output(
        &mut self,
        name: &dyn Display,
        obj: &Bound<'py, PyAny>,
    ) -> PyResult<Output<Bound<'py, PyAny>>> {
        let a = tensor::read(self.py, name, obj, Want::Float)?;
        let like = self.kind();
        if a.kind != like {
            return Err(Error::Type(format!(
                "{name}: expected a {} like the inputs, found a {}",
                like.name(),
                a.kind.name()
            ))
            .into());
        }
        if a.kind == Kind::Numpy {
            let writeable = obj
                .getattr(intern!(self.py, "flags"))
                .and_then(|f| f.getattr(intern!(self.py, "writeable")))
                .and_then(|w| w.extract::<bool>())
                .unwrap_or(true);
            if !writeable {
                return Err(Error::Value(format!(
                    "{name}: the numpy array is read-only (flags.writeable is False)"
                ))
                .into());
            }
            if !a.obj.is(obj) {
                return Err(Error::Value(format!(
                    "{name}: the numpy array is not aligned to its element size"
                ))
                .into());
            }
        }
        let t = Tensor {
            ptr: a.ptr,
            dtype: a.dtype.expect("a float argument"),
            layout: a.layout,
            device: a.device,
            id: usize::MAX,
            transposed: false,
        };
        Ok((a.obj, t))
    }

    /// A contiguous copy of the call's object `id`, kept for the call: torch's
    /// `.contiguous()`, numpy's `ascontiguousarray`.
    fn contiguous_copy(&mut self, id: usize) -> Result<(usize, Layout)> {
        let py = self.py;
        let obj = &self.objs[id];
        let (copy, memory) = match self.kind() {
            Kind::Torch => {
                let copy = obj
                    .call_method0(intern!(py, "contiguous"))
                    .map_err(|e| self.fail(e))?;
                let memory = tensor::torch_memory(&copy).map_err(|e| self.fail(e))?;
                (copy, memory)
            }
            Kind::Numpy => self.numpy_copy(id, None)?,
        };
        self.keep.push(copy);
        Ok(memory)
    }

    /// A contiguous int32 copy of the call's integer object `id`, kept for the call: its
    /// address. torch: `.to(torch.int32)` (contiguous for a contiguous input, else
    /// `.contiguous()` too), the calls `_rows._index` made in Python before; numpy:
    /// `ascontiguousarray(a, int32)`.
    fn int32_copy(&mut self, id: usize) -> Result<usize> {
        let py = self.py;
        let (copy, ptr) = match self.kind() {
            Kind::Torch => {
                let t = self.torch()?;
                let fail = |e| self.fail(e);
                let mut copy = self.objs[id]
                    .call_method1(intern!(py, "to"), (t.int32.bind(py),))
                    .map_err(fail)?;
                let dense = copy
                    .call_method0(intern!(py, "is_contiguous"))
                    .and_then(|c| c.extract::<bool>())
                    .map_err(fail)?;
                if !dense {
                    copy = copy.call_method0(intern!(py, "contiguous")).map_err(fail)?;
                }
                let ptr = self.data_ptr(&copy)? as usize;
                (copy, ptr)
            }
            Kind::Numpy => {
                let (copy, (ptr, _)) = self.numpy_copy(id, Some(intern!(py, "int32")))?;
                (copy, ptr)
            }
        };
        self.keep.push(copy);
        Ok(ptr)
    }

    /// `numpy.ascontiguousarray(objs[id], dtype)` and its memory.
    fn numpy_copy(
        &self,
        id: usize,
        dtype: Option<&Bound<'py, pyo3::types::PyString>>,
    ) -> Result<(Bound<'py, PyAny>, (usize, Layout))> {
        let py = self.py;
        let f = py
            .import(intern!(py, "numpy"))
            .and_then(|np| np.getattr(intern!(py, "ascontiguousarray")))
            .map_err(|e| self.fail(e))?;
        let copy = match dtype {
            Some(d) => f.call1((&self.objs[id], d)),
            None => f.call1((&self.objs[id],)),
        }
        .map_err(|e| self.fail(e))?;
        let arr = copy
            .cast::<PyUntypedArray>()
            .map_err(|e| self.fail(e.into()))?;
        let memory = tensor::numpy_memory(arr)
            .map_err(|s| Error::Value(format!("internal: a contiguous copy with strides {s:?}")))?;
        Ok((copy, memory))
    }

    fn like(&self) -> Result<&Bound<'py, PyAny>> {
        self.like
            .as_ref()
            .map(|l| &l.2)
            .ok_or_else(|| Error::Type("internal: no reference argument".into()))
    }

    fn torch(&self) -> Result<&'py Torch> {
        Torch::get(self.py)
            .map_err(|e| self.fail(e))?
            .ok_or_else(|| Error::Cuda("internal: torch is not imported".into()))
    }

    /// `like.new_empty([bytes], dtype=torch.uint8)` (`new_zeros` when `zeroed`: a memset
    /// on the current stream), kept for the call.
    fn uint8(&mut self, bytes: usize, zeroed: bool) -> Result<(u64, Bound<'py, PyAny>)> {
        let t = self.torch()?;
        let kw = PyDict::new(self.py);
        kw.set_item(intern!(self.py, "dtype"), t.uint8.bind(self.py))
            .map_err(|e| self.fail(e))?;
        let make = if zeroed {
            intern!(self.py, "new_zeros")
        } else {
            intern!(self.py, "new_empty")
        };
        let obj = self
            .like()?
            .call_method(make, (vec![bytes],), Some(&kw))
            .map_err(|e| self.fail(e))?;
        let ptr = self.data_ptr(&obj)?;
        self.keep.push(obj.clone());
        Ok((ptr, obj))
    }

    fn data_ptr(&self, obj: &Bound<'_, PyAny>) -> Result<u64> {
        obj.call_method0(intern!(self.py, "data_ptr"))
            .and_then(|p| p.extract())
            .map_err(|e| self.fail(e))
    }
}

/// One workspace kept per (device, stream) for the packed launches.
struct CachedWorkspace {
    device: i32,
    stream: u64,
    bytes: usize,
    ptr: u64,
    tensor: Py<PyAny>,
}

/// Streams with a cached workspace, most recently grown last; the oldest is dropped past
/// this many (torch frees it stream-ordered).
const WORKSPACE_CACHE_LEN: usize = 16;
static WORKSPACES: Mutex<Vec<CachedWorkspace>> = Mutex::new(Vec::new());

/// The cache, locked. The lock is never held across a call into Python: such a call may
/// release the GIL and let a thread holding the GIL wait for the lock.
fn workspaces() -> std::sync::MutexGuard<'static, Vec<CachedWorkspace>> {
    WORKSPACES.lock().unwrap_or_else(|e| e.into_inner())
}

impl<'py> Runtime for PyRuntime<'py> {
    type Out = Bound<'py, PyAny>;

    fn alloc(
        &mut self,
        shape: &[usize],
        dtype: DType,
        device: Device,
    ) -> Result<Output<Self::Out>> {
        let py = self.py;
        let obj = match self.kind() {
            Kind::Torch => {
                // `like.new_empty` keeps like's device (the device of every operand) and,
                // unless told, its dtype; we know everything about the fresh contiguous
                // tensor but its address. The sizes go as separate ints and the dtype only
                // when it differs (a list and a keyword cost torch's argument parser more).
                let kw = match self.like_dtype {
                    Some(d) if d == dtype => None,
                    _ => {
                        let t = self.torch()?;
                        let kw = PyDict::new(py);
                        kw.set_item(intern!(py, "dtype"), t.dtype_obj(py, dtype))
                            .map_err(|e| self.fail(e))?;
                        Some(kw)
                    }
                };
                let like = self.like()?;
                match shape {
                    [] => like.call_method(intern!(py, "new_empty"), ((),), kw.as_ref()),
                    _ => {
                        let sizes = PyTuple::new(py, shape).map_err(|e| self.fail(e))?;
                        like.call_method(intern!(py, "new_empty"), sizes, kw.as_ref())
                    }
                }
                .map_err(|e| self.fail(e))?
            }
            Kind::Numpy => match dtype {
                DType::F64 => PyArrayDyn::<f64>::zeros(py, shape, false).into_any(),
                DType::F32 => PyArrayDyn::<f32>::zeros(py, shape, false).into_any(),
                DType::F16 => PyArrayDyn::<f16>::zeros(py, shape, false).into_any(),
                DType::BF16 => return Err(Error::Dtype("numpy has no bfloat16 output".into())),
            },
        };
        let ptr = match self.kind() {
            Kind::Torch => self.data_ptr(&obj)? as usize,
            Kind::Numpy => {
                let arr = obj
                    .cast::<PyUntypedArray>()
                    .map_err(|e| self.fail(e.into()))?;
                // SAFETY: `as_array_ptr` points at the live PyArrayObject we just made.
                unsafe { (*arr.as_array_ptr()).data as usize }
            }
        };
        let t = Tensor {
            ptr,
            dtype,
            layout: Layout::contiguous(shape),
            device,
            id: usize::MAX,
            transposed: false,
        };
        Ok((obj, t))
    }

    fn run_cpu(&mut self, job: &mut (dyn FnMut() + Send)) {
        self.py.detach(job)
    }

    fn contiguous(&mut self, id: usize) -> Result<(usize, Layout)> {
        self.contiguous_copy(id)
    }

    fn int32(&mut self, id: usize) -> Result<usize> {
        self.int32_copy(id)
    }

    fn can_transpose(&self) -> bool {
        true
    }

    fn transposed(&mut self, o: Self::Out) -> Result<Self::Out> {
        // `swapaxes` is a view for torch tensors and numpy arrays alike
        o.call_method1(intern!(self.py, "swapaxes"), (-2, -1))
            .map_err(|e| self.fail(e))
    }

    fn copy_into(&mut self, dst: &Self::Out, src: &Self::Out) -> Result<()> {
        dst.call_method1(intern!(self.py, "copy_"), (src,))
            .map_err(|e| self.fail(e))?;
        Ok(())
    }

    fn stream(&mut self, device: i32) -> Result<u64> {
        match &self.torch()?.raw_stream {
            Some(f) => f
                .bind(self.py)
                .call1((device,))
                .and_then(|s| s.extract::<u64>())
                .map_err(|e| self.fail(e)),
            None => Err(Error::Cuda(
                "torch was built without CUDA; cannot run on cuda tensors".into(),
            )),
        }
    }

    fn allow_tf32(&mut self) -> Result<bool> {
        match &self.torch()?.allow_tf32 {
            Some(f) => f
                .bind(self.py)
                .call0()
                .and_then(|b| b.extract::<bool>())
                .map_err(|e| self.fail(e)),
            None => Ok(false),
        }
    }

    fn cached_workspace(&mut self, device: i32, stream: u64) -> (u64, usize) {
        let found = workspaces()
            .iter()
            .find(|w| w.device == device && w.stream == stream)
            .map(|w| (w.ptr, w.bytes, w.tensor.bind(self.py).clone()));
        match found {
            // Kept until the launch is enqueued, so a concurrent replacement cannot free
            // the block before the launch is ordered on the stream.
            Some((ptr, bytes, t)) => {
                self.keep.push(t);
                (ptr, bytes)
            }
            None => (0, 0),
        }
    }

    /// Outside graph capture the workspace of (`device`, `stream`) is reused: every use
    /// is ordered on that one stream (a launch's argument builder runs after the previous
    /// launch's GEMMs there), so reuse needs no sync and saves an allocation per call.
    /// Under capture a fresh block comes from torch (the graph's pool), since a graph
    /// may be replayed on another stream.
    fn workspace(
        &mut self,
        device: i32,
        stream: u64,
        bytes: usize,
        capturing: bool,
    ) -> Result<u64> {
        if capturing {
            return Ok(self.uint8(bytes, true)?.0);
        }
        let old = workspaces()
            .iter()
            .find(|w| w.device == device && w.stream == stream)
            .map_or(0, |w| w.bytes);
        // Grow geometrically so that a run of growing group counts allocates few times.
        let bytes = bytes.max(old + old / 2).next_multiple_of(4096);
        let (ptr, t) = self.uint8(bytes, true)?;
        let evicted: Vec<CachedWorkspace> = {
            let mut cache = workspaces();
            let mut evicted = Vec::new();
            if let Some(i) = cache
                .iter()
                .position(|w| w.device == device && w.stream == stream)
            {
                evicted.push(cache.remove(i));
            }
            if cache.len() >= WORKSPACE_CACHE_LEN {
                evicted.push(cache.remove(0));
            }
            cache.push(CachedWorkspace {
                device,
                stream,
                bytes,
                ptr,
                tensor: t.unbind(),
            });
            evicted
        };
        drop(evicted); // outside the lock: freeing a tensor runs torch code
        Ok(ptr)
    }

    fn device_bytes(&mut self, _device: i32, bytes: usize) -> Result<u64> {
        Ok(self.uint8(bytes, true)?.0)
    }

    fn upload(
        &mut self,
        device: i32,
        bytes: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<u64> {
        let py = self.py;
        let t = self.torch()?;
        let kw = PyDict::new(py);
        kw.set_item(intern!(py, "dtype"), t.uint8.bind(py))
            .map_err(|e| self.fail(e))?;
        kw.set_item(intern!(py, "pin_memory"), true)
            .map_err(|e| self.fail(e))?;
        let pinned = t
            .empty
            .bind(py)
            .call((vec![bytes],), Some(&kw))
            .map_err(|e| self.fail(e))?;
        let host = self.data_ptr(&pinned)? as *mut u8;
        // SAFETY: `pinned` is a live uint8 tensor of `bytes` bytes that nothing else
        // references yet.
        fill(unsafe { std::slice::from_raw_parts_mut(host, bytes) })?;
        // `like` is on `device` (every operand is): the block goes there, entirely
        // written by the copy below.
        let _ = device;
        let (dev_ptr, dev) = self.uint8(bytes, false)?;
        // torch's copy records the pinned block's use, so its caching host allocator will
        // not hand it out again before the copy has run.
        let kw = PyDict::new(py);
        kw.set_item(intern!(py, "non_blocking"), true)
            .map_err(|e| self.fail(e))?;
        dev.call_method(intern!(py, "copy_"), (&pinned,), Some(&kw))
            .map_err(|e| self.fail(e))?;
        self.keep.push(pinned);
        Ok(dev_ptr)
    }
}
