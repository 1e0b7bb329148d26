//! The engine's CUDA side: operands normalised once, in Rust, into the bridge's
//! [`Operand`](ffi::Operand); one call into C++ per packed launch in the steady state.
//!
//! A packed product makes at most two calls across the seam: [`ffi::submit_packed`]
//! reads the deferred offs flag, plans once and launches at once when the workspace the
//! face keeps for the stream is large enough and the stream is not capturing; otherwise
//! it hands the plan back and [`ffi::launch_planned`] launches it with the workspace the
//! face then provides. A list product plans once ([`ffi::plan_list`]), writes its
//! per-group argument block into host memory the face uploads, and launches.
//!
//! Nothing here waits for the GPU. A build without CUDA keeps this module; every launch
//! fails with a message that says how to rebuild.

#![cfg_attr(not(feature = "python"), allow(dead_code))]

use super::ffi;
use super::vocab::{Device, IntTensor, Runtime, Tensor};
use crate::cpu::rows::RowPtrs;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shape::{Form, PackedDims, RowsDims, RowsOp};

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
        })
    }
    #[cfg(not(groupmm_cuda))]
    None
}

/// Reads and clears the "invalid offs seen" flag of `device` (no sync): true when a
/// packed launch there met negative, decreasing or out-of-range offsets since the last
/// call. Only work that has completed is reflected.
pub fn take_offs_error(device: i32) -> Result<bool> {
    check_compiled()?;
    #[cfg(groupmm_cuda)]
    {
        ffi::take_offs_error(device).map_err(seam)
    }
    #[cfg(not(groupmm_cuda))]
    {
        let _ = device;
        unreachable!("checked above")
    }
}

#[cfg(groupmm_cuda)]
fn seam(e: cxx::Exception) -> Error {
    Error::Cuda(e.what().to_string())
}

fn ffi_dtype(d: DType) -> ffi::DType {
    match d {
        DType::F16 => ffi::DType::F16,
        DType::BF16 => ffi::DType::BF16,
        DType::F32 => ffi::DType::F32,
        DType::F64 => ffi::DType::F64,
    }
}

fn ffi_form(f: Form) -> ffi::Form {
    match f {
        Form::GroupedM => ffi::Form::GroupedM,
        Form::GroupedK => ffi::Form::GroupedK,
        Form::GroupedN => ffi::Form::GroupedN,
        Form::Batched => ffi::Form::Batched,
    }
}

fn ffi_rows_op(op: RowsOp) -> ffi::RowsOp {
    match op {
        RowsOp::Swiglu => ffi::RowsOp::Swiglu,
        RowsOp::SwigluBackward => ffi::RowsOp::SwigluBackward,
        RowsOp::GatherSum => ffi::RowsOp::GatherSum,
        RowsOp::ScatterRows => ffi::RowsOp::ScatterRows,
        RowsOp::RowDots => ffi::RowsOp::RowDots,
    }
}

/// A leading dimension that never addresses anything (its dimension has extent <= 1):
/// at least the contiguous extent, rounded so that it never spoils the alignment.
fn unused_ld(extent: i64) -> i64 {
    (extent.max(1) + 7) / 8 * 8
}

