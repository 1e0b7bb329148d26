//! The requests' tests: operand normalisation (and its invariance under transposition),
//! and the packed and row requests as the engine makes them, field by field.

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
    assert_eq!(r.fusion.epilogue, "");
    assert_eq!(r.fusion.operands, [0; 6]);
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
    assert_eq!(r.fusion.epilogue, "");
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
        let plan = plan(
            Form::GroupedK,
            ab,
            Some((&src, src_b)),
            Epilogue::plain(),
            g,
        )
        .product;
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
        assert_eq!(r.fusion.epilogue, "");
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

/// The SwiGLU epilogue's request: the gathered product into `pre` `[R, 2F]` with the SwiGLU
/// epilogue writing `act`; nothing of DGated's.
#[test]
fn swiglu_request_carries_the_activation() {
    let swiglu = crate::shape::find_epilogue("swiglu").unwrap();
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
        Epilogue::new(swiglu, [None]),
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
        epilogue: Epilogue::new(swiglu, [None]),
        outputs: &[&act],
        retry: false,
    };
    let r = packed_request(&d.product, &x, &w, Some(&offs), &fusion, &pre, (77, false)).unwrap();
    assert_eq!(r.form, ffi::Form::GroupedM);
    assert_eq!((r.m, r.n, r.k, r.a.rows), (24, 16, 16, 10));
    assert_eq!((r.b.ld, r.b.col_major), (16, true));
    assert_eq!((r.c.ptr, r.c.rows, r.c.cols, r.c.ld), (1 << 20, 24, 16, 16));
    let fu = r.fusion;
    assert_eq!((fu.epilogue, fu.src), ("swiglu", 4096));
    assert_eq!(fu.operands, [0, 1 << 21, 0, 0, 0, 0], "up absent, then act");
}

/// The DGated epilogue's request: `p = dy · w[g]ᵀ` (n = F, the down projection's weight read
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
    let dgated = crate::shape::find_epilogue("dgated").unwrap();
    let epilogue = Epilogue::new(dgated, [Some(&pre.layout), Some(&scale.layout)]);
    let d = plan(Form::GroupedM, (&dy.layout, &w.layout), None, epilogue, g);
    let shapes = d.out_shapes();
    assert_eq!(shapes[2], [2, rows], "ceil(72 / 64) chunks");
    let dpre = tensor(1 << 22, &shapes[0], DType::BF16);
    let act = tensor(1 << 23, &shapes[1], DType::BF16);
    let partial = tensor(1 << 24, &shapes[2], DType::F32);
    let fusion = Fusion {
        src: None,
        src_b: false,
        epilogue: Epilogue::new(dgated, [Some(&pre), Some(&scale)]),
        outputs: &[&act, &partial],
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
    assert_eq!((fu.epilogue, fu.src), ("dgated", 0));
    assert!(
        r.flag_taken,
        "a retry does not take the deferred error flag again"
    );
    assert_eq!(
        fu.operands,
        [1 << 20, 1 << 21, 1 << 23, 1 << 24, 0, 0],
        "pre, scale, act, partial"
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
