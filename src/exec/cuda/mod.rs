//! The engine's CUDA side: one call into C++ per packed launch in the steady state, the
//! memory the face lends for it, and the copies of operands no kernel reads in place; the
//! requests themselves are made by `request` (operands normalised once, in Rust, into
//! the bridge's [`Operand`](crate::exec::ffi::Operand)).
//!
//! A packed product makes at most two calls across the seam: `ffi::submit_packed`
//! reads the device's deferred error flag, plans once and launches at once when the
//! workspace the face keeps for the stream is large enough and the stream is not
//! capturing; otherwise it hands the plan back and `ffi::launch_planned` launches it
//! with the workspace the face then provides. A list product plans once
//! (`ffi::plan_list`), writes its per-group argument block into host memory the face
//! uploads, and launches.
//!
//! Nothing here waits for the GPU. A build without CUDA keeps this module; every launch
//! fails with a message that says how to rebuild.

#![cfg_attr(not(feature = "python"), allow(dead_code))]

mod request;

use request::{device_index, list_request, packed_request, rows_request};
pub(super) use request::{operand, Fusion};

use super::vocab::{IntTensor, Runtime, Tensor};
#[cfg(groupmm_cuda)]
use super::{ffi, vocab::Device};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shape::{PackedDims, RowPtrs, RowsDims, RowsOp};

/// True when this build holds the CUDA kernels.
pub fn compiled() -> bool {
    cfg!(groupmm_cuda)
}

const NOT_COMPILED: &str = "groupmm was built without CUDA support, so it cannot run on cuda \
     tensors. Rebuild it with nvcc on PATH (or CUDA_HOME set) and the CUTLASS headers \
     available (pip install nvidia-cutlass==4.2.0.0, or CUTLASS_DIR=...): GROUPMM_CUDA=1 \
     pip install . ; groupmm.build_info() tells what a build holds";

/// Fails unless this build holds the CUDA kernels.
pub(super) fn check_compiled() -> Result<()> {
    if compiled() {
        Ok(())
    } else {
        Err(Error::Cuda(NOT_COMPILED.into()))
    }
}

/// What the CUDA part of this build holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaBuildInfo {
    /// `GROUPMM_CUDA_ARCHS` entries compiled, e.g. `["80", "90a"]`.
    pub archs: Vec<String>,
    /// CUDA toolkit release the runtime (linked statically) comes from, e.g. `"13.0"`.
    pub cuda_runtime: String,
    /// CUTLASS version of the headers the kernels were compiled with, e.g. `"4.2.0"`.
    pub cutlass: String,
    /// A development build (`GROUPMM_DEV_KNOBS=1`, build/main.rs): the `GROUPMM_SM90_*`
    /// overrides of `cuda/heuristics/` are read and the configurations only they reach are
    /// compiled. False in a product build.
    pub dev_knobs: bool,
}

/// What the CUDA part of this build holds; `None` when built without CUDA.
pub fn build_info() -> Option<CudaBuildInfo> {
    #[cfg(groupmm_cuda)]
    {
        Some(CudaBuildInfo {
            archs: env!("GROUPMM_CUDA_ARCHS")
                .split(';')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
            cuda_runtime: env!("GROUPMM_CUDA_RUNTIME").to_string(),
            cutlass: env!("GROUPMM_CUTLASS_VERSION").to_string(),
            dev_knobs: cfg!(groupmm_dev_knobs),
        })
    }
    #[cfg(not(groupmm_cuda))]
    None
}

/// Whether products of `dtype` on `device` read the routed rows through `src` inside the
/// GEMM (Hopper, 16-bit; a development build's `GROUPMM_SM90_GATHER=0` turns it off), so that a caller with two
/// products over the same gathered rows lets each read them rather than copying them once.
/// A call whose operands these kernels cannot read still gathers first (one copy).
pub fn gathers_in_gemm(device: i32, dtype: DType) -> Result<bool> {
    check_compiled()?;
    #[cfg(groupmm_cuda)]
    {
        ffi::gathers_in_gemm(device, request::ffi_dtype(dtype)).map_err(seam)
    }
    #[cfg(not(groupmm_cuda))]
    {
        let _ = (device, dtype);
        unreachable!("checked above")
    }
}

/// Reads and clears the deferred error flag of `device` (no sync): true when a launch
/// there met invalid `offs` (negative, decreasing or out of range) or a routed-row index
/// out of range since the last read. Only work that has completed is reflected.
pub fn take_deferred_error(device: i32) -> Result<bool> {
    check_compiled()?;
    #[cfg(groupmm_cuda)]
    {
        ffi::take_deferred_error(device).map_err(seam)
    }
    #[cfg(not(groupmm_cuda))]
    {
        let _ = device;
        unreachable!("checked above")
    }
}

