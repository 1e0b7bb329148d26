//! The CUDA seam: launch descriptions the Python bindings fill in, and the calls that
//! run the CUTLASS kernels of `cuda/` through the `cxx` bridge.
//!
//! The caller validates shapes, dtypes and devices (see [`crate::shape`]), allocates the
//! output `c` (contiguous row-major) and the workspace through torch, and passes torch's
//! current stream and device index. These functions check the launch description again
//! (extents, strides, null pointers, workspace size) and return [`Error::Cuda`] rather
//! than launch anything unsafe.
//!
//! Packed forms never synchronise with the host: a kernel builds the per-group
//! arguments from `offs` on the device, clamping spans exactly as
//! [`crate::shape::clamp_spans`], and records invalid `offs` in a per-device flag that
//! [`take_offs_error`] reads without a sync. A packed launch can be captured in a CUDA
//! graph.
//!
//! A build without CUDA keeps the same API; every launch returns an error that says
//! how to rebuild.

use crate::{DType, Error, Form, Result};

/// A 2- or 3-D device operand; 2-D operands use batch = 1, batch_stride = 0. Strides in
/// elements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Operand {
    /// Device address of element `[0, 0, 0]`.
    pub ptr: u64,
    /// Extent of the batch (group) dimension; 1 for 2-D operands.
    pub batch: i64,
    /// Extent of the second-to-last dimension.
    pub rows: i64,
    /// Extent of the last dimension.
    pub cols: i64,
    /// Stride of the batch dimension (0 for 2-D operands).
    pub batch_stride: i64,
    /// Stride between rows.
    pub row_stride: i64,
    /// Stride between columns.
    pub col_stride: i64,
}

/// One packed grouped product (see the forms in [`crate::shape`]).
#[derive(Clone, Debug)]
pub struct PackedLaunch {
    /// The form.
    pub form: Form,
    /// Element type of `a` and `b`.
    pub dtype: DType,
    /// Element type of `c` (the input dtype, or float32 from 16-bit inputs).
    pub out_dtype: DType,
    /// Number of groups G.
    pub groups: i64,
    /// The plan's m (T for GroupedM).
    pub m: i64,
    /// The plan's n (N_total for GroupedN).
    pub n: i64,
    /// The plan's k (T for GroupedK).
    pub k: i64,
    /// Left operand.
    pub a: Operand,
    /// Right operand.
    pub b: Operand,
    /// Output, contiguous row-major, need not be initialised.
    pub c: Operand,
    /// Device address of int32 `offs[groups]` (cumulative group ends); 0 for Batched.
    pub offs: u64,
    /// `cudaStream_t` to run on.
    pub stream: u64,
    /// CUDA device index of every operand.
    pub device: i32,
    /// float32 only: allow TF32 tensor cores.
    pub allow_tf32: bool,
}

/// One list-form grouped product: group `i` computes `c[i] = a[i] · b[i]`.
#[derive(Clone, Debug)]
pub struct ListLaunch {
    /// Element type of the inputs.
    pub dtype: DType,
    /// Element type of the outputs.
    pub out_dtype: DType,
    /// `(m, n, k)` of each group.
    pub dims: Vec<(i64, i64, i64)>,
    /// `As[i]`, `[m, k]`.
    pub a: Vec<Operand>,
    /// `Bs[i]`, `[k, n]`.
    pub b: Vec<Operand>,
    /// Outputs `[m, n]`, contiguous row-major.
    pub c: Vec<Operand>,
    /// `cudaStream_t` to run on.
    pub stream: u64,
    /// CUDA device index.
    pub device: i32,
    /// float32 only: allow TF32 tensor cores.
    pub allow_tf32: bool,
}

/// What the CUDA part of this build holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaBuildInfo {
    /// `GROUPMM_CUDA_ARCHS` entries compiled, e.g. `["80", "90a"]`.
    pub archs: Vec<String>,
    /// CUDA toolkit release the runtime (linked statically) comes from, e.g. `"13.0"`.
    pub cuda_runtime: String,
    /// CUTLASS version of the headers, e.g. `"4.2.0"`.
    pub cutlass: String,
}

/// True when this build holds the CUDA kernels.
pub fn compiled() -> bool {
    cfg!(groupmm_cuda)
}

#[cfg(not(groupmm_cuda))]
mod imp {
    use super::*;

    fn no_cuda() -> Error {
        Error::Cuda(
            "groupmm was built without CUDA support: rebuild with nvcc on PATH (or GROUPMM_CUDA=1) \
             and CUTLASS headers (pip install nvidia-cutlass==4.2.0.0 or CUTLASS_DIR)"
                .into(),
        )
    }

