//! The gathered plain products (`gather_mm`, `gather_k_mm`), the operands' names, and the
//! requests no rule takes.

use super::*;

#[test]
fn gathered_product_is_grouped_m_over_the_routed_rows() {
    let p = plan_gather(&c(&[10, 4]), &c(&[3, 4, 5]), &c(&[24]), 3).unwrap();
    assert_eq!((p.form, p.m, p.k, p.n), (Form::GroupedM, 24, 4, 5));
    assert_eq!(p.out_shape, vec![24, 5]);
    let msg = |x: &[usize], w: &[usize], src: &[usize], g| {
        plan_gather(&c(x), &c(w), &c(src), g)
            .unwrap_err()
            .to_string()
    };
    assert!(msg(&[1, 10, 4], &[3, 4, 5], &[24], 3).starts_with("x: expected a 2-D tensor [T, K]"));
    assert!(msg(&[10, 4], &[3, 3, 5], &[24], 3).starts_with("w: expected 3-D weights [G, K=4, N]"));
    assert!(msg(&[10, 4], &[3, 4, 5], &[24, 1], 3).starts_with("src: expected a 1-D tensor [R]"));
    assert_eq!(
        msg(&[10, 4], &[3, 4, 5], &[24], 2),
        "w: expected shape [G=2, K=4, N] (G = len(offs)), found [3, 4, 5]"
    );
}

#[test]
fn gathered_k_product_is_grouped_k_over_the_routed_rows() {
    // a [Ta=10, K=4] gathered through src [R=24], b [R, N=5] in order
    let p = plan_gather_k(&c(&[10, 4]), &c(&[24, 5]), &c(&[24]), 3, false, false).unwrap();
    assert_eq!(
        (p.form, p.groups, p.m, p.n, p.k),
        (Form::GroupedK, 3, 4, 5, 24)
    );
    assert_eq!((p.out_shape.clone(), p.offs_extent), (vec![3, 4, 5], 24));
    // transposed: [N, R] · [R, K], whose transposed view is the [G, K, N] result
    let p = plan_gather_k(&c(&[10, 4]), &c(&[24, 5]), &c(&[24]), 3, false, true).unwrap();
    assert_eq!((p.form, p.m, p.n, p.k), (Form::GroupedK, 5, 4, 24));
    assert_eq!(p.out_shape, vec![3, 5, 4]);
    // gathered b: a [R, K] in order, b [Tb=7, N] any number of rows
    let p = plan_gather_k(&c(&[24, 4]), &c(&[7, 5]), &c(&[24]), 2, true, false).unwrap();
    assert_eq!(
        (p.m, p.n, p.k, p.out_shape.clone()),
        (4, 5, 24, vec![2, 4, 5])
    );
    let p = plan_gather_k(&c(&[24, 4]), &c(&[7, 5]), &c(&[24]), 2, true, true).unwrap();
    assert_eq!(p.out_shape, vec![2, 5, 4]);
    // nothing routed, no source rows, no groups: valid
    let p = plan_gather_k(&c(&[0, 4]), &c(&[0, 5]), &c(&[0]), 0, false, false).unwrap();
    assert_eq!((p.k, p.out_shape.clone()), (0, vec![0, 4, 5]));
}

#[test]
fn gathered_k_errors_name_the_argument() {
    let msg = |a: &[usize], b: &[usize], src: &[usize], gathered_b| {
        plan_gather_k(&c(a), &c(b), &c(src), 3, gathered_b, false)
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        msg(&[10, 4, 1], &[24, 5], &[24], false),
        "a: expected a 2-D tensor [Ta, K] (the rows src indexes), found shape [10, 4, 1]"
    );
    assert_eq!(
        msg(&[10], &[7, 5], &[10], true),
        "a: expected a 2-D tensor [R, K] (one row per entry of src), found shape [10]"
    );
    assert_eq!(
        msg(&[10, 4], &[24], &[24], false),
        "b: expected a 2-D tensor [R, N] (one row per entry of src), found shape [24]"
    );
    assert_eq!(
        msg(&[24, 4], &[2, 7, 5], &[24], true),
        "b: expected a 2-D tensor [Tb, N] (the rows src indexes), found shape [2, 7, 5]"
    );
    assert!(msg(&[10, 4], &[24, 5], &[24, 1], false).starts_with("src: expected a 1-D tensor [R]"));
    assert_eq!(
        msg(&[10, 4], &[23, 5], &[24], false),
        "b: expected shape [R=24, N] (R = len(src): one row per routed row), found [23, 5]"
    );
    assert_eq!(
        msg(&[10, 4], &[7, 5], &[24], true),
        "a: expected shape [R=24, K] (R = len(src): one row per routed row), found [10, 4]"
    );
    // the gathered operand has any number of rows, the other exactly R
    for t in [0, 1, 24, 100] {
        assert!(plan_gather_k(&c(&[t, 4]), &c(&[24, 5]), &c(&[24]), 3, false, false).is_ok());
        assert!(plan_gather_k(&c(&[24, 4]), &c(&[t, 5]), &c(&[24]), 3, true, false).is_ok());
    }
}

#[test]
fn names_and_requests_without_a_rule() {
    let (x, w) = (c(&[10, 4]), c(&[3, 4, 6]));
    assert_eq!(
        operand_names(Form::GroupedK, &Epilogue::<()>::plain()),
        ["a", "b"]
    );
    assert_eq!(operand_names(Form::GroupedM, &swiglu(None)), ["x", "w"]);
    assert_eq!(
        operand_names(Form::GroupedM, &Epilogue::<()>::new(rule("dgated"), [])),
        ["dy", "w"]
    );
    // in order: R = T
    let d = request(Form::GroupedM, (&x, &w), None, Epilogue::plain(), 3, false).unwrap();
    assert_eq!(
        (d.product.m, d.out_shapes(), d.is_empty()),
        (10, vec![], false)
    );
    // what no face asks: an internal error, never a panic
    let src = c(&[24]);
    for (form, src, epilogue, transposed) in [
        (
            Form::GroupedM,
            Some((&src, Gathered::B)),
            Epilogue::plain(),
            false,
        ),
        (Form::GroupedM, None, swiglu(None), true),
        (Form::GroupedK, None, Epilogue::plain(), false),
        (
            Form::GroupedK,
            Some((&src, Gathered::A)),
            swiglu(None),
            false,
        ),
        (Form::Batched, None, Epilogue::plain(), false),
    ] {
        let e = request(form, (&x, &w), src, epilogue, 3, transposed).unwrap_err();
        assert!(
            e.to_string().starts_with("internal: no product rule"),
            "{e}"
        );
    }
}
