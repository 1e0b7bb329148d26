//! Invalid inputs: each gives the right [`Error`] variant, a message naming the
//! argument (and group), and leaves caller buffers untouched.

use groupmm::api::{
    grouped_mm, grouped_mm_backward, grouped_mm_into, grouped_mm_list, grouped_mm_list_backward,
    grouped_mm_list_into,
};
use groupmm::Error;
use ndarray::{aview1, Array1, Array2, Array3, Array4, ArrayD, IxDyn};

/// Asserts a Shape error whose message starts with `prefix`.
#[track_caller]
fn shape<T: std::fmt::Debug>(r: groupmm::Result<T>, prefix: &str) {
    match r {
        Err(Error::Shape(m)) => assert!(
            m.starts_with(prefix),
            "message {m:?} should start with {prefix:?}"
        ),
        other => panic!("expected Error::Shape({prefix}...), got {other:?}"),
    }
}

/// Asserts a Value error whose message starts with `prefix`.
#[track_caller]
fn value<T: std::fmt::Debug>(r: groupmm::Result<T>, prefix: &str) {
    match r {
        Err(Error::Value(m)) => assert!(
            m.starts_with(prefix),
            "message {m:?} should start with {prefix:?}"
        ),
        other => panic!("expected Error::Value({prefix}...), got {other:?}"),
    }
}

fn a2(m: usize, k: usize) -> Array2<f64> {
    Array2::ones((m, k))
}

fn a3(g: usize, m: usize, k: usize) -> Array3<f64> {
    Array3::ones((g, m, k))
}

#[test]
fn wrong_ranks() {
    let v1 = Array1::<f64>::ones(4);
    let v4 = Array4::<f64>::ones((1, 2, 3, 4));
    shape(
        grouped_mm(v1.view(), a3(1, 4, 2).view(), Some(aview1(&[1]))),
        "a: expected a 2- or 3-D",
    );
    shape(
        grouped_mm(a2(2, 4).view(), v4.view(), Some(aview1(&[1]))),
        "b: expected a 2- or 3-D",
    );
    let scalar = ArrayD::<f64>::ones(IxDyn(&[]));
    shape(
        grouped_mm(scalar.view(), a2(2, 2).view(), None),
        "a: expected a 2- or 3-D",
    );
}

#[test]
fn packed_shape_mismatches_name_the_argument() {
    let o2 = Some(aview1(&[1, 2]));
    // [T, K] x [G, K, N]: G != len(offs), K mismatch
    shape(
        grouped_mm(a2(4, 3).view(), a3(3, 3, 5).view(), o2),
        "b: expected shape [G=2, K=3, N]",
    );
    shape(
        grouped_mm(a2(4, 3).view(), a3(2, 4, 5).view(), o2),
        "b: expected shape [G=2, K=3, N]",
    );
    // [M, T] x [T, N]: T mismatch
    shape(
        grouped_mm(a2(4, 3).view(), a2(4, 5).view(), o2),
        "b: expected shape [T=3, N]",
    );
    // [G, M, K] x [K, N]: G != len(offs), K mismatch
    shape(
        grouped_mm(a3(3, 4, 2).view(), a2(2, 5).view(), o2),
        "a: expected shape [G=2, M, K]",
    );
    shape(
        grouped_mm(a3(2, 4, 2).view(), a2(3, 5).view(), o2),
        "b: expected shape [K=2, N]",
    );
    // batched: G or K mismatch
    shape(
        grouped_mm(a3(2, 4, 2).view(), a3(3, 2, 5).view(), None),
        "b: expected shape [G=2, K=2, N]",
    );
    shape(
        grouped_mm(a3(2, 4, 2).view(), a3(2, 3, 5).view(), None),
        "b: expected shape [G=2, K=2, N]",
    );
}

#[test]
fn offs_presence() {
    shape(
        grouped_mm(a2(4, 3).view(), a3(2, 3, 5).view(), None),
        "offs: required",
    );
    shape(
        grouped_mm(a2(4, 3).view(), a2(3, 5).view(), None),
        "offs: required",
    );
    shape(
        grouped_mm(a3(2, 4, 3).view(), a2(3, 5).view(), None),
        "offs: required",
    );
    shape(
        grouped_mm(
            a3(2, 4, 3).view(),
            a3(2, 3, 5).view(),
            Some(aview1(&[1, 2])),
        ),
        "offs: must be None",
    );
}