    pub fn packed_workspace_bytes(_l: &PackedLaunch) -> Result<usize> {
        Err(no_cuda())
    }
    pub fn launch_packed(
        _l: &PackedLaunch,
        _workspace: u64,
        _workspace_bytes: usize,
    ) -> Result<()> {
        Err(no_cuda())
    }
    pub fn list_host_args_bytes(_l: &ListLaunch) -> Result<usize> {
        Err(no_cuda())
    }
    pub fn write_list_args(_l: &ListLaunch, _host: &mut [u8], _device_addr: u64) -> Result<()> {
        Err(no_cuda())
    }
    pub fn list_workspace_bytes(_l: &ListLaunch) -> Result<usize> {
        Err(no_cuda())
    }
    pub fn launch_list(
        _l: &ListLaunch,
        _device_args: u64,
        _workspace: u64,
        _workspace_bytes: usize,
    ) -> Result<()> {
        Err(no_cuda())
    }
    pub fn take_offs_error(_device: i32) -> Result<bool> {
        Err(no_cuda())
    }
    pub fn stream_capturing(_stream: u64) -> Result<bool> {
        Err(no_cuda())
    }
    pub fn build_info() -> Option<CudaBuildInfo> {
        None
    }
}

#[cfg(groupmm_cuda)]
#[cxx::bridge(namespace = "groupmm")]
mod ffi {
    /// `gmm_operand` of cuda/launch.h.
    #[derive(Clone, Copy, Debug)]
    struct FfiOperand {
        ptr: u64,
        batch: i64,
        rows: i64,
        cols: i64,
        batch_stride: i64,
        row_stride: i64,
        col_stride: i64,
    }

    /// `gmm_packed` of cuda/launch.h.
    #[derive(Clone, Copy, Debug)]
    struct FfiPacked {
        form: i32,
        dtype: i32,
        out_dtype: i32,
        device: i32,
        groups: i64,
        m: i64,
        n: i64,
        k: i64,
        a: FfiOperand,
        b: FfiOperand,
        c: FfiOperand,
        offs: u64,
        stream: u64,
        allow_tf32: bool,
    }

    /// The scalar part of `gmm_list`; the per-group arrays travel as slices.
    #[derive(Clone, Copy, Debug)]
    struct FfiList {
        dtype: i32,
        out_dtype: i32,
        device: i32,
        allow_tf32: bool,
        stream: u64,
    }

    unsafe extern "C++" {
        include!("bridge.h");

        /// Host only; never touches device memory.
        fn packed_workspace_bytes(p: &FfiPacked) -> Result<usize>;
        /// Launches on `p.stream`; reads and writes the device memory `p` points at.
        unsafe fn launch_packed(
            p: &FfiPacked,
            workspace: u64,
            workspace_bytes: usize,
        ) -> Result<()>;
        /// Host only.
        fn list_args_bytes(
            l: &FfiList,
            dims: &[i64],
            a: &[FfiOperand],
            b: &[FfiOperand],
            c: &[FfiOperand],
        ) -> Result<usize>;
        /// Host only: fills `host`.
        fn write_list_args(
            l: &FfiList,
            dims: &[i64],
            a: &[FfiOperand],
            b: &[FfiOperand],
            c: &[FfiOperand],
            host: &mut [u8],
            device_addr: u64,
        ) -> Result<()>;
        /// Host only.
        fn list_workspace_bytes(
            l: &FfiList,
            dims: &[i64],
            a: &[FfiOperand],
            b: &[FfiOperand],
            c: &[FfiOperand],
        ) -> Result<usize>;
        /// Launches on `l.stream`; reads and writes device memory.
        #[allow(clippy::too_many_arguments)]
        unsafe fn launch_list(
            l: &FfiList,
            dims: &[i64],
            a: &[FfiOperand],
            b: &[FfiOperand],
            c: &[FfiOperand],
            device_args: u64,
            workspace: u64,
            workspace_bytes: usize,
        ) -> Result<()>;
        /// Reads and clears the host-mapped flag; no sync.
        fn take_offs_error(device: i32) -> Result<bool>;
        /// cudaStreamIsCapturing; host only.
        fn stream_capturing(stream: u64) -> Result<bool>;
        fn cutlass_version() -> String;
    }
}

#[cfg(groupmm_cuda)]
mod imp {
    use super::ffi::{FfiList, FfiOperand, FfiPacked};
    use super::*;