#[cfg(groupmm_cuda)]
/// Limits every later launch of this process to `sms` SMs on any device (0: all of them):
/// the persistent products and the row kernels leave the other SMs to kernels that run
/// beside them, such as the exchanges of expert parallelism on NCCL's stream.
pub fn set_sm_limit(sms: i32) -> Result<()> {
    check_compiled()?;
    #[cfg(groupmm_cuda)]
    {
        ffi::set_sm_limit(sms).map_err(seam)
    }
    #[cfg(not(groupmm_cuda))]
    {
        let _ = sms;
        unreachable!("checked above")
    }
}

/// The limit [`set_sm_limit`] set (0: none); 0 without CUDA.
pub fn sm_limit() -> i32 {
    #[cfg(groupmm_cuda)]
    {
        ffi::sm_limit()
    }
    #[cfg(not(groupmm_cuda))]
    {
        0
    }
}

fn seam(e: cxx::Exception) -> Error {
    Error::Cuda(e.what().to_string())
}

/// `t`, or a contiguous copy of it (made by the face) when no kernel can read it.
pub(super) fn readable<R: Runtime>(rt: &mut R, t: &Tensor) -> Result<Tensor> {
    if operand(t).is_some() {
        return Ok(t.clone());
    }
    let (ptr, layout) = rt.contiguous(t.id)?;
    let copy = Tensor {
        ptr,
        layout,
        transposed: false,
        ..t.clone()
    };
    Ok(if t.transposed {
        crate::layout::Transposable::transposed(&copy)
    } else {
        copy
    })
}

/// `t` when the kernels read it row-major in place, else a contiguous copy of it (made by
/// the face): the operand that a gathered GroupedK product reads through `src` (and
/// its `a`, transposed) is a row-major tensor (the bridge's `Fusion`).
pub(super) fn row_major<R: Runtime>(rt: &mut R, t: &Tensor) -> Result<Tensor> {
    match operand(t) {
        Some(o) if !o.col_major => Ok(t.clone()),
        _ => super::vocab::contiguous(rt, t),
    }
}

/// `offs` (int32), or a contiguous copy when its stride is not 1.
pub(super) fn readable_offs<R: Runtime>(rt: &mut R, o: &IntTensor) -> Result<IntTensor> {
    if o.layout.shape.first().map_or(true, |&n| n <= 1) || o.layout.strides[0] == 1 {
        return Ok(o.clone());
    }
    let (ptr, layout) = rt.contiguous(o.id)?;
    Ok(IntTensor {
        ptr,
        layout,
        ..o.clone()
    })
}

/// The stream and TF32 flag of a launch on `device` with inputs of `dtype`.
fn stream_and_tf32<R: Runtime>(rt: &mut R, device: i32, dtype: DType) -> Result<(u64, bool)> {
    let stream = rt.stream(device)?;
    let tf32 = dtype == DType::F32 && rt.allow_tf32()?;
    Ok((stream, tf32))
}

/// Runs a validated packed product on CUDA into the contiguous target `c`, with what
/// `fusion` asks beyond `c = a · b` (with `src`: a GroupedM plan over its rows, `a` holds
/// the rows it names; with an epilogue: its outputs written too). `Ok(false)` says that
/// no kernel here does what `fusion` asks (nothing ran: the bridge answered
/// `Unsupported`); a plain product always runs.
///
/// # Safety
/// The descriptions are of live memory on the device for the whole call.
pub(super) unsafe fn packed<R: Runtime>(
    rt: &mut R,
    plan: &PackedDims,
    a: &Tensor,
    b: &Tensor,
    offs: Option<&IntTensor>,
    fusion: &Fusion<'_>,
    c: &Tensor,
) -> Result<bool> {
    check_compiled()?;
    let device = device_index(a);
    let st = stream_and_tf32(rt, device, a.dtype)?;
    let req = packed_request(plan, a, b, offs, fusion, c, st)?;
    #[cfg(groupmm_cuda)]
    {
        let (ws, ws_bytes) = rt.cached_workspace(device, st.0);
        // SAFETY: the operands are live device memory (contract), `ws` holds `ws_bytes`
        // bytes kept alive by the face for the call.
        let r = unsafe { ffi::submit_packed(&req, ws, ws_bytes) }.map_err(seam)?;
        match r.status {
            ffi::Submitted::Launched => Ok(true),
            ffi::Submitted::Unsupported => Ok(false),
            ffi::Submitted::OffsPending => {
                Err(crate::shape::offs_error_pending(Device::Cuda(device)))
            }
            ffi::Submitted::IndexPending => {
                Err(crate::shape::index_error_pending(Device::Cuda(device)))
            }
            _ => {
                let bytes = r.workspace_bytes;
                let ws = rt.workspace(device, st.0, bytes, r.capturing)?;
                let plan = r
                    .plan
                    .as_ref()
                    .ok_or_else(|| Error::Cuda("internal: no plan to launch".into()))?;
                // SAFETY: as above, with a workspace of `bytes` bytes.
                unsafe { ffi::launch_planned(plan, ws, bytes) }.map_err(seam)?;
                Ok(true)
            }
        }
    }
    #[cfg(not(groupmm_cuda))]
    {
        let _ = req;
        unreachable!("checked above")
    }
}