#[test]
fn offs_values() {
    let (a, b) = (a2(4, 3), a3(3, 3, 5));
    value(
        grouped_mm(a.view(), b.view(), Some(aview1(&[2, 1, 4]))),
        "offs: group 1 ends at 1, before group 0 ends at 2",
    );
    value(
        grouped_mm(a.view(), b.view(), Some(aview1(&[-1, 1, 4]))),
        "offs: group 0 ends at -1",
    );
    value(
        grouped_mm(a.view(), b.view(), Some(aview1(&[1, 2, 5]))),
        "offs: group 2 ends at 5, past a.shape[0] (T) = 4",
    );
    // the other offset forms name their extent
    value(
        grouped_mm(a2(2, 4).view(), a2(4, 5).view(), Some(aview1(&[9]))),
        "offs: group 0 ends at 9, past a.shape[1] (T) = 4",
    );
    value(
        grouped_mm(a3(1, 2, 4).view(), a2(4, 5).view(), Some(aview1(&[6]))),
        "offs: group 0 ends at 6, past b.shape[1] (N) = 5",
    );
    value(
        grouped_mm(a.view(), b.view(), Some(aview1(&[1, 2, i32::MIN]))),
        "offs: group 2 ends at",
    );
}

#[test]
fn backward_checks_grad_and_operands() {
    let (a, b) = (a2(4, 3), a3(2, 3, 5));
    let o = Some(aview1(&[1, 4]));
    shape(
        grouped_mm_backward(a2(4, 6).view(), a.view(), b.view(), o, true, true),
        "grad: expected shape [4, 5]",
    );
    shape(
        grouped_mm_backward(a3(1, 4, 5).view(), a.view(), b.view(), o, true, true),
        "grad: expected shape [4, 5]",
    );
    shape(
        grouped_mm_backward(a2(4, 5).view(), a.view(), b.view(), None, true, true),
        "offs: required",
    );
    value(
        grouped_mm_backward(
            a2(4, 5).view(),
            a.view(),
            b.view(),
            Some(aview1(&[3, 2])),
            true,
            true,
        ),
        "offs: group 1",
    );
    shape(
        grouped_mm_backward(a2(4, 5).view(), a.view(), a3(2, 2, 5).view(), o, true, true),
        "b: expected shape [G=2, K=3, N]",
    );
}

#[test]
fn list_errors_name_the_group() {
    let (x, y) = (a2(2, 3), a2(3, 4));
    shape(
        grouped_mm_list(&[x.view()], &[y.view(), y.view()]),
        "As and Bs: expected sequences of the same length, found 1 and 2",
    );
    shape(
        grouped_mm_list(&[x.view(), x.view()], &[y.view(), x.view()]),
        "Bs[1]: expected shape [K=3, N] (K = As[1].shape[1]), found [2, 3]",
    );
    // list backward
    let g = a2(2, 4);
    shape(
        grouped_mm_list_backward(&[g.view(), g.view()], &[x.view()], &[y.view()], true, true),
        "grads: expected a sequence of 1",
    );
    shape(
        grouped_mm_list_backward(&[a2(2, 5).view()], &[x.view()], &[y.view()], true, true),
        "grads[0]: expected shape [2, 4]",
    );
    shape(
        grouped_mm_list_backward(&[g.view()], &[x.view()], &[x.view()], true, true),
        "Bs[0]: expected shape [K=3, N]",
    );
}

#[test]
fn into_rejects_bad_outputs_without_writing() {
    let (a, b) = (a2(4, 3), a3(2, 3, 5));
    let mut out = Array2::<f64>::from_elem((4, 6), 7.0);
    shape(
        grouped_mm_into(a.view(), b.view(), Some(aview1(&[1, 4])), out.view_mut()),
        "out: expected shape [4, 5], found [4, 6]",
    );
    assert!(out.iter().all(|&v| v == 7.0));
    // valid output, invalid offs: nothing written
    let mut out = Array2::<f64>::from_elem((4, 5), 7.0);
    value(
        grouped_mm_into(a.view(), b.view(), Some(aview1(&[3, 1])), out.view_mut()),
        "offs: group 1",
    );
    assert!(out.iter().all(|&v| v == 7.0));
    // list
    let mut o = [Array2::<f64>::from_elem((2, 5), 7.0)];
    let mut views: Vec<_> = o.iter_mut().map(|x| x.view_mut()).collect();
    let (x, y) = (a2(2, 3), a2(3, 4));
    shape(
        grouped_mm_list_into(&[x.view()], &[y.view()], &mut views),
        "out[0]: expected shape [2, 4], found [2, 5]",
    );
    shape(
        grouped_mm_list_into::<f64, f32>(&[x.view()], &[y.view()], &mut []),
        "out: expected a sequence of 1",
    );
    drop(views);
    assert!(o[0].iter().all(|&v| v == 7.0));
}

#[test]
fn error_variants_display_their_message() {
    let e = grouped_mm(a2(4, 3).view(), a3(2, 3, 5).view(), None).unwrap_err();
    assert_eq!(
        e.to_string(),
        match &e {
            Error::Shape(m) => m.clone(),
            _ => unreachable!(),
        }
    );
    // usable as a std error
    let _: Box<dyn std::error::Error> = Box::new(e);
}