    fn dtype_code(d: DType) -> i32 {
        match d {
            DType::F16 => 0,
            DType::BF16 => 1,
            DType::F32 => 2,
            DType::F64 => 3,
        }
    }

    fn op(o: &Operand) -> FfiOperand {
        FfiOperand {
            ptr: o.ptr,
            batch: o.batch,
            rows: o.rows,
            cols: o.cols,
            batch_stride: o.batch_stride,
            row_stride: o.row_stride,
            col_stride: o.col_stride,
        }
    }

    fn err(e: cxx::Exception) -> Error {
        Error::Cuda(e.what().to_string())
    }

    fn packed(l: &PackedLaunch) -> FfiPacked {
        FfiPacked {
            form: l.form.code(),
            dtype: dtype_code(l.dtype),
            out_dtype: dtype_code(l.out_dtype),
            device: l.device,
            groups: l.groups,
            m: l.m,
            n: l.n,
            k: l.k,
            a: op(&l.a),
            b: op(&l.b),
            c: op(&l.c),
            offs: l.offs,
            stream: l.stream,
            allow_tf32: l.allow_tf32,
        }
    }

    struct ListArgs {
        head: FfiList,
        dims: Vec<i64>,
        a: Vec<FfiOperand>,
        b: Vec<FfiOperand>,
        c: Vec<FfiOperand>,
    }

    fn list(l: &ListLaunch) -> Result<ListArgs> {
        let g = l.dims.len();
        if l.a.len() != g || l.b.len() != g || l.c.len() != g {
            return Err(Error::Cuda(format!(
                "groupmm CUDA (list form): {} groups in dims but {} As, {} Bs and {} outputs",
                g,
                l.a.len(),
                l.b.len(),
                l.c.len()
            )));
        }
        Ok(ListArgs {
            head: FfiList {
                dtype: dtype_code(l.dtype),
                out_dtype: dtype_code(l.out_dtype),
                device: l.device,
                allow_tf32: l.allow_tf32,
                stream: l.stream,
            },
            dims: l.dims.iter().flat_map(|&(m, n, k)| [m, n, k]).collect(),
            a: l.a.iter().map(op).collect(),
            b: l.b.iter().map(op).collect(),
            c: l.c.iter().map(op).collect(),
        })
    }

    pub fn packed_workspace_bytes(l: &PackedLaunch) -> Result<usize> {
        ffi::packed_workspace_bytes(&packed(l)).map_err(err)
    }

    pub fn launch_packed(l: &PackedLaunch, workspace: u64, workspace_bytes: usize) -> Result<()> {
        let p = packed(l);
        // SAFETY: the C++ side validates extents, strides, null pointers, dtypes and the
        // workspace size before launching; the caller guarantees that the pointers in `l`
        // are live device allocations of the described extents on `l.device`, used on
        // `l.stream`, and that `workspace` holds `workspace_bytes` bytes there.
        unsafe { ffi::launch_packed(&p, workspace, workspace_bytes) }.map_err(err)
    }

    pub fn list_host_args_bytes(l: &ListLaunch) -> Result<usize> {
        let x = list(l)?;
        ffi::list_args_bytes(&x.head, &x.dims, &x.a, &x.b, &x.c).map_err(err)
    }

    pub fn write_list_args(l: &ListLaunch, host: &mut [u8], device_addr: u64) -> Result<()> {
        let x = list(l)?;
        ffi::write_list_args(&x.head, &x.dims, &x.a, &x.b, &x.c, host, device_addr).map_err(err)
    }

    pub fn list_workspace_bytes(l: &ListLaunch) -> Result<usize> {
        let x = list(l)?;
        ffi::list_workspace_bytes(&x.head, &x.dims, &x.a, &x.b, &x.c).map_err(err)
    }

    pub fn launch_list(
        l: &ListLaunch,
        device_args: u64,
        workspace: u64,
        workspace_bytes: usize,
    ) -> Result<()> {
        let x = list(l)?;
        // SAFETY: as for launch_packed; in addition the caller copied the block written by
        // write_list_args for this same launch to `device_args` on `l.stream`.
        unsafe {
            ffi::launch_list(
                &x.head,
                &x.dims,
                &x.a,
                &x.b,
                &x.c,
                device_args,
                workspace,
                workspace_bytes,
            )
        }
        .map_err(err)
    }

    pub fn take_offs_error(device: i32) -> Result<bool> {
        ffi::take_offs_error(device).map_err(err)
    }

    pub fn stream_capturing(stream: u64) -> Result<bool> {
        ffi::stream_capturing(stream).map_err(err)
    }