/// How the kernels read `t` in place, or `None` when they cannot and it must be copied:
/// its last two dimensions need a unit stride in one of them and a leading stride of at
/// least the other extent (strides of extent-1 dimensions do not matter), and several
/// groups need a positive batch stride (not an expanded batch). Negative strides fail
/// these rules. An operand without elements is always readable.
pub(super) fn operand(t: &Tensor) -> Option<ffi::Operand> {
    let l = &t.layout;
    let nd = l.ndim();
    let (rows, cols) = (l.shape[nd - 2] as i64, l.shape[nd - 1] as i64);
    let (rs, cs) = (l.strides[nd - 2] as i64, l.strides[nd - 1] as i64);
    let (batch, bs) = if nd == 3 {
        (l.shape[0] as i64, l.strides[0] as i64)
    } else {
        (1, 0)
    };
    let op = |batch_stride: i64, ld: i64, col_major: bool| ffi::Operand {
        ptr: t.ptr as u64,
        batch,
        rows,
        cols,
        batch_stride,
        ld,
        col_major,
    };
    if batch == 0 || rows == 0 || cols == 0 {
        return Some(op(0, unused_ld(cols), false));
    }
    let bs = match batch {
        1 => 0,
        _ if bs > 0 => bs,
        _ => return None, // expanded (0) or negative batch stride
    };
    if (cs == 1 || cols == 1) && (rows == 1 || rs >= cols) {
        let ld = if rows == 1 { unused_ld(cols) } else { rs };
        return Some(op(bs, ld, false));
    }
    if (rs == 1 || rows == 1) && (cols == 1 || cs >= rows) {
        let ld = if cols == 1 { unused_ld(rows) } else { cs };
        return Some(op(bs, ld, true));
    }
    None
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
        _ => super::operands::contiguous(rt, t),
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

fn device_index(t: &Tensor) -> i32 {
    match t.device {
        Device::Cuda(i) => i,
        Device::Cpu => unreachable!("a CUDA launch with a CPU operand"),
    }
}

/// The bridge operand of an input that went through [`readable`], or of a target.
fn kernel_operand(t: &Tensor) -> Result<ffi::Operand> {
    operand(t).ok_or_else(|| {
        Error::Cuda(format!(
            "internal: operand {:?} is not readable by the kernels",
            t.layout
        ))
    })
}

/// The stream and TF32 flag of a launch on `device` with inputs of `dtype`.
fn stream_and_tf32<R: Runtime>(rt: &mut R, device: i32, dtype: DType) -> Result<(u64, bool)> {
    let stream = rt.stream(device)?;
    let tf32 = dtype == DType::F32 && rt.allow_tf32()?;
    Ok((stream, tf32))
}

/// What a packed product does beyond `c = a · b`, as the engine asks it: the request's
/// [`ffi::Fusion`] (whose doc is the contract of each field). `Default`: a plain product.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Fusion<'a> {
    /// The contiguous int32 routed-row index: GroupedM `[m]`, A's row `r` is row
    /// `src[r]` of `a`; GroupedK `[k]`, routed row `r` of A (of B with `src_b`) is row
    /// `src[r]` of the row-major tensor that `a` (transposed) or `b` describes.
    pub src: Option<&'a IntTensor>,
    /// GroupedK only: `src` indexes the rows of `b` instead of those of `a`.
    pub src_b: bool,
    /// What the epilogue writes, with its contiguous operands.
    pub epilogue: Epilogue<'a>,
}

/// The epilogue of a GroupedM product and its operands (contiguous, on the product's
/// device; extents in [`ffi::Fusion`]'s doc). `c` is the pre-activation (SwiGLU) or its
/// gradient `dpre` (DGated), `[m, 2F]` both.
#[derive(Debug, Clone, Copy, Default)]
pub(super) enum Epilogue<'a> {
    /// `c = p`.
    #[default]
    Plain,
    /// `c = p`, `act = silu(gate) * up`.
    SwiGLU {
        /// `[m, F]`, c's dtype.
        act: &'a Tensor,
    },
    /// dSwiGLU through the router weight: `c = dpre`, `act`, `partial`.
    DGated {
        /// `[m, F]`, c's dtype: the scaled activation.
        act: &'a Tensor,
        /// `[m, 2F]`, c's dtype: the saved pre-activation.
        pre: &'a Tensor,
        /// float32 `[m]`: the router weight of each row.
        scale: &'a Tensor,
        /// float32 `[ceil(F / 64), m]`: the router-weight gradient's partial sums.
        partial: &'a Tensor,
    },
}

