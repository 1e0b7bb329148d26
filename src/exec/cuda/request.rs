//! The requests the engine sends across the seam ([`ffi`]), made from its descriptions:
//! every operand normalised into the bridge's [`Operand`](ffi::Operand) (the one
//! normaliser: [`operand`]), the enums mapped, and what a packed product does beyond
//! `c = a · b` ([`Fusion`]: the routed-row index and the epilogue, which becomes the
//! bridge's here and nowhere else). Nothing here calls into C++ or borrows from the face.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::exec::ffi;
use crate::exec::vocab::{Device, IntTensor, Tensor};
use crate::shape::{Epilogue, Form, PackedDims, RowPtrs, RowsDims, RowsOp};

pub(super) fn ffi_dtype(d: DType) -> ffi::DType {
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
        RowsOp::TopK => ffi::RowsOp::TopK,
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
pub(in crate::exec) fn operand(t: &Tensor) -> Option<ffi::Operand> {
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

pub(super) fn device_index(t: &Tensor) -> i32 {
    match t.device {
        Device::Cuda(i) => i,
        Device::Cpu => unreachable!("a CUDA launch with a CPU operand"),
    }
}

/// The bridge operand of an input that went through `readable`, or of a target.
fn kernel_operand(t: &Tensor) -> Result<ffi::Operand> {
    operand(t).ok_or_else(|| {
        Error::Cuda(format!(
            "internal: operand {:?} is not readable by the kernels",
            t.layout
        ))
    })
}

/// What a packed product does beyond `c = a · b`, as the engine asks it: the request's
/// [`ffi::Fusion`] (whose doc is the contract of each field). `Default`: a plain product.
#[derive(Debug, Clone, Copy, Default)]
pub(in crate::exec) struct Fusion<'a> {
    /// The contiguous int32 routed-row index: GroupedM `[m]`, A's row `r` is row
    /// `src[r]` of `a`; GroupedK `[k]`, routed row `r` of A (of B with `src_b`) is row
    /// `src[r]` of the row-major tensor that `a` (transposed) or `b` describes.
    pub src: Option<&'a IntTensor>,
    /// GroupedK only: `src` indexes the rows of `b` instead of those of `a`.
    pub src_b: bool,
    /// The epilogue (GroupedM) with its operands, on the product's device and laid out as
    /// its rule says (`crate::shape::EPILOGUES`); `c` is then its first output.
    pub epilogue: Epilogue<&'a Tensor>,
    /// The epilogue's other outputs in its rule's order, contiguous.
    pub outputs: &'a [&'a Tensor],
    /// The call's second request, on rows it gathered after the first was answered
    /// `Unsupported` ([`ffi::PackedRequest`]'s `flag_taken`).
    pub retry: bool,
}

impl Fusion<'_> {
    /// Nothing beyond `c = a · b`.
    pub fn is_plain(&self) -> bool {
        self.src.is_none() && self.epilogue.is_plain()
    }

    /// The bridge's field: the epilogue's name and its operands by position (its inputs
    /// in its rule's order, then its other outputs), 0 for what is not asked. The one
    /// place where the epilogue becomes the bridge's.
    fn request(&self) -> Result<ffi::Fusion<'static>> {
        let ptr = |t: &Tensor| t.ptr as u64;
        let listed = self.epilogue.rule.map_or(0, |e| e.operands.len());
        let inputs = self.epilogue.operands.iter().take(listed);
        let addrs = inputs
            .map(|o| o.map_or(0, ptr))
            .chain(self.outputs.iter().map(|t| ptr(t)));
        let mut operands = [0; 6];
        for (n, a) in addrs.enumerate() {
            *operands.get_mut(n).ok_or_else(|| {
                Error::Cuda("internal: an epilogue with more than 6 operands".into())
            })? = a;
        }
        Ok(ffi::Fusion {
            src: self.src.map_or(0, |o| o.ptr as u64),
            src_b: self.src_b,
            epilogue: self.epilogue.rule.map_or("", |e| e.name),
            operands,
        })
    }
}

/// The request of a packed product whose inputs went through `readable` and whose
/// target `c` is contiguous row-major, with what `fusion` asks beyond `c = a · b`.
pub(super) fn packed_request(
    plan: &PackedDims,
    a: &Tensor,
    b: &Tensor,
    offs: Option<&IntTensor>,
    fusion: &Fusion<'_>,
    c: &Tensor,
    (stream, allow_tf32): (u64, bool),
) -> Result<ffi::PackedRequest<'static>> {
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
        fusion: fusion.request()?,
        flag_taken: fusion.retry,
        stream,
    })
}

/// The request of a list product whose inputs went through `readable` and whose targets
/// are contiguous row-major: group `i` reads `a[i]`, `b[i]` and writes `c[i]`.
pub(super) fn list_request(
    a: &[Tensor],
    b: &[Tensor],
    c: &[&Tensor],
    device: i32,
    (stream, allow_tf32): (u64, bool),
) -> Result<(ffi::ListRequest, Vec<ffi::ListGroup>)> {
    let req = ffi::ListRequest {
        dtype: ffi_dtype(a[0].dtype),
        out_dtype: ffi_dtype(c[0].dtype),
        device,
        allow_tf32,
        stream,
    };
    let groups = a
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
    Ok((req, groups))
}

/// The request of a validated row op whose operands `p` are contiguous on `device`;
/// `scratch` is ScatterRows' zeroed int32 `[rows]` device memory (else 0).
pub(super) fn rows_request(
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

#[cfg(test)]
mod tests;