    pub fn build_info() -> Option<CudaBuildInfo> {
        Some(CudaBuildInfo {
            archs: env!("GROUPMM_CUDA_ARCHS")
                .split(';')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
            cuda_runtime: env!("GROUPMM_CUDA_RUNTIME").to_string(),
            cutlass: ffi::cutlass_version(),
        })
    }
}

/// Workspace bytes [`launch_packed`] needs (host only, never syncs).
pub fn packed_workspace_bytes(l: &PackedLaunch) -> Result<usize> {
    imp::packed_workspace_bytes(l)
}

/// Runs a packed product on `l.stream` without synchronising with the host.
/// `workspace` (256-byte aligned device memory of at least
/// [`packed_workspace_bytes`] bytes) must stay allocated until the work completes.
pub fn launch_packed(l: &PackedLaunch, workspace: u64, workspace_bytes: usize) -> Result<()> {
    imp::launch_packed(l, workspace, workspace_bytes)
}

/// Size in bytes of the per-group argument block of a list product.
pub fn list_host_args_bytes(l: &ListLaunch) -> Result<usize> {
    imp::list_host_args_bytes(l)
}

/// Fills the argument block in host memory (16-byte aligned); `device_addr` is where
/// the caller will copy it (256-byte aligned).
pub fn write_list_args(l: &ListLaunch, host: &mut [u8], device_addr: u64) -> Result<()> {
    imp::write_list_args(l, host, device_addr)
}

/// Workspace bytes [`launch_list`] needs.
pub fn list_workspace_bytes(l: &ListLaunch) -> Result<usize> {
    imp::list_workspace_bytes(l)
}

/// Runs a list product on `l.stream`; the argument block was copied to `device_args`
/// (async, same stream) by the caller.
pub fn launch_list(
    l: &ListLaunch,
    device_args: u64,
    workspace: u64,
    workspace_bytes: usize,
) -> Result<()> {
    imp::launch_list(l, device_args, workspace, workspace_bytes)
}

/// Reads and clears the "invalid offs seen" flag of `device` (no sync): true when a
/// packed launch there met negative, decreasing or out-of-range offsets since the last
/// call. Only work that has completed is reflected.
pub fn take_offs_error(device: i32) -> Result<bool> {
    imp::take_offs_error(device)
}

/// True when `stream` (a raw `cudaStream_t`) is capturing a CUDA graph; host only.
pub fn stream_capturing(stream: u64) -> Result<bool> {
    imp::stream_capturing(stream)
}

/// What the CUDA part of this build holds; `None` when built without CUDA.
pub fn build_info() -> Option<CudaBuildInfo> {
    imp::build_info()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn operand(batch: i64, rows: i64, cols: i64) -> Operand {
        Operand {
            ptr: 0,
            batch,
            rows,
            cols,
            batch_stride: if batch > 1 { rows * cols } else { 0 },
            row_stride: cols,
            col_stride: 1,
        }
    }

    #[test]
    fn build_info_matches_compiled() {
        assert_eq!(build_info().is_some(), compiled());
        if let Some(info) = build_info() {
            assert!(!info.archs.is_empty());
            assert!(!info.cuda_runtime.is_empty());
            assert!(info.cutlass.chars().next().unwrap().is_ascii_digit());
        }
    }

    /// Without a GPU (or without CUDA in the build) every call must come back as an
    /// error, never a crash; with a GPU, a null data pointer is an error too.
    #[test]
    fn bad_launches_are_errors() {
        let l = PackedLaunch {
            form: Form::GroupedM,
            dtype: DType::BF16,
            out_dtype: DType::BF16,
            groups: 2,
            m: 8,
            n: 8,
            k: 8,
            a: operand(1, 8, 8),
            b: operand(2, 8, 8),
            c: operand(1, 8, 8),
            offs: 0,
            stream: 0,
            device: 0,
            allow_tf32: false,
        };
        match launch_packed(&l, 0, 0) {
            Err(Error::Cuda(msg)) => assert!(!msg.is_empty()),
            other => panic!("expected Error::Cuda, got {other:?}"),
        }
        let list = ListLaunch {
            dtype: DType::F32,
            out_dtype: DType::F32,
            dims: vec![(2, 2, 2)],
            a: vec![operand(1, 2, 2)],
            b: vec![],
            c: vec![operand(1, 2, 2)],
            stream: 0,
            device: 0,
            allow_tf32: false,
        };
        assert!(matches!(list_host_args_bytes(&list), Err(Error::Cuda(_))));
    }
}
