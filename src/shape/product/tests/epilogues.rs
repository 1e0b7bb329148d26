//! The products with an epilogue: SwiGLU (one weight or two), DGated (rows in order or
//! through `src`), RowScale; `scale`'s dtype.

use super::*;

#[test]
fn swiglu_product_and_outputs() {
    // gathered: R = len(src) rows of x
    let d = plan_swiglu_mm(&c(&[10, 4]), &c(&[3, 4, 6]), Some(&c(&[24])), 3).unwrap();
    assert_eq!(d.epilogue, Some(rule("swiglu")));
    let p = &d.product;
    assert_eq!(
        (p.form, p.groups, p.m, p.n, p.k),
        (Form::GroupedM, 3, 24, 6, 4)
    );
    assert_eq!((d.f, d.out_shapes()), (3, vec![[24, 6], [24, 3]]));
    // in order: R = T
    let d = plan_swiglu_mm(&c(&[10, 4]), &c(&[3, 4, 6]), None, 3).unwrap();
    assert_eq!((d.product.m, d.out_shapes()), (10, vec![[10, 6], [10, 3]]));
    assert!(!d.is_empty());
    // nothing to do is valid
    let d = plan_swiglu_mm(&c(&[0, 4]), &c(&[1, 4, 0]), None, 1).unwrap();
    assert_eq!(d.out_shapes(), vec![[0, 0], [0, 0]]);
    assert!(d.is_empty());
    // no routed rows (an expert-parallel rank that received none): empty outputs
    let d = plan_swiglu_mm(&c(&[0, 4]), &c(&[3, 4, 6]), Some(&c(&[0])), 3).unwrap();
    assert_eq!((d.out_shapes(), d.is_empty()), (vec![[0, 6], [0, 3]], true));
}

#[test]
fn swiglu_over_two_weights() {
    // the gate [G, K, F] and up [G, K, F]: a product of 2F columns, F odd allowed
    let (x, w, src) = (c(&[10, 4]), c(&[3, 4, 5]), c(&[24]));
    let up = c(&[3, 4, 5]);
    let epilogue = swiglu(Some(&up));
    let d = request(
        Form::GroupedM,
        (&x, &w),
        Some((&src, Gathered::A)),
        epilogue,
        3,
        false,
    )
    .unwrap();
    assert_eq!(d.epilogue, Some(rule("swiglu")));
    assert_eq!((d.product.m, d.product.n, d.product.k), (24, 10, 4));
    assert_eq!(d.product.out_shape, vec![24, 10]);
    assert_eq!((d.f, d.out_shapes()), (5, vec![[24, 10], [24, 5]]));
    // up of another shape: named, with w's
    let bad = c(&[3, 4, 6]);
    let epilogue = swiglu(Some(&bad));
    let e = request(Form::GroupedM, (&x, &w), None, epilogue, 3, false).unwrap_err();
    assert_eq!(
        e.to_string(),
        "up: expected shape [3, 4, 5] (the shape of w, the gate), found [3, 4, 6]"
    );
    // the gate's own rule first
    let epilogue = swiglu(Some(&up));
    let e = request(
        Form::GroupedM,
        (&x, &c(&[3, 5, 5])),
        None,
        epilogue,
        3,
        false,
    );
    assert!(e
        .unwrap_err()
        .to_string()
        .starts_with("w: expected 3-D weights [G, K=4, N]"));
}

#[test]
fn swiglu_errors_name_the_argument() {
    let msg = |x: &[usize], w: &[usize], src: Option<&[usize]>, g| {
        let src = src.map(c);
        plan_swiglu_mm(&c(x), &c(w), src.as_ref(), g)
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        msg(&[10, 4], &[3, 4, 5], Some(&[24]), 3),
        "w: expected an even last dimension [gate | up], found [3, 4, 5]"
    );
    assert_eq!(
        msg(&[10, 4], &[3, 4, 5], None, 3),
        "w: expected an even last dimension [gate | up], found [3, 4, 5]"
    );
    assert!(msg(&[10], &[3, 4, 6], None, 3).starts_with("x: expected a 2-D tensor [T, K]"));
    assert!(msg(&[10, 4], &[4, 6], None, 3).starts_with("w: expected 3-D weights [G, K=4, N]"));
    assert!(msg(&[10, 4], &[3, 5, 6], None, 3).starts_with("w: expected 3-D weights [G, K=4, N]"));
    assert_eq!(
        msg(&[10, 4], &[3, 4, 6], None, 2),
        "w: expected shape [G=2, K=4, N] (G = len(offs)), found [3, 4, 6]"
    );
    assert!(
        msg(&[10, 4], &[3, 4, 6], Some(&[4, 6]), 3).starts_with("src: expected a 1-D tensor [R]")
    );
}

