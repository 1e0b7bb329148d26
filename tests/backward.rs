//! Backward of the list and the four packed forms: against naive references written
//! from the definition, with strided and broadcast operands, in low precision, and
//! through the finite-difference gradient checker.

mod common;

use common::*;
use groupmm::api::{
    grouped_mm_backward, grouped_mm_backward_to, grouped_mm_list_backward,
    grouped_mm_list_backward_to,
};
use groupmm::gradcheck::{
    check, check_grouped_mm, check_grouped_mm_list, Failure, Options, SplitMix64,
};
use groupmm::Element;
use half::{bf16, f16};
use ndarray::{aview1, Array2, ArrayD, ArrayViewD, IxDyn};
use proptest::prelude::*;

fn out_shape(c: &Case) -> Vec<usize> {
    ref_forward(c.form, &c.a, &c.b, c.offs()).shape().to_vec()
}

/// Reduction length of dA and dB elements (for error bounds): dA sums over N, dB over
/// the rows of the group (at most the grouped or M extent).
fn red_lens(c: &Case) -> (usize, usize) {
    let (sa, sb) = (c.a.shape(), c.b.shape());
    match c.form {
        Form::M => (sb[2], sa[0]),
        Form::K => (sb[1], sa[0]),
        Form::N => (sb[1], sa[1]),
        Form::Batched => (sb[2], sa[1]),
    }
}

fn check_backward<TI: Element, TO: Element>(c: &Case, seed: u64) {
    let grad = SplitMix64::new(seed).array(&out_shape(c));
    let (a, b, g) = (cast::<TI>(&c.a), cast::<TI>(&c.b), cast::<TI>(&grad));
    let (da, db) = grouped_mm_backward_to::<TI, TO, _, _, _>(
        g.view(),
        a.view(),
        b.view(),
        c.offs().map(aview1),
        true,
        true,
    )
    .unwrap();
    let (a, b, g) = (widen(&a), widen(&b), widen(&g));
    let (wa, wb) = ref_backward(c.form, &g, &a, &b, c.offs());
    let (ma, mb) = ref_backward(c.form, &abs(&g), &abs(&a), &abs(&b), c.offs());
    let what = c.describe::<TI, TO>();
    let (ka, kb) = red_lens(c);
    let u = unit_roundoff::<TO>();
    assert_close(
        &format!("dA {what}"),
        &widen(&da.unwrap()),
        &wa,
        &ma,
        u,
        k_err::<TI, TO>(ka),
        1e-7,
    );
    assert_close(
        &format!("dB {what}"),
        &widen(&db.unwrap()),
        &wb,
        &mb,
        u,
        k_err::<TI, TO>(kb),
        1e-7,
    );
}

// ------------------------------------------------------------------------------
// edge cases
// ------------------------------------------------------------------------------

#[test]
fn only_requested_gradients_are_returned() {
    let c = Case::new(Form::M, 2, (5, 3, 4), Some(vec![2, 4]), 1);
    let grad = Array2::<f64>::ones((5, 3));
    let offs = Some(aview1(&[2, 4]));
    let (da, db) =
        grouped_mm_backward(grad.view(), c.a.view(), c.b.view(), offs, true, false).unwrap();
    assert!(da.is_some() && db.is_none());
    let (da, db) =
        grouped_mm_backward(grad.view(), c.a.view(), c.b.view(), offs, false, true).unwrap();
    assert!(da.is_none() && db.is_some());
    let (da, db) =
        grouped_mm_backward(grad.view(), c.a.view(), c.b.view(), offs, false, false).unwrap();
    assert!(da.is_none() && db.is_none());
    // still validated when nothing is asked for
    let bad = Array2::<f64>::ones((4, 3));
    assert!(grouped_mm_backward(bad.view(), c.a.view(), c.b.view(), offs, false, false).is_err());
}

