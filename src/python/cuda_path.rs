//! The CUDA side of the bindings: operands normalised to a unit stride, outputs and
//! workspaces allocated through torch on the tensors' device, launches on torch's
//! current stream. Nothing here waits for the GPU.

use super::tensor::{self, Arg, Dev, Torch};
use super::{alloc_like, Packed};
use crate::cuda::{self, ListLaunch, Operand, PackedLaunch};
use crate::error::Error;
use crate::shape::GroupDims;
use crate::DType;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::sync::Mutex;

const NOT_COMPILED: &str =
    "groupmm was built without CUDA support, so it cannot run on cuda tensors. \
Rebuild it with nvcc on PATH (or CUDA_HOME set) and the CUTLASS headers available \
(pip install nvidia-cutlass==4.2.0.0, or CUTLASS_DIR=...): GROUPMM_CUDA=1 pip install . ; \
groupmm.build_info() tells what a build holds";

fn device_of(arg: &Arg<'_>) -> i32 {
    match arg.dev {
        Dev::Cuda(i) => i,
        Dev::Cpu => unreachable!("cuda path with a cpu tensor"),
    }
}

/// The launcher's view of a 2- or 3-D operand. Strides of extent-1 dimensions are
/// normalised so that row/column-majorness is decided by the real dimensions.
fn operand(arg: &Arg<'_>) -> Operand {
    let l = &arg.layout;
    let nd = l.ndim();
    let (rows, cols) = (l.shape[nd - 2] as i64, l.shape[nd - 1] as i64);
    let (mut rs, mut cs) = (l.strides[nd - 2] as i64, l.strides[nd - 1] as i64);
    if rows <= 1 {
        rs = if cs == 1 { cols.max(1) } else { 1 };
    }
    if cols <= 1 {
        cs = if rs == 1 { rows.max(1) } else { 1 };
    }
    let (batch, bs) = if nd == 3 {
        (l.shape[0] as i64, l.strides[0] as i64)
    } else {
        (1, 0)
    };
    Operand {
        ptr: arg.ptr as u64,
        batch,
        rows,
        cols,
        batch_stride: bs,
        row_stride: rs,
        col_stride: cs,
    }
}

/// True when the kernels can read the operand in place: row- or column-major in its
/// last two dimensions, and a non-zero batch stride when there are several groups
/// (the launchers' rules, cuda/dispatch.cu `normalise`).
fn kernel_readable(arg: &Arg<'_>) -> bool {
    let o = operand(arg);
    if o.batch > 1 && o.rows > 0 && o.cols > 0 && o.batch_stride == 0 {
        return false; // an expanded batch (stride 0): the launchers want distinct groups
    }
    (o.col_stride == 1 && o.row_stride >= o.cols.max(1))
        || (o.row_stride == 1 && o.col_stride >= o.rows.max(1))
}

/// A copy with a layout the kernels read, when (and only when) needed.
fn readable<'py>(py: Python<'py>, arg: &Arg<'py>) -> PyResult<Arg<'py>> {
    if kernel_readable(arg) && arg.layout.strides.iter().all(|&s| s >= 0) {
        return Ok(arg.clone());
    }
    let c = arg.obj.call_method0(intern!(py, "contiguous"))?;
    let mut n = tensor::read(py, &arg.name, &c, arg.dtype.is_none())?;
    if arg.transposed {
        n = n.transposed();
    }
    Ok(n)
}

fn torch(py: Python<'_>) -> PyResult<&Torch> {
    Ok(Torch::get(py)?.expect("cuda tensors imply torch"))
}

/// Torch's current stream on `dev`, and (for float32 only; no other dtype uses it)
/// whether torch allows TF32 matmuls.
fn stream_and_tf32(py: Python<'_>, dev: i32, dtype: DType) -> PyResult<(u64, bool)> {
    let t = torch(py)?;
    let stream = match &t.raw_stream {
        Some(f) => f.bind(py).call1((dev,))?.extract::<u64>()?,
        None => {
            return Err(Error::Cuda(
                "torch was built without CUDA; cannot run on cuda tensors".into(),
            )
            .into())
        }
    };
    let tf32 = match &t.allow_tf32 {
        Some(f) if dtype == DType::F32 => f.bind(py).call0()?.extract::<bool>()?,
        _ => false,
    };
    Ok((stream, tf32))
}

/// A uint8 device buffer of `bytes` from torch's caching allocator (stream-ordered on
/// the current stream, so dropping it after the launch is safe).
fn device_bytes<'py>(
    py: Python<'py>,
    like: &Arg<'py>,
    bytes: usize,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    if bytes == 0 {
        return Ok(None);
    }
    let t = torch(py)?;
    let kw = PyDict::new(py);
    kw.set_item(intern!(py, "dtype"), t.uint8.bind(py))?;
    Ok(Some(like.obj.call_method(
        intern!(py, "new_empty"),
        (vec![bytes],),
        Some(&kw),
    )?))
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