#[test]
fn dgated_product_and_outputs() {
    // dy [R=24, D=8], w [3, F=130, 8]: p = dy · w[g]ᵀ is [24, 130]
    let d = plan_dgated_mm(
        &c(&[24, 8]),
        &c(&[3, 130, 8]),
        &c(&[24, 260]),
        &c(&[24]),
        None,
        3,
    )
    .unwrap();
    assert_eq!(d.epilogue, Some(rule("dgated")));
    let p = &d.product;
    assert_eq!(
        (p.form, p.groups, p.m, p.n, p.k),
        (Form::GroupedM, 3, 24, 130, 8)
    );
    assert_eq!(d.f, 130);
    assert_eq!(d.out_shapes(), vec![[24, 260], [24, 130], [3, 24]]);
    // F a multiple of the chunk, and F = 0
    let d = plan_dgated_mm(
        &c(&[5, 8]),
        &c(&[2, 128, 8]),
        &c(&[5, 256]),
        &c(&[5]),
        None,
        2,
    )
    .unwrap();
    assert_eq!(d.out_shapes()[2], [2, 5]);
    let d = plan_dgated_mm(&c(&[5, 8]), &c(&[2, 0, 8]), &c(&[5, 0]), &c(&[5]), None, 2).unwrap();
    assert_eq!(d.out_shapes(), vec![[5, 0], [5, 0], [0, 5]]);
}

#[test]
fn epilogues_by_name_with_their_operands() {
    assert_eq!(
        epilogue("row_scaled").unwrap_err().to_string(),
        "epilogue: expected one of swiglu, dgated, row_scale, found \"row_scaled\""
    );
    let (x, w) = (c(&[6, 8]), c(&[3, 8, 5]));
    let plan = |e| request(Form::GroupedM, (&x, &w), None, e, 3, false);
    let none = Epilogue::new(rule("row_scale"), [None]);
    assert_eq!(
        plan(none).unwrap_err().to_string(),
        "operands: the row_scale epilogue needs scale (operand 0 of (scale)), found none"
    );
    let s = c(&[6]);
    let two = Epilogue::new(rule("row_scale"), [Some(&s), Some(&s)]);
    assert_eq!(
        plan(two).unwrap_err().to_string(),
        "operands: the row_scale epilogue takes (scale), found 2 operands"
    );
    // SwiGLU's `up` is optional; DGated needs both
    assert!(plan(swiglu(None)).is_err(), "odd N: the gate | up rule");
    let dgated = Epilogue::new(rule("dgated"), [Some(&s)]);
    assert!(plan(dgated)
        .unwrap_err()
        .to_string()
        .starts_with("operands: the dgated epilogue needs scale"));
}

#[test]
fn row_scale_is_the_gathered_rule_with_one_scale_per_row() {
    let plan = |x: &[usize], scale: &[usize], src: Option<&[usize]>| {
        let src = src.map(c);
        let scale = c(scale);
        let epilogue = Epilogue::new(rule("row_scale"), [Some(&scale)]);
        let src = src.as_ref().map(|s| (s, Gathered::A));
        request(
            Form::GroupedM,
            (&c(x), &c(&[3, 8, 5])),
            src,
            epilogue,
            3,
            false,
        )
    };
    let d = plan(&[6, 8], &[6], None).unwrap();
    assert_eq!(
        (d.product.out_shape.clone(), d.out_shapes(), d.f),
        (vec![6, 5], vec![], 0)
    );
    assert!(!d.is_empty());
    assert!(plan(&[0, 8], &[0], None).unwrap().is_empty());
    let d = plan(&[4, 8], &[9], Some(&[9])).unwrap();
    assert_eq!(d.product.m, 9);
    assert_eq!(
        plan(&[6, 8], &[5], None).unwrap_err().to_string(),
        "scale: expected shape [6] (one scale per row of x), found [5]"
    );
    assert_eq!(
        plan(&[4, 8], &[4], Some(&[9])).unwrap_err().to_string(),
        "scale: expected shape [9] (one scale per routed row, R = len(src)), found [4]"
    );
    assert!(plan(&[6, 7], &[6], None)
        .unwrap_err()
        .to_string()
        .starts_with("w: expected 3-D weights [G, K=7, N]"));
}