#[test]
fn tails_and_empty_groups_get_zero_gradient() {
    for form in [Form::M, Form::K, Form::N] {
        let dims = (6, 7, 8);
        let e = extent(form, dims) as i32;
        let c = Case::new(form, 3, dims, Some(vec![0, e / 2, e - 2]), 4);
        let grad = SplitMix64::new(9).array(&out_shape(&c));
        let (da, db) = grouped_mm_backward(
            grad.view(),
            c.a.view(),
            c.b.view(),
            c.offs().map(aview1),
            true,
            true,
        )
        .unwrap();
        let (da, db) = (da.unwrap(), db.unwrap());
        let (wa, wb) = ref_backward(form, &grad, &c.a, &c.b, c.offs());
        let mag = wa.mapv(|_| 100.0);
        assert_close(&format!("{form:?} dA"), &da, &wa, &mag, 0.0, 1e-14, 0.0);
        let mag = wb.mapv(|_| 100.0);
        assert_close(&format!("{form:?} dB"), &db, &wb, &mag, 0.0, 1e-14, 0.0);
        // the last two indices of the grouped extent are past offs[G-1]
        let tail_zero = match form {
            Form::M => da
                .slice_each_axis(|ax| {
                    if ax.axis.index() == 0 {
                        (4..).into()
                    } else {
                        (..).into()
                    }
                })
                .iter()
                .all(|&v| v == 0.0),
            Form::K => {
                da.slice_each_axis(|ax| {
                    if ax.axis.index() == 1 {
                        (6..).into()
                    } else {
                        (..).into()
                    }
                })
                .iter()
                .all(|&v| v == 0.0)
                    && db
                        .slice_each_axis(|ax| {
                            if ax.axis.index() == 0 {
                                (6..).into()
                            } else {
                                (..).into()
                            }
                        })
                        .iter()
                        .all(|&v| v == 0.0)
            }
            Form::N => db
                .slice_each_axis(|ax| {
                    if ax.axis.index() == 1 {
                        (5..).into()
                    } else {
                        (..).into()
                    }
                })
                .iter()
                .all(|&v| v == 0.0),
            Form::Batched => unreachable!(),
        };
        assert!(tail_zero, "{form:?}");
        // group 0 is empty: its expert (M), block (K) or a[0] (N) gets zero gradient
        match form {
            Form::M => assert!(db.index_axis(ndarray::Axis(0), 0).iter().all(|&v| v == 0.0)),
            Form::N => assert!(da.index_axis(ndarray::Axis(0), 0).iter().all(|&v| v == 0.0)),
            _ => {}
        }
    }
}

#[test]
fn broadcast_grad_is_accepted() {
    // the gradient of sum(): ones broadcast from a scalar, all strides 0
    let c = Case::new(Form::Batched, 2, (3, 4, 5), None, 2);
    let one = ndarray::arr0(1.0);
    let grad = one.broadcast(IxDyn(&[2, 3, 4])).unwrap();
    let (da, db) = grouped_mm_backward(grad, c.a.view(), c.b.view(), None, true, true).unwrap();
    let dense = ArrayD::<f64>::ones(IxDyn(&[2, 3, 4]));
    let (wa, wb) = ref_backward(Form::Batched, &dense, &c.a, &c.b, None);
    let m = wa.mapv(|_| 10.0);
    assert_close("dA", &da.unwrap(), &wa, &m, 0.0, 1e-14, 0.0);
    let m = wb.mapv(|_| 10.0);
    assert_close("dB", &db.unwrap(), &wb, &m, 0.0, 1e-14, 0.0);
}

#[test]
fn list_backward_edge_cases() {
    // G = 0
    let (da, db) = grouped_mm_list_backward::<f64>(&[], &[], &[], true, true).unwrap();
    assert!(da.unwrap().is_empty() && db.unwrap().is_empty());
    // K = 0: dA is [M, 0], dB is [0, N]; M = 0: dB is zeros
    let a = [Array2::<f64>::zeros((3, 0)), Array2::<f64>::zeros((0, 2))];
    let b = [Array2::<f64>::zeros((0, 4)), Array2::<f64>::ones((2, 5))];
    let g = [Array2::<f64>::ones((3, 4)), Array2::<f64>::ones((0, 5))];
    let (da, db) =
        grouped_mm_list_backward(&views2(&g), &views2(&a), &views2(&b), true, true).unwrap();
    let (da, db) = (da.unwrap(), db.unwrap());
    assert_eq!(da[0].shape(), &[3, 0]);
    assert_eq!(db[0].shape(), &[0, 4]);
    assert_eq!(da[1].shape(), &[0, 2]);
    assert_eq!(db[1], Array2::<f64>::zeros((2, 5)));
}