/// Device memory for a packed launch's arguments and CUTLASS workspace: `(address,
/// owner)`. Outside graph capture, the workspace of (`dev`, `stream`) is reused: every
/// use is ordered on that one stream (a launch's argument builder runs after the
/// previous launch's GEMMs there), so reuse needs no sync, and it saves an allocation
/// per call. Under capture a fresh block comes from torch (the graph's pool), since a
/// graph may be replayed on another stream.
fn workspace<'py>(
    py: Python<'py>,
    like: &Arg<'py>,
    dev: i32,
    stream: u64,
    bytes: usize,
) -> PyResult<(u64, Option<Bound<'py, PyAny>>)> {
    if bytes == 0 {
        return Ok((0, None));
    }
    if cuda::stream_capturing(stream)? {
        let t = device_bytes(py, like, bytes)?.expect("non-zero size");
        return Ok((data_ptr(&t)?, Some(t)));
    }
    // The lock is never held across a call into Python: such a call may release the GIL
    // and let a thread holding the GIL wait for the lock.
    let lock = || WORKSPACES.lock().unwrap_or_else(|e| e.into_inner());
    let key = |w: &CachedWorkspace| w.device == dev && w.stream == stream;
    let old = match lock().iter().find(|w| key(w)) {
        // The caller holds a reference until its launch is enqueued, so a concurrent
        // replacement cannot free the block before the launch is ordered on the stream.
        Some(w) if w.bytes >= bytes => return Ok((w.ptr, Some(w.tensor.bind(py).clone()))),
        Some(w) => w.bytes,
        None => 0,
    };
    // Grow geometrically so that a run of growing group counts allocates few times.
    let bytes = bytes.max(old + old / 2).next_multiple_of(4096);
    let t = device_bytes(py, like, bytes)?.expect("non-zero size");
    let ptr = data_ptr(&t)?;
    let evicted: Vec<CachedWorkspace> = {
        let mut cache = lock();
        let mut evicted = Vec::new();
        if let Some(i) = cache.iter().position(key) {
            evicted.push(cache.remove(i));
        }
        if cache.len() >= WORKSPACE_CACHE_LEN {
            evicted.push(cache.remove(0));
        }
        cache.push(CachedWorkspace {
            device: dev,
            stream,
            bytes,
            ptr,
            tensor: t.clone().unbind(),
        });
        evicted
    };
    drop(evicted); // outside the lock: freeing a tensor runs torch code
    Ok((ptr, Some(t)))
}

fn data_ptr(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    obj.call_method0(intern!(obj.py(), "data_ptr"))?.extract()
}

/// Raises if an earlier launch on `dev` saw invalid `offs` (read without a sync).
fn check_pending(dev: i32) -> PyResult<()> {
    if cuda::take_offs_error(dev)? {
        return Err(Error::Value(format!(
            "offs: an earlier grouped_mm call on cuda:{dev} received invalid offs (negative, \
             decreasing or past the end); its groups were clamped to the valid range. \
             CUDA reports this asynchronously, at the next call"
        ))
        .into());
    }
    Ok(())
}

/// Output target: the user's `out` when the kernels can write it in place, else a fresh
/// contiguous tensor (copied into `out` afterwards).
fn target<'py>(
    py: Python<'py>,
    like: &Arg<'py>,
    out: Option<&Arg<'py>>,
    shape: &[usize],
    dtype: DType,
) -> PyResult<Arg<'py>> {
    match out {
        Some(o) if o.layout.is_contiguous() => Ok(o.clone()),
        _ => alloc_like(py, like, "out", shape, dtype, false),
    }
}

pub(super) fn packed<'py>(
    py: Python<'py>,
    p: &Packed<'py>,
    out: Option<Arg<'py>>,
) -> PyResult<Bound<'py, PyAny>> {
    if !cuda::compiled() {
        return Err(Error::Cuda(NOT_COMPILED.into()).into());
    }
    let dev = device_of(&p.a);
    check_pending(dev)?;
    let a = readable(py, &p.a)?;
    let b = readable(py, &p.b)?;
    let offs = match &p.offs {
        Some(o) if o.layout.strides[0] != 1 && o.layout.shape[0] > 1 => Some(readable_1d(py, o)?),
        other => other.clone(),
    };
    let c = target(py, &p.a, out.as_ref(), &p.plan.out_shape, p.out_dtype)?;
    let (stream, allow_tf32) = stream_and_tf32(py, dev, a.dtype())?;
    let plan = &p.plan;
    let launch = PackedLaunch {
        form: plan.form,
        dtype: a.dtype(),
        out_dtype: p.out_dtype,
        groups: plan.groups as i64,
        m: plan.m as i64,
        n: plan.n as i64,
        k: plan.k as i64,
        a: operand(&a),
        b: operand(&b),
        c: operand(&c),
        offs: offs.as_ref().map(|o| o.ptr as u64).unwrap_or(0),
        stream,
        device: dev,
        allow_tf32,
    };
    let ws_bytes = cuda::packed_workspace_bytes(&launch)?;
    let (ws_ptr, _ws) = workspace(py, &a, dev, stream, ws_bytes)?;
    cuda::launch_packed(&launch, ws_ptr, ws_bytes)?;
    finish(py, c, out)
}

