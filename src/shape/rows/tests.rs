//! The row rules' tests: extents and output shapes, TopK's rule and order, the messages.

use super::*;

fn c(shape: &[usize]) -> Layout {
    Layout::contiguous(shape)
}

#[test]
fn extents_and_output_shapes() {
    let d = plan_swiglu(&c(&[5, 8])).unwrap();
    assert_eq!((d.rows, d.cols, d.out_shape()), (5, 4, [5, 4]));
    let d = plan_swiglu_backward(&c(&[5, 4]), &c(&[5, 8])).unwrap();
    assert_eq!((d.rows, d.cols, d.out_shape()), (5, 4, [5, 8]));
    let d = plan_gather_sum(&c(&[7, 3]), &c(&[2, 2]), Some(&c(&[2, 2]))).unwrap();
    assert_eq!((d.tokens, d.top_k, d.rows, d.cols), (2, 2, 7, 3));
    assert_eq!(d.out_shape(), [2, 3]);
    let d = plan_scatter_rows(&c(&[2, 3]), &c(&[2, 2]), None, 9).unwrap();
    assert_eq!((d.rows, d.cols, d.out_shape()), (9, 3, [9, 3]));
    let d = plan_row_dots(&c(&[2, 3]), &c(&[7, 3]), &c(&[2, 2])).unwrap();
    assert_eq!((d.rows, d.cols, d.out_shape()), (7, 3, [2, 2]));
    // nothing to do is valid
    let d = plan_gather_sum(&c(&[0, 4]), &c(&[0, 2]), None).unwrap();
    assert_eq!(d.out_shape(), [0, 4]);
    let d = plan_topk(&c(&[5, 8]), 3).unwrap();
    assert_eq!((d.tokens, d.top_k, d.rows, d.cols), (5, 3, 5, 8));
    assert_eq!((d.out_shape(), d.writes_index()), ([5, 3], true));
    assert_eq!(plan_topk(&c(&[0, 1]), 1).unwrap().out_shape(), [0, 1]);
    assert_eq!(plan_topk(&c(&[2, 8]), 8).unwrap().top_k, 8);
    assert!(!plan_swiglu(&c(&[5, 8])).unwrap().writes_index());
}

#[test]
fn topk_rules_name_scores_and_k() {
    let msg = |r: Result<RowsDims>| r.unwrap_err().to_string();
    for k in [0, -1, 9, i64::MIN] {
        assert_eq!(
            msg(plan_topk(&c(&[5, 8]), k)),
            format!("k: expected an integer in [1, 8] (1 to the columns of scores), found {k}")
        );
    }
    assert!(matches!(
        plan_topk(&c(&[5, 8]), 0),
        Err(crate::error::Error::Value(_))
    ));
    assert_eq!(
        msg(plan_topk(&c(&[8]), 1)),
        "scores: expected a 2-D tensor, found 1-D with shape [8]"
    );
    assert_eq!(
        msg(plan_topk(&c(&[3, 0]), 1)),
        "scores: expected at least one column (E >= 1), found shape [3, 0]"
    );
    let wide = plan_topk(&c(&[2, TOPK_CUDA_MAX_COLS + 1]), 2).unwrap();
    assert!(msg(check_topk_cuda(&wide).map(|_| wide))
        .starts_with("scores: expected at most 1024 columns on CUDA"));
    let edge = plan_topk(&c(&[2, TOPK_CUDA_MAX_COLS]), 2).unwrap();
    assert!(check_topk_cuda(&edge).is_ok());
}

/// The order is strict and total on distinct columns, NaN above +inf, -0.0 == 0.0.
#[test]
fn topk_order() {
    let vals = [
        f64::NAN,
        f64::INFINITY,
        1.0,
        0.0,
        -0.0,
        -1.0,
        f64::NEG_INFINITY,
    ];
    // (value, column) pairs, all columns distinct
    let items: Vec<(f64, usize)> = vals
        .iter()
        .chain(vals.iter())
        .enumerate()
        .map(|(i, &v)| (v, i))
        .collect();
    for &(a, ia) in &items {
        assert!(!topk_before(a, ia, a, ia), "irreflexive");
        for &(b, ib) in &items {
            if ia != ib {
                assert_ne!(topk_before(a, ia, b, ib), topk_before(b, ib, a, ia));
            }
            for &(c, ic) in &items {
                if topk_before(a, ia, b, ib) && topk_before(b, ib, c, ic) {
                    assert!(topk_before(a, ia, c, ic), "transitive");
                }
            }
        }
    }
    assert!(topk_before(f64::NAN, 5, f64::INFINITY, 0));
    assert!(topk_before(f64::NAN, 1, f64::NAN, 2));
    assert!(topk_before(-0.0, 3, 0.0, 4) && topk_before(0.0, 3, -0.0, 4));
    assert!(topk_before(2.0, 9, 1.0, 0));
}

#[test]
fn bad_shapes_name_the_argument() {
    let msg = |r: Result<RowsDims>| r.unwrap_err().to_string();
    assert_eq!(
        msg(plan_swiglu(&c(&[2, 3]))),
        "pre: expected an even last dimension [gate | up], found [2, 3]"
    );
    assert_eq!(
        msg(plan_swiglu(&c(&[6]))),
        "pre: expected a 2-D tensor, found 1-D with shape [6]"
    );
    assert_eq!(
        msg(plan_swiglu_backward(&c(&[2, 3]), &c(&[2, 5]))),
        "pre: expected shape [2, 6] ([rows of grad, 2 x its columns]), found [2, 5]"
    );
    assert_eq!(
        msg(plan_gather_sum(&c(&[4, 3]), &c(&[2, 2]), Some(&c(&[2, 3])))),
        "weights: expected shape [2, 2] (the shape of inverse), found [2, 3]"
    );
    assert_eq!(
        msg(plan_gather_sum(&c(&[4, 3]), &c(&[4]), None)),
        "inverse: expected a 2-D tensor, found 1-D with shape [4]"
    );
    assert_eq!(
        msg(plan_scatter_rows(&c(&[3, 3]), &c(&[2, 2]), None, 4)),
        "grad: expected shape [2, 3] ([rows of inverse, D]), found [3, 3]"
    );
    assert_eq!(
        msg(plan_row_dots(&c(&[2, 4]), &c(&[4, 3]), &c(&[2, 2]))),
        "grad: expected shape [2, 3] ([rows of inverse, columns of y]), found [2, 4]"
    );
}