#[test]
fn failure_reports_input_and_index() {
    // a deliberately wrong backward: dB is off by one at b[1, 0, 2]
    let c = Case::new(Form::M, 2, (4, 3, 2), Some(vec![1, 4]), 3);
    let offs = c.offs().unwrap().to_vec();
    let f = |x: &[ArrayViewD<f64>]| {
        groupmm::api::grouped_mm(x[0].view(), x[1].view(), Some(aview1(&offs))).unwrap()
    };
    let bw = |x: &[ArrayViewD<f64>], v: ArrayViewD<f64>| {
        let (da, db) =
            grouped_mm_backward(v, x[0].view(), x[1].view(), Some(aview1(&offs)), true, true)
                .unwrap();
        let mut db = db.unwrap();
        db[[1, 0, 2]] += 1.0;
        vec![da.unwrap(), db]
    };
    match check(&[c.a.clone(), c.b.clone()], f, bw, &Options::default()) {
        Err(Failure::Mismatch(m)) => {
            assert_eq!((m.input, m.index.as_slice()), (1, &[1, 0, 2][..]));
            assert!((m.analytic - m.numeric - 1.0).abs() < 1e-6, "{m}");
            assert!(m.to_string().contains("input 1 at [1, 0, 2]"), "{m}");
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
    // wrong number and shape of gradients
    let bad_count =
        |_: &[ArrayViewD<f64>], _: ArrayViewD<f64>| vec![ArrayD::<f64>::zeros(IxDyn(&[4, 2]))];
    assert!(matches!(
        check(
            &[c.a.clone(), c.b.clone()],
            f,
            bad_count,
            &Options::default()
        ),
        Err(Failure::Shape(_))
    ));
    let bad_shape = |_: &[ArrayViewD<f64>], _: ArrayViewD<f64>| {
        vec![
            ArrayD::<f64>::zeros(IxDyn(&[4, 2])),
            ArrayD::<f64>::zeros(IxDyn(&[2, 2])),
        ]
    };
    assert!(matches!(
        check(
            &[c.a.clone(), c.b.clone()],
            f,
            bad_shape,
            &Options::default()
        ),
        Err(Failure::Shape(_))
    ));
    // invalid op inputs surface as Failure::Op
    let e = check_grouped_mm(&c.a, &c.b, Some(&[3, 1]), &Options::default()).unwrap_err();
    assert!(matches!(e, Failure::Op(groupmm::Error::Value(_))), "{e}");
}

#[test]
fn gradcheck_report_counts_elements() {
    let c = Case::new(Form::N, 3, (2, 5, 3), Some(vec![1, 1, 4]), 6);
    let r = check_grouped_mm(&c.a, &c.b, c.offs(), &Options::default()).unwrap();
    assert_eq!((r.inputs, r.checked), (2, 3 * 2 * 3 + 3 * 5));
    assert!(r.max_abs_err < 1e-8, "{r}");
}

// ------------------------------------------------------------------------------
// property tests
// ------------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// dA and dB of every packed form in f64 against the definition.
    #[test]
    fn packed_backward_f64_matches_reference(c in case(6, 40), seed in any::<u64>()) {
        check_backward::<f64, f64>(&c, seed);
    }

    /// The list backward in f64 against the definition.
    #[test]
    fn list_backward_f64_matches_reference((a, b) in list_case(6, 40), seed in any::<u64>()) {
        let mut r = SplitMix64::new(seed);
        let g: Vec<ArrayD<f64>> = a.iter().zip(&b).map(|(a, b)| r.array(&[a.shape()[0], b.shape()[1]])).collect();
        let (da, db) = grouped_mm_list_backward(&views2(&g), &views2(&a), &views2(&b), true, true).unwrap();
        let (da, db) = (da.unwrap(), db.unwrap());
        prop_assert_eq!((da.len(), db.len()), (a.len(), a.len()));
        for i in 0..a.len() {
            // one group of the list is the batched form with G = 1
            let e3 = |x: &ArrayD<f64>| x.clone().insert_axis(ndarray::Axis(0));
            let (wa, wb) = ref_backward(Form::Batched, &e3(&g[i]), &e3(&a[i]), &e3(&b[i]), None);
            let (ma, mb) = ref_backward(Form::Batched, &abs(&e3(&g[i])), &abs(&e3(&a[i])), &abs(&e3(&b[i])), None);
            let (m, n) = (a[i].shape()[0], b[i].shape()[1]);
            assert_close(&format!("dA[{i}]"), &e3(&da[i].clone().into_dyn()), &wa, &ma, 0.0, k_err::<f64, f64>(n), 0.0);
            assert_close(&format!("dB[{i}]"), &e3(&db[i].clone().into_dyn()), &wb, &mb, 0.0, k_err::<f64, f64>(m), 0.0);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Low precision backward (and 16-bit in, f32 gradients) against the f64 reference.
    #[test]
    fn packed_backward_low_precision(c in case(5, 32), seed in any::<u64>()) {
        check_backward::<f32, f32>(&c, seed);
        check_backward::<bf16, bf16>(&c, seed);
        check_backward::<f16, f16>(&c, seed);
        check_backward::<bf16, f32>(&c, seed);
    }

    #[test]
    fn list_backward_low_precision((a, b) in list_case(5, 32)) {
        fn one<TI: Element, TO: Element>(a: &[ArrayD<f64>], b: &[ArrayD<f64>]) {
            let g: Vec<ArrayD<TI>> = a.iter().zip(b).map(|(a, b)| cast::<TI>(&SplitMix64::new(1).array(&[a.shape()[0], b.shape()[1]]))).collect();
            let (a, b): (Vec<ArrayD<TI>>, Vec<ArrayD<TI>>) = (a.iter().map(cast::<TI>).collect(), b.iter().map(cast::<TI>).collect());
            let (da, db) = grouped_mm_list_backward_to::<TI, TO>(&views2(&g), &views2(&a), &views2(&b), true, true).unwrap();
            let e3 = |x: &ArrayD<TI>| widen(x).insert_axis(ndarray::Axis(0));
            for (i, (da, db)) in da.unwrap().iter().zip(db.unwrap().iter()).enumerate() {
                let (wa, wb) = ref_backward(Form::Batched, &e3(&g[i]), &e3(&a[i]), &e3(&b[i]), None);
                let (ma, mb) = ref_backward(Form::Batched, &abs(&e3(&g[i])), &abs(&e3(&a[i])), &abs(&e3(&b[i])), None);
                let (m, n) = (a[i].shape()[0], b[i].shape()[1]);
                let u = unit_roundoff::<TO>();
                assert_close("dA", &widen(&da.clone().into_dyn()).insert_axis(ndarray::Axis(0)), &wa, &ma, u, k_err::<TI, TO>(n), 1e-7);
                assert_close("dB", &widen(&db.clone().into_dyn()).insert_axis(ndarray::Axis(0)), &wb, &mb, u, k_err::<TI, TO>(m), 1e-7);
            }
        }
        one::<f32, f32>(&a, &b);
        one::<bf16, bf16>(&a, &b);
        one::<f16, f32>(&a, &b);
    }

    /// Strided a, b and grad give exactly the gradients of contiguous ones.
    #[test]
    fn strided_backward_equals_contiguous(c in case(5, 20), sa in 0..4usize, sb in 0..4usize, sg in 0..4usize) {
        let grad = SplitMix64::new(5).array(&out_shape(&c));
        let offs = c.offs().map(aview1);
        let want = grouped_mm_backward(grad.view(), c.a.view(), c.b.view(), offs, true, true).unwrap();
        let (sa, sb, sg) = (STRIDES[sa], STRIDES[sb], STRIDES[sg]);
        let (ta, tb, tg) = (store(&c.a, sa), store(&c.b, sb), store(&grad, sg));
        let got = grouped_mm_backward(view_as(&tg, sg), view_as(&ta, sa), view_as(&tb, sb), offs, true, true).unwrap();
        prop_assert_eq!(got, want);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Finite differences agree with the analytic backward on small random problems of
    /// every packed form (G in 0..4, each dim 0, 1 or up to 5).
    #[test]
    fn gradcheck_packed(c in case(4, 5), seed in any::<u64>()) {
        let opts = Options { seed, ..Options::default() };
        let r = check_grouped_mm(&c.a, &c.b, c.offs(), &opts);
        prop_assert!(r.is_ok(), "{:?} a{:?} b{:?} offs {:?}: {}", c.form, c.a.shape(), c.b.shape(), c.offs, r.unwrap_err());
        prop_assert_eq!(r.unwrap().checked, c.a.len() + c.b.len());
    }

    #[test]
    fn gradcheck_list((a, b) in list_case(4, 5), seed in any::<u64>()) {
        let a: Vec<Array2<f64>> = a.into_iter().map(|x| x.into_dimensionality().unwrap()).collect();
        let b: Vec<Array2<f64>> = b.into_iter().map(|x| x.into_dimensionality().unwrap()).collect();
        let opts = Options { seed, ..Options::default() };
        let r = check_grouped_mm_list(&a, &b, &opts);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

#[test]
fn gradcheck_every_form_fixed_shapes() {
    // one deterministic problem per form with empty groups and a tail
    for form in FORMS {
        let dims = (4, 5, 3);
        let e = extent(form, dims) as i32;
        let offs = (form != Form::Batched).then(|| vec![1, 1, e - 1]);
        let c = Case::new(form, 3, dims, offs, 42);
        let r = check_grouped_mm(&c.a, &c.b, c.offs(), &Options::default())
            .unwrap_or_else(|e| panic!("{form:?}: {e}"));
        assert_eq!(r.checked, c.a.len() + c.b.len());
    }
}
