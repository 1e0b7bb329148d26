//! The CUDA memory the face lends: torch's current stream and TF32 flag, the workspace
//! kept per (device, stream) for the packed launches (grown geometrically; fresh graph
//! memory under capture), zero-filled device blocks, and argument blocks uploaded from
//! pinned memory. Nothing here waits for the GPU.

use super::PyRuntime;
use crate::error::{Error, Result};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Mutex;

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

impl<'py> PyRuntime<'py> {
    /// `like.new_empty([bytes], dtype=torch.uint8)` (`new_zeros` when `zeroed`: a memset
    /// on the current stream), kept for the call.
    pub(super) fn uint8(&mut self, bytes: usize, zeroed: bool) -> Result<(u64, Bound<'py, PyAny>)> {
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

    /// torch's current stream of `device` (`cudaStream_t`).
    pub(super) fn current_stream(&mut self, device: i32) -> Result<u64> {
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

    /// torch's TF32 flag for float32 matmuls.
    pub(super) fn tf32(&mut self) -> Result<bool> {
        match &self.torch()?.allow_tf32 {
            Some(f) => f
                .bind(self.py)
                .call0()
                .and_then(|b| b.extract::<bool>())
                .map_err(|e| self.fail(e)),
            None => Ok(false),
        }
    }

    /// The workspace kept for (`device`, `stream`), if any, kept alive for the call.
    pub(super) fn kept_workspace(&mut self, device: i32, stream: u64) -> (u64, usize) {
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
    pub(super) fn grown_workspace(
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

    /// Device memory of `bytes` holding what `fill` writes, through pinned host memory.
    pub(super) fn upload_block(
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