impl Fusion<'_> {
    /// The bridge's field: addresses, 0 for what is not asked.
    fn request(&self) -> ffi::Fusion {
        let ptr = |t: &Tensor| t.ptr as u64;
        let (epilogue, act, pre, scale, partial) = match self.epilogue {
            Epilogue::Plain => (ffi::Epilogue::Plain, 0, 0, 0, 0),
            Epilogue::SwiGLU { act } => (ffi::Epilogue::SwiGLU, ptr(act), 0, 0, 0),
            Epilogue::DGated {
                act,
                pre,
                scale,
                partial,
            } => (
                ffi::Epilogue::DGated,
                ptr(act),
                ptr(pre),
                ptr(scale),
                ptr(partial),
            ),
        };
        ffi::Fusion {
            src: self.src.map_or(0, |o| o.ptr as u64),
            src_b: self.src_b,
            epilogue,
            act,
            pre,
            scale,
            partial,
        }
    }
}

/// The request of a packed product whose inputs went through [`readable`] and whose
/// target `c` is contiguous row-major, with what `fusion` asks beyond `c = a · b`.
fn packed_request(
    plan: &PackedDims,
    a: &Tensor,
    b: &Tensor,
    offs: Option<&IntTensor>,
    fusion: &Fusion<'_>,
    c: &Tensor,
    (stream, allow_tf32): (u64, bool),
) -> Result<ffi::PackedRequest> {
    Ok(ffi::PackedRequest {
        form: ffi_form(plan.form),
        dtype: ffi_dtype(a.dtype),
        out_dtype: ffi_dtype(c.dtype),
        device: device_index(a),
        allow_tf32,
        groups: plan.groups as i64,
        m: plan.m as i64,
        n: plan.n as i64,
        k: plan.k as i64,
        a: kernel_operand(a)?,
        b: kernel_operand(b)?,
        c: kernel_operand(c)?,
        offs: offs.map_or(0, |o| o.ptr as u64),
        fusion: fusion.request(),
        stream,
    })
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
    let (stream, allow_tf32) = stream_and_tf32(rt, device, first.dtype)?;
    let req = ffi::ListRequest {
        dtype: ffi_dtype(first.dtype),
        out_dtype: ffi_dtype(c[0].dtype),
        device,
        allow_tf32,
        stream,
    };
    let groups: Vec<ffi::ListGroup> = a
        .iter()
        .zip(b)
        .zip(c)
        .map(|((a, b), c)| {
            Ok(ffi::ListGroup {
                a: kernel_operand(a)?,
                b: kernel_operand(b)?,
                c: kernel_operand(c)?,
            })
        })
        .collect::<Result<_>>()?;
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

/// The request of a validated row op whose operands `p` are contiguous on `device`;
/// `scratch` is ScatterRows' zeroed int32 `[rows]` device memory (else 0).
fn rows_request(
    d: &RowsDims,
    dtype: DType,
    w_dtype: DType,
    device: i32,
    p: RowPtrs,
    scratch: u64,
    stream: u64,
) -> ffi::RowsRequest {
    ffi::RowsRequest {
        op: ffi_rows_op(d.op),
        dtype: ffi_dtype(dtype),
        w_dtype: ffi_dtype(w_dtype),
        device,
        tokens: d.tokens as i64,
        top_k: d.top_k as i64,
        rows: d.rows as i64,
        cols: d.cols as i64,
        x: p.x as u64,
        y: p.y as u64,
        inverse: p.inverse as u64,
        weights: p.weights as u64,
        out: p.out as u64,
        scratch,
        stream,
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

    use crate::layout::Layout;

    fn t(shape: &[usize], strides: &[isize]) -> Tensor {
        Tensor {
            ptr: 4096,
            dtype: DType::BF16,
            layout: Layout::new(shape, strides),
            device: Device::Cuda(0),
            id: 0,
            transposed: false,
        }
    }

    /// A contiguous int32 device index of `len` entries at `ptr` (`offs`, `src`).
    fn at(ptr: usize, len: usize) -> IntTensor {
        IntTensor {
            ptr,
            layout: Layout::new(&[len], &[1]),
            device: Device::Cuda(0),
            id: 1,
            int32: true,
        }
    }

    fn ld_major(shape: &[usize], strides: &[isize]) -> Option<(i64, bool, i64)> {
        operand(&t(shape, strides)).map(|o| (o.ld, o.col_major, o.batch_stride))
    }

    #[test]
    fn normalisation() {
        // row- and column-major, padded leading dimensions
        assert_eq!(ld_major(&[4, 6], &[6, 1]), Some((6, false, 0)));
        assert_eq!(ld_major(&[4, 6], &[8, 1]), Some((8, false, 0)));
        assert_eq!(ld_major(&[4, 6], &[1, 4]), Some((4, true, 0)));
        assert_eq!(ld_major(&[4, 6], &[1, 5]), Some((5, true, 0)));
        // a transposed 3-D view reads column-major with its batch stride
        assert_eq!(ld_major(&[3, 4, 6], &[24, 1, 4]), Some((4, true, 24)));
        // extent-1 dimensions: their strides do not matter, ld is rounded up
        assert_eq!(ld_major(&[1, 5], &[7, 1]), Some((8, false, 0)));
        assert_eq!(ld_major(&[1, 5], &[99, 3]), Some((3, true, 0)));
        assert_eq!(ld_major(&[5, 1], &[1, 99]), Some((1, false, 0)));
        assert_eq!(ld_major(&[1, 1], &[0, 0]), Some((8, false, 0)));
        // a batch of one ignores its batch stride
        assert_eq!(ld_major(&[1, 4, 6], &[-5, 6, 1]), Some((6, false, 0)));
        // no elements: always readable, row-major
        assert_eq!(ld_major(&[0, 6], &[-3, 7]), Some((8, false, 0)));
        assert_eq!(ld_major(&[3, 0, 6], &[0, 6, 1]), Some((8, false, 0)));
        // copies: no unit stride, overlapping rows, negative strides, expanded batch
        assert_eq!(ld_major(&[4, 6], &[12, 2]), None);
        assert_eq!(ld_major(&[4, 6], &[3, 1]), None);
        assert_eq!(ld_major(&[4, 6], &[-6, 1]), None);
        assert_eq!(ld_major(&[4, 6], &[6, -1]), None);
        assert_eq!(ld_major(&[3, 4, 6], &[0, 6, 1]), None);
        assert_eq!(ld_major(&[3, 4, 6], &[-24, 6, 1]), None);
    }

    #[test]
    fn readability_is_invariant_under_transposition() {
        for (shape, strides) in [
            (vec![4usize, 6], vec![6isize, 1]),
            (vec![4, 6], vec![12, 2]),
            (vec![1, 5], vec![7, 1]),
            (vec![3, 4, 6], vec![0, 6, 1]),
            (vec![3, 4, 6], vec![24, 1, 4]),
        ] {
            let x = t(&shape, &strides);
            let xt = crate::layout::Transposable::transposed(&x);
            assert_eq!(
                operand(&x).is_some(),
                operand(&xt).is_some(),
                "{shape:?} {strides:?}"
            );
            if let (Some(o), Some(ot)) = (operand(&x), operand(&xt)) {
                if o.rows > 1 && o.cols > 1 {
                    assert_eq!((o.ld, o.col_major), (ot.ld, !ot.col_major));
                }
            }
        }
    }

    /// The request of dB = xᵀ·dy (the backward of x [T, K] · w [G, K, N]): a GroupedK
    /// product whose `a` is the transposed view of row-major `x`, read column-major in
    /// place.
    #[test]
    fn backward_request_reads_transposed_views_in_place() {
        let (t_, k, n, g) = (64usize, 32usize, 48usize, 4usize);
        let x = t(&[t_, k], &[k as isize, 1]);
        let dy = t(&[t_, n], &[n as isize, 1]);
        let xt = crate::layout::Transposable::transposed(&x);
        let plan = crate::shape::plan_packed(&xt.layout, &dy.layout, Some(g)).unwrap();
        let c = t(&plan.out_shape, &[(k * n) as isize, n as isize, 1]);
        let offs = IntTensor {
            ptr: 8192,
            layout: Layout::new(&[g], &[1]),
            device: Device::Cuda(0),
            id: 1,
            int32: true,
        };
        let plain = Fusion::default();
        let r = packed_request(&plan, &xt, &dy, Some(&offs), &plain, &c, (77, false)).unwrap();
        assert_eq!(r.form, ffi::Form::GroupedK);
        assert_eq!(r.fusion.src, 0, "no gathered rows unless asked for");
        assert!(!r.fusion.src_b);
        assert_eq!(r.fusion.epilogue, ffi::Epilogue::Plain);
        let f = r.fusion;
        assert_eq!((f.act, f.pre, f.scale, f.partial), (0, 0, 0, 0));
        assert_eq!((r.groups, r.m, r.n, r.k), (4, 32, 48, 64));
        assert_eq!(
            (r.a.rows, r.a.cols, r.a.ld, r.a.col_major),
            (32, 64, 32, true)
        );
        assert_eq!((r.b.ld, r.b.col_major), (48, false));
        assert_eq!((r.c.batch, r.c.batch_stride, r.c.ld), (4, 32 * 48, 48));
        assert_eq!((r.offs, r.stream, r.device), (8192, 77, 0));
    }

    #[test]
    fn gathered_request_carries_the_index_and_the_rows_of_x() {
        let (rows_x, rows, k, n, g) = (10usize, 24usize, 16usize, 8usize, 3usize);
        let x = t(&[rows_x, k], &[k as isize, 1]);
        let w = t(&[g, k, n], &[(k * n) as isize, n as isize, 1]);
        let gathered = Layout::contiguous(&[rows, k]);
        let plan = crate::shape::plan_packed(&gathered, &w.layout, Some(g)).unwrap();
        let c = t(&plan.out_shape, &[n as isize, 1]);
        let (offs, index) = (at(8192, g), at(4096, rows));
        let gather = Fusion {
            src: Some(&index),
            ..Fusion::default()
        };
        let r = packed_request(&plan, &x, &w, Some(&offs), &gather, &c, (77, false)).unwrap();
        assert_eq!(r.form, ffi::Form::GroupedM);
        assert_eq!(
            (r.m, r.n, r.k, r.a.rows, r.fusion.src),
            (24, 8, 16, 10, 4096)
        );
        assert_eq!(r.fusion.epilogue, ffi::Epilogue::Plain);
    }

    /// `gather_k_mm`'s request: a GroupedK product over the `R` routed rows whose `a` is
    /// the transposed view of the row-major source rows (`cols`: the source rows, not
    /// `k`), `src` and, gathered B, `src_b`, with `b` the row-major source rows of B.
    #[test]
    fn gathered_k_request_reads_the_source_rows() {
        let (rows_x, rows, k, n, g) = (10usize, 24usize, 16usize, 8usize, 3usize);
        let row_major = |r: usize, c: usize| t(&[r, c], &[c as isize, 1]);
        let (offs, index) = (at(8192, g), at(4096, rows));
        for src_b in [false, true] {
            let (a, b) = match src_b {
                false => (row_major(rows_x, k), row_major(rows, n)),
                true => (row_major(rows, k), row_major(rows_x, n)),
            };
            let plan =
                crate::shape::plan_gather_k(&a.layout, &b.layout, &index.layout, g, src_b, false)
                    .unwrap();
            let c = t(&plan.out_shape, &[(k * n) as isize, n as isize, 1]);
            let gather = Fusion {
                src: Some(&index),
                src_b,
                ..Fusion::default()
            };
            let at = crate::layout::Transposable::transposed(&a);
            let r = packed_request(&plan, &at, &b, Some(&offs), &gather, &c, (77, false)).unwrap();
            assert_eq!(r.form, ffi::Form::GroupedK);
            assert_eq!((r.groups, r.m, r.n, r.k), (3, 16, 8, 24));
            assert_eq!((r.fusion.src, r.fusion.src_b), (4096, src_b));
            assert_eq!(r.fusion.epilogue, ffi::Epilogue::Plain);
            let a_rows = if src_b { rows } else { rows_x };
            assert_eq!(
                (r.a.rows, r.a.cols, r.a.ld, r.a.col_major),
                (16, a_rows as i64, 16, true)
            );
            let b_rows = if src_b { rows_x } else { rows };
            assert_eq!(
                (r.b.rows, r.b.cols, r.b.ld, r.b.col_major),
                (b_rows as i64, 8, 8, false)
            );
            assert_eq!((r.c.batch, r.c.rows, r.c.cols), (3, 16, 8));
        }
    }

    /// `swiglu_mm`'s request: the gathered product into `pre` `[R, 2F]` with the SwiGLU
    /// epilogue writing `act`; nothing of DGated's.
    #[test]
    fn swiglu_request_carries_the_activation() {
        let (rows_x, rows, k, f, g) = (10usize, 24usize, 16usize, 8usize, 3usize);
        let x = t(&[rows_x, k], &[k as isize, 1]);
        // w [G, K, 2F] column-major in its last two dims (an [E, 2F, K] weight's view)
        let w = t(&[g, k, 2 * f], &[(k * 2 * f) as isize, 1, k as isize]);
        let index = IntTensor {
            ptr: 4096,
            layout: Layout::new(&[rows], &[1]),
            device: Device::Cuda(0),
            id: 1,
            int32: true,
        };
        let offs = IntTensor {
            ptr: 8192,
            ..index.clone()
        };
        let d = crate::shape::plan_swiglu_mm(&x.layout, &w.layout, Some(&index.layout), g).unwrap();
        let [pre, act] = [0, 1].map(|i| Tensor {
            ptr: 1 << (20 + i),
            layout: Layout::contiguous(&d.out_shapes()[i]),
            ..x.clone()
        });
        let fusion = Fusion {
            src: Some(&index),
            src_b: false,
            epilogue: Epilogue::SwiGLU { act: &act },
        };
        let r =
            packed_request(&d.product, &x, &w, Some(&offs), &fusion, &pre, (77, false)).unwrap();
        assert_eq!(r.form, ffi::Form::GroupedM);
        assert_eq!((r.m, r.n, r.k, r.a.rows), (24, 16, 16, 10));
        assert_eq!((r.b.ld, r.b.col_major), (16, true));
        assert_eq!((r.c.ptr, r.c.rows, r.c.cols, r.c.ld), (1 << 20, 24, 16, 16));
        let fu = r.fusion;
        assert_eq!(
            (fu.epilogue, fu.src, fu.act),
            (ffi::Epilogue::SwiGLU, 4096, 1 << 21)
        );
        assert_eq!((fu.pre, fu.scale, fu.partial), (0, 0, 0));
    }

    /// `dgated_mm`'s request: `p = dy · w[g]ᵀ` (n = F, the down projection's weight read
    /// transposed in place) into `dpre` `[R, 2F]`, with every DGated operand.
    #[test]
    fn dgated_request_carries_every_operand() {
        let (rows, d_model, f, g) = (24usize, 32usize, 72usize, 3usize);
        let dy = t(&[rows, d_model], &[d_model as isize, 1]);
        let w = t(
            &[g, f, d_model],
            &[(f * d_model) as isize, d_model as isize, 1],
        );
        let offs = IntTensor {
            ptr: 8192,
            layout: Layout::new(&[g], &[1]),
            device: Device::Cuda(0),
            id: 1,
            int32: true,
        };
        let tensor = |ptr, shape: &[usize], dtype| Tensor {
            ptr,
            dtype,
            layout: Layout::contiguous(shape),
            ..dy.clone()
        };
        let pre = tensor(1 << 20, &[rows, 2 * f], DType::BF16);
        let scale = tensor(1 << 21, &[rows], DType::F32);
        let d = crate::shape::plan_dgated_mm(
            &dy.layout,
            &w.layout,
            &pre.layout,
            &scale.layout,
            None,
            g,
        )
        .unwrap();
        let shapes = d.out_shapes();
        assert_eq!(shapes[2], [2, rows], "ceil(72 / 64) chunks");
        let dpre = tensor(1 << 22, &shapes[0], DType::BF16);
        let act = tensor(1 << 23, &shapes[1], DType::BF16);
        let partial = tensor(1 << 24, &shapes[2], DType::F32);
        let fusion = Fusion {
            src: None,
            src_b: false,
            epilogue: Epilogue::DGated {
                act: &act,
                pre: &pre,
                scale: &scale,
                partial: &partial,
            },
        };
        let wt = crate::layout::Transposable::transposed(&w);
        let r = packed_request(
            &d.product,
            &dy,
            &wt,
            Some(&offs),
            &fusion,
            &dpre,
            (77, false),
        )
        .unwrap();
        assert_eq!(r.form, ffi::Form::GroupedM);
        assert_eq!((r.groups, r.m, r.n, r.k), (3, 24, 72, 32));
        assert_eq!(
            (r.b.batch, r.b.rows, r.b.cols, r.b.ld, r.b.col_major),
            (3, 32, 72, 32, true)
        );
        assert_eq!(
            (r.c.ptr, r.c.rows, r.c.cols, r.c.ld),
            (1 << 22, 24, 144, 144)
        );
        assert_eq!((r.dtype, r.out_dtype), (ffi::DType::BF16, ffi::DType::BF16));
        let fu = r.fusion;
        assert_eq!((fu.epilogue, fu.src), (ffi::Epilogue::DGated, 0));
        assert_eq!(
            (fu.act, fu.pre, fu.scale, fu.partial),
            (1 << 23, 1 << 20, 1 << 21, 1 << 24)
        );
    }

    #[test]
    fn row_request_carries_the_op_and_the_extents() {
        let d = crate::shape::plan_gather_sum(
            &Layout::contiguous(&[7, 16]),
            &Layout::contiguous(&[3, 2]),
            Some(&Layout::contiguous(&[3, 2])),
        )
        .unwrap();
        let p = RowPtrs {
            x: 4096,
            y: 0,
            inverse: 8192,
            weights: 12288,
            out: 16384,
        };
        let r = rows_request(&d, DType::BF16, DType::F32, 1, p, 0, 77);
        assert_eq!(r.op, ffi::RowsOp::GatherSum);
        assert_eq!((r.dtype, r.w_dtype), (ffi::DType::BF16, ffi::DType::F32));
        assert_eq!((r.tokens, r.top_k, r.rows, r.cols), (3, 2, 7, 16));
        assert_eq!(
            (r.x, r.y, r.inverse, r.weights, r.out),
            (4096, 0, 8192, 12288, 16384)
        );
        assert_eq!((r.device, r.scratch, r.stream), (1, 0, 77));
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

    /// Without a GPU (or without CUDA in the build) a CUDA call comes back as an error,
    /// never a crash.
    #[test]
    fn no_gpu_is_an_error() {
        match take_offs_error(0) {
            Err(Error::Cuda(msg)) => assert!(!msg.is_empty()),
            Ok(_) => {} // a machine with a GPU
            other => panic!("expected Error::Cuda, got {other:?}"),
        }
    }
}
