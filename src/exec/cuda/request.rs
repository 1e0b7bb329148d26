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
    /// The epilogue (GroupedM) with its operands, contiguous on the product's device
    /// (extents in [`ffi::Fusion`]'s doc); `c` is then the pre-activation (SwiGLU) or its
    /// gradient `dpre` (DGated), `[m, 2F]` both.
    pub epilogue: Epilogue<&'a Tensor>,
    /// SwiGLU, DGated: the `act` output, `[m, F]` of c's dtype, contiguous (DGated: the
    /// scaled activation).
    pub act: Option<&'a Tensor>,
    /// DGated: the float32 `partial` output, `[ceil(F / 64), m]`, contiguous (the router
    /// weight's gradient in partial sums).
    pub partial: Option<&'a Tensor>,
    /// The call's second request, on rows it gathered after the first was answered
    /// `Unsupported` ([`ffi::PackedRequest`]'s `flag_taken`).
    pub retry: bool,
}

impl Fusion<'_> {
    /// Nothing beyond `c = a · b`.
    pub fn is_plain(&self) -> bool {
        self.src.is_none() && matches!(self.epilogue, Epilogue::Plain)
    }

    /// The bridge's field: addresses, 0 for what is not asked. The one place where the
    /// epilogue becomes the bridge's.
    fn request(&self) -> ffi::Fusion {
        let ptr = |t: Option<&Tensor>| t.map_or(0, |t| t.ptr as u64);
        let (epilogue, pre, scale, up) = match self.epilogue {
            Epilogue::Plain => (ffi::Epilogue::Plain, None, None, None),
            Epilogue::SwiGLU { up } => (ffi::Epilogue::SwiGLU, None, None, up),
            Epilogue::DGated { pre, scale } => {
                (ffi::Epilogue::DGated, Some(pre), Some(scale), None)
            }
            Epilogue::RowScale { scale } => (ffi::Epilogue::RowScale, None, Some(scale), None),
        };
        ffi::Fusion {
            src: self.src.map_or(0, |o| o.ptr as u64),
            src_b: self.src_b,
            epilogue,
            up: ptr(up),
            act: ptr(self.act),
            pre: ptr(pre),
            scale: ptr(scale),
            partial: ptr(self.partial),
        }
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
mod tests {
    use super::*;
    use crate::layout::{Layout, Transposable};
    use crate::shape::{plan_product, Gathered, ProductDims, ProductShape};

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

    /// The rule of a GroupedM product over the rows `src` gathers (or all rows) with
    /// `epilogue`, or of the GroupedK product with gathered `a` (`b`: `src_b`).
    fn plan(
        form: Form,
        (a, b): (&Layout, &Layout),
        src: Option<(&IntTensor, bool)>,
        epilogue: Epilogue<&Layout>,
        offs_len: usize,
    ) -> ProductDims {
        let gathered = |b| if b { Gathered::B } else { Gathered::A };
        plan_product(&ProductShape {
            form,
            a,
            b,
            offs_len,
            src: src.map(|(s, b)| (&s.layout, gathered(b))),
            epilogue,
            transposed: false,
        })
        .unwrap()
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
            let xt = Transposable::transposed(&x);
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
        let xt = Transposable::transposed(&x);
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
    fn gathered_request_carries_src_and_the_rows_of_x() {
        let (rows_x, rows, k, n, g) = (10usize, 24usize, 16usize, 8usize, 3usize);
        let x = t(&[rows_x, k], &[k as isize, 1]);
        let w = t(&[g, k, n], &[(k * n) as isize, n as isize, 1]);
        let gathered = Layout::contiguous(&[rows, k]);
        let plan = crate::shape::plan_packed(&gathered, &w.layout, Some(g)).unwrap();
        let c = t(&plan.out_shape, &[n as isize, 1]);
        let (offs, src) = (at(8192, g), at(4096, rows));
        let gather = Fusion {
            src: Some(&src),
            ..Fusion::default()
        };
        let r = packed_request(&plan, &x, &w, Some(&offs), &gather, &c, (77, false)).unwrap();
        assert_eq!(r.form, ffi::Form::GroupedM);
        assert!(!r.flag_taken);
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
        let (offs, src) = (at(8192, g), at(4096, rows));
        for src_b in [false, true] {
            let (a, b) = match src_b {
                false => (row_major(rows_x, k), row_major(rows, n)),
                true => (row_major(rows, k), row_major(rows_x, n)),
            };
            let ab = (&a.layout, &b.layout);
            let plan = plan(Form::GroupedK, ab, Some((&src, src_b)), Epilogue::Plain, g).product;
            let c = t(&plan.out_shape, &[(k * n) as isize, n as isize, 1]);
            let gather = Fusion {
                src: Some(&src),
                src_b,
                ..Fusion::default()
            };
            let at = Transposable::transposed(&a);
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
        let src = IntTensor {
            ptr: 4096,
            layout: Layout::new(&[rows], &[1]),
            device: Device::Cuda(0),
            id: 1,
            int32: true,
        };
        let offs = IntTensor {
            ptr: 8192,
            ..src.clone()
        };
        let xw = (&x.layout, &w.layout);
        let d = plan(
            Form::GroupedM,
            xw,
            Some((&src, false)),
            Epilogue::SwiGLU { up: None },
            g,
        );
        let [pre, act] = [0, 1].map(|i| Tensor {
            ptr: 1 << (20 + i),
            layout: Layout::contiguous(&d.out_shapes()[i]),
            ..x.clone()
        });
        let fusion = Fusion {
            src: Some(&src),
            src_b: false,
            epilogue: Epilogue::SwiGLU { up: None },
            act: Some(&act),
            partial: None,
            retry: false,
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
        let epilogue = Epilogue::DGated {
            pre: &pre.layout,
            scale: &scale.layout,
        };
        let d = plan(Form::GroupedM, (&dy.layout, &w.layout), None, epilogue, g);
        let shapes = d.out_shapes();
        assert_eq!(shapes[2], [2, rows], "ceil(72 / 64) chunks");
        let dpre = tensor(1 << 22, &shapes[0], DType::BF16);
        let act = tensor(1 << 23, &shapes[1], DType::BF16);
        let partial = tensor(1 << 24, &shapes[2], DType::F32);
        let fusion = Fusion {
            src: None,
            src_b: false,
            epilogue: Epilogue::DGated {
                pre: &pre,
                scale: &scale,
            },
            act: Some(&act),
            partial: Some(&partial),
            retry: true,
        };
        let wt = Transposable::transposed(&w);
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
        assert!(
            r.flag_taken,
            "a retry does not take the deferred error flag again"
        );
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
}