fn readable_1d<'py>(py: Python<'py>, o: &Arg<'py>) -> PyResult<Arg<'py>> {
    let c = o.obj.call_method0(intern!(py, "contiguous"))?;
    tensor::read(py, &o.name, &c, true)
}

/// Copies the computed target into the user's `out` when they differ.
fn finish<'py>(py: Python<'py>, c: Arg<'py>, out: Option<Arg<'py>>) -> PyResult<Bound<'py, PyAny>> {
    match out {
        Some(o) if !o.obj.is(&c.obj) => {
            o.obj.call_method1(intern!(py, "copy_"), (&c.obj,))?;
            Ok(o.obj)
        }
        _ => Ok(c.obj),
    }
}

pub(super) fn list<'py>(
    py: Python<'py>,
    a: &[Arg<'py>],
    b: &[Arg<'py>],
    dims: &[GroupDims],
    out_dtype: DType,
    outs: Option<Vec<Arg<'py>>>,
) -> PyResult<Bound<'py, PyList>> {
    if !cuda::compiled() {
        return Err(Error::Cuda(NOT_COMPILED.into()).into());
    }
    let first = &a[0];
    let dev = device_of(first);
    check_pending(dev)?;
    let a: Vec<Arg<'py>> = a.iter().map(|x| readable(py, x)).collect::<PyResult<_>>()?;
    let b: Vec<Arg<'py>> = b.iter().map(|x| readable(py, x)).collect::<PyResult<_>>()?;
    let targets: Vec<Arg<'py>> = dims
        .iter()
        .enumerate()
        .map(|(i, d)| {
            target(
                py,
                first,
                outs.as_ref().map(|o| &o[i]),
                &[d.m, d.n],
                out_dtype,
            )
        })
        .collect::<PyResult<_>>()?;
    let (stream, allow_tf32) = stream_and_tf32(py, dev, first.dtype())?;
    let launch = ListLaunch {
        dtype: first.dtype(),
        out_dtype,
        dims: dims
            .iter()
            .map(|d| (d.m as i64, d.n as i64, d.k as i64))
            .collect(),
        a: a.iter().map(operand).collect(),
        b: b.iter().map(operand).collect(),
        c: targets.iter().map(operand).collect(),
        stream,
        device: dev,
        allow_tf32,
    };
    let host_bytes = cuda::list_host_args_bytes(&launch)?;
    let t = torch(py)?;
    let kw = PyDict::new(py);
    kw.set_item(intern!(py, "dtype"), t.uint8.bind(py))?;
    kw.set_item(intern!(py, "pin_memory"), true)?;
    let pinned = t.empty.bind(py).call(([host_bytes.max(1)],), Some(&kw))?;
    let dev_args = device_bytes(py, first, host_bytes.max(1))?.expect("non-zero size");
    let dev_ptr = data_ptr(&dev_args)?;
    let host_ptr = data_ptr(&pinned)? as *mut u8;
    // SAFETY: `pinned` is a live uint8 tensor of at least `host_bytes` bytes that nothing
    // else references yet.
    let host = unsafe { std::slice::from_raw_parts_mut(host_ptr, host_bytes) };
    cuda::write_list_args(&launch, host, dev_ptr)?;
    // torch's copy records the pinned block's use, so its caching host allocator will
    // not hand it out again before the copy has run.
    let kw = PyDict::new(py);
    kw.set_item(intern!(py, "non_blocking"), true)?;
    dev_args.call_method(intern!(py, "copy_"), (&pinned,), Some(&kw))?;
    let ws_bytes = cuda::list_workspace_bytes(&launch)?;
    let ws = device_bytes(py, first, ws_bytes)?;
    let ws_ptr = match &ws {
        Some(w) => data_ptr(w)?,
        None => 0,
    };
    cuda::launch_list(&launch, dev_ptr, ws_ptr, ws_bytes)?;
    let results: Vec<Bound<'py, PyAny>> = match outs {
        Some(o) => targets
            .into_iter()
            .zip(o)
            .map(|(c, oi)| finish(py, c, Some(oi)))
            .collect::<PyResult<_>>()?,
        None => targets.into_iter().map(|c| c.obj).collect(),
    };
    PyList::new(py, results)
}
