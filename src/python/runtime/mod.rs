//! The torch/numpy face's side of the engine: arguments read into descriptions
//! (`args`), and what the engine borrows from torch's (or numpy's) runtime: here, outputs
//! from torch's caching allocator (`like.new_empty`) or numpy and contiguous and int32
//! copies of operands; in `cuda`, the current stream, the TF32 flag, CUDA workspaces (one
//! kept per device and stream) and argument blocks uploaded from pinned memory. CPU kernels
//! run with the GIL released (`py.detach`). Nothing here waits for the GPU.

// In a build without CUDA the CUDA half of the memory has no caller.
#![cfg_attr(not(groupmm_cuda), allow(dead_code))]

mod args;
mod cuda;

use super::tensor::{self, Kind, Torch};
use crate::error::{Error, Result};
use crate::exec::{Device, Output, Runtime, Tensor};
use crate::layout::Layout;
use crate::DType;
use half::f16;
use numpy::{PyArrayDyn, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::cell::RefCell;

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

    fn data_ptr(&self, obj: &Bound<'_, PyAny>) -> Result<u64> {
        obj.call_method0(intern!(self.py, "data_ptr"))
            .and_then(|p| p.extract())
            .map_err(|e| self.fail(e))
    }
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

    /// On like's device, the device of every operand (as `alloc`).
    fn alloc_int64(&mut self, shape: &[usize], _device: Device) -> Result<(Self::Out, usize)> {
        let py = self.py;
        match self.kind() {
            Kind::Torch => {
                let t = self.torch()?;
                let kw = PyDict::new(py);
                kw.set_item(intern!(py, "dtype"), t.int64.bind(py))
                    .map_err(|e| self.fail(e))?;
                let sizes = PyTuple::new(py, shape).map_err(|e| self.fail(e))?;
                let obj = self
                    .like()?
                    .call_method(intern!(py, "new_empty"), sizes, Some(&kw))
                    .map_err(|e| self.fail(e))?;
                let ptr = self.data_ptr(&obj)? as usize;
                Ok((obj, ptr))
            }
            Kind::Numpy => {
                let arr = PyArrayDyn::<i64>::zeros(py, shape, false);
                // SAFETY: `as_array_ptr` points at the live PyArrayObject we just made.
                let ptr = unsafe { (*arr.as_array_ptr()).data as usize };
                Ok((arr.into_any(), ptr))
            }
        }
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
        self.current_stream(device)
    }

    fn allow_tf32(&mut self) -> Result<bool> {
        self.tf32()
    }

    fn cached_workspace(&mut self, device: i32, stream: u64) -> (u64, usize) {
        self.kept_workspace(device, stream)
    }

    fn workspace(
        &mut self,
        device: i32,
        stream: u64,
        bytes: usize,
        capturing: bool,
    ) -> Result<u64> {
        self.grown_workspace(device, stream, bytes, capturing)
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
        self.upload_block(device, bytes, fill)
    }
}