/// Runs a validated list product on CUDA: group `i` reads `a[i]`, `b[i]` (through
/// [`readable`]) and writes the contiguous target `c[i]`.
///
/// # Safety
/// As [`packed`].
pub(super) unsafe fn list<R: Runtime>(
    rt: &mut R,
    a: &[Tensor],
    b: &[Tensor],
    c: &[&Tensor],
) -> Result<()> {
    check_compiled()?;
    let Some(first) = a.first() else {
        return Ok(());
    };
    let device = device_index(first);
    let st = stream_and_tf32(rt, device, first.dtype)?;
    let (req, groups) = list_request(a, b, c, device, st)?;
    #[cfg(groupmm_cuda)]
    {
        let p = ffi::plan_list(&req, &groups).map_err(seam)?;
        if p.offs_pending {
            return Err(crate::shape::offs_error_pending(Device::Cuda(device)));
        }
        if p.index_pending {
            return Err(crate::shape::index_error_pending(Device::Cuda(device)));
        }
        let plan = p
            .plan
            .as_ref()
            .ok_or_else(|| Error::Cuda("internal: no list plan".into()))?;
        let args = rt.upload(device, p.args_bytes.max(1), &mut |host| {
            ffi::write_list_args(plan, &mut host[..p.args_bytes]).map_err(seam)
        })?;
        let ws = match p.workspace_bytes {
            0 => 0,
            n => rt.device_bytes(device, n)?,
        };
        // SAFETY: the operands are live device memory (contract); the argument block
        // and the workspace are device memory the face keeps alive for the call.
        unsafe { ffi::launch_list(plan, args, ws, p.workspace_bytes) }.map_err(seam)
    }
    #[cfg(not(groupmm_cuda))]
    {
        let _ = (req, groups);
        unreachable!("checked above")
    }
}

/// Enqueues a validated row op of the MoE glue (`super::rows`) on the current stream:
/// one call across the seam; ScatterRows gets its int32 scratch from
/// [`Runtime::device_bytes`].
///
/// # Safety
/// `p` holds live contiguous device memory of `device` of the extents `d` and the
/// dtypes given; `out` is disjoint from the inputs.
pub(super) unsafe fn rows<R: Runtime>(
    rt: &mut R,
    device: i32,
    d: &RowsDims,
    (dtype, w_dtype): (DType, DType),
    p: RowPtrs,
) -> Result<()> {
    check_compiled()?;
    let stream = rt.stream(device)?;
    let scratch = match d.op {
        RowsOp::ScatterRows if d.rows > 0 => rt.device_bytes(device, d.rows * 4)?,
        _ => 0,
    };
    let req = rows_request(d, dtype, w_dtype, device, p, scratch, stream);
    #[cfg(groupmm_cuda)]
    {
        // SAFETY: the request's addresses are live device memory (contract).
        unsafe { ffi::launch_rows(&req) }.map_err(seam)
    }
    #[cfg(not(groupmm_cuda))]
    {
        let _ = req;
        unreachable!("checked above")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_info_matches_compiled() {
        assert_eq!(build_info().is_some(), compiled());
        if let Some(info) = build_info() {
            assert!(!info.archs.is_empty());
            assert!(!info.cuda_runtime.is_empty());
            assert!(info.cutlass.chars().next().unwrap().is_ascii_digit());
        }
    }

    /// Without a GPU (or without CUDA in the build) a CUDA call comes back as an error,
    /// never a crash.
    #[test]
    fn no_gpu_is_an_error() {
        match take_deferred_error(0) {
            Err(Error::Cuda(msg)) => assert!(!msg.is_empty()),
            Ok(_) => {} // a machine with a GPU
            other => panic!("expected Error::Cuda, got {other:?}"),
        }
    }
}