#[test]
fn dgated_errors_name_the_argument() {
    let msg = |dy: &[usize], w: &[usize], pre: &[usize], scale: &[usize], g| {
        plan_dgated_mm(&c(dy), &c(w), &c(pre), &c(scale), None, g)
            .unwrap_err()
            .to_string()
    };
    let (dy, w, pre, s) = ([6, 8], [3, 4, 8], [6, 8], [6]);
    assert!(plan_dgated_mm(&c(&dy), &c(&w), &c(&pre), &c(&s), None, 3).is_ok());
    assert!(msg(&[6, 8, 1], &w, &pre, &s, 3).starts_with("dy: expected a 2-D tensor [R, D]"));
    assert!(msg(&dy, &[4, 8], &pre, &s, 3).starts_with("w: expected 3-D weights [G, F, D=8]"));
    assert!(msg(&dy, &[3, 8, 4], &pre, &s, 3).starts_with("w: expected 3-D weights [G, F, D=8]"));
    assert_eq!(
        msg(&dy, &w, &pre, &s, 2),
        "w: expected shape [G=2, F, D=8] (G = len(offs)), found [3, 4, 8]"
    );
    assert_eq!(
        msg(&dy, &w, &[6, 7], &s, 3),
        "pre: expected shape [6, 8] ([R, 2F]: the rows of dy, twice w.shape[1]), found [6, 7]"
    );
    assert!(msg(&dy, &w, &[48], &s, 3).starts_with("pre: expected a 2-D tensor"));
    assert_eq!(
        msg(&dy, &w, &pre, &[5], 3),
        "scale: expected shape [6] (one router weight per row of dy), found [5]"
    );
    assert_eq!(
        msg(&dy, &w, &pre, &[6, 1], 3),
        "scale: expected shape [6] (one router weight per row of dy), found [6, 1]"
    );
}

#[test]
fn dgated_with_src_reads_the_routed_rows_of_dy() {
    // dy [T=10, D=8] in token order, src [R=24]: the product is [R, F] over the routes
    let src = c(&[24]);
    let d = plan_dgated_mm(
        &c(&[10, 8]),
        &c(&[3, 130, 8]),
        &c(&[24, 260]),
        &c(&[24]),
        Some(&src),
        3,
    )
    .unwrap();
    let p = &d.product;
    assert_eq!(
        (p.form, p.groups, p.m, p.n, p.k),
        (Form::GroupedM, 3, 24, 130, 8)
    );
    assert_eq!(d.out_shapes(), vec![[24, 260], [24, 130], [3, 24]]);
    // any number of token rows, none included
    for t in [0, 1, 24, 100] {
        let d = plan_dgated_mm(
            &c(&[t, 8]),
            &c(&[3, 4, 8]),
            &c(&[6, 8]),
            &c(&[6]),
            Some(&c(&[6])),
            3,
        );
        assert_eq!(d.unwrap().product.m, 6);
    }
}

#[test]
fn dgated_with_src_errors_name_the_argument() {
    let msg = |dy: &[usize], pre: &[usize], scale: &[usize], src: &[usize]| {
        plan_dgated_mm(&c(dy), &c(&[3, 4, 8]), &c(pre), &c(scale), Some(&c(src)), 3)
            .unwrap_err()
            .to_string()
    };
    let (dy, pre, s, src) = ([10, 8], [6, 8], [6], [6]);
    assert!(msg(&[10], &pre, &s, &src).starts_with(
        "dy: expected a 2-D tensor [T, D] (the gradient of the down projection's output, the rows src indexes)"
    ));
    assert_eq!(
        msg(&dy, &pre, &s, &[6, 1]),
        "src: expected a 1-D tensor [R] (the row of dy of each routed row), found shape [6, 1]"
    );
    assert_eq!(
        msg(&dy, &[10, 8], &s, &src),
        "pre: expected shape [6, 8] ([R, 2F]: R = len(src), twice w.shape[1]), found [10, 8]"
    );
    assert_eq!(
        msg(&dy, &pre, &[10], &src),
        "scale: expected shape [6] (one router weight per routed row, R = len(src)), found [10]"
    );
    assert!(plan_dgated_mm(
        &c(&[10, 7]),
        &c(&[3, 4, 8]),
        &c(&pre),
        &c(&s),
        Some(&c(&src)),
        3
    )
    .unwrap_err()
    .to_string()
    .starts_with("w: expected 3-D weights [G, F, D=7]"));
}

#[test]
fn scale_is_float32() {
    assert!(check_f32("scale", DType::F32, "the router weights").is_ok());
    assert!(matches!(
        check_f32("scale", DType::BF16, "the router weights"),
        Err(Error::Dtype(m)) if m == "scale: expected dtype torch.float32 (the router weights), found torch.bfloat16"
    ));
}
