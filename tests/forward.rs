//! Forward of the list and the four packed forms against naive references, in every
//! dtype, on edge cases and random shapes, with strided inputs and outputs.

mod common;

use common::*;
use groupmm::api::{
    self, grouped_mm, grouped_mm_into, grouped_mm_list, grouped_mm_list_to, grouped_mm_to,
};
use groupmm::gradcheck::SplitMix64;
use groupmm::Element;
use half::{bf16, f16};
use ndarray::{array, aview1, s, Array2, Array3, ArrayD, ArrayView2, ArrayViewMut2, Axis, IxDyn};
use proptest::prelude::*;

fn run<TI: Element, TO: Element>(c: &Case) -> ArrayD<TO> {
    let (a, b) = (cast::<TI>(&c.a), cast::<TI>(&c.b));
    grouped_mm_to::<TI, TO, _, _>(a.view(), b.view(), c.offs().map(aview1)).unwrap()
}

/// Checks one case in `TI -> TO` against the f64 reference on the rounded inputs.
fn check_case<TI: Element, TO: Element>(c: &Case) {
    let (a, b) = (widen(&cast::<TI>(&c.a)), widen(&cast::<TI>(&c.b)));
    let want = ref_forward(c.form, &a, &b, c.offs());
    let mag = ref_forward(c.form, &abs(&a), &abs(&b), c.offs());
    let got = widen(&run::<TI, TO>(c));
    let what = c.describe::<TI, TO>();
    // 16-bit outputs: subnormals of f16 are 2^-24 apart
    assert_close(
        &what,
        &got,
        &want,
        &mag,
        unit_roundoff::<TO>(),
        k_err::<TI, TO>(c.k()),
        1e-7,
    );
}

fn check_all_dtypes(c: &Case) {
    check_case::<f64, f64>(c);
    check_case::<f32, f32>(c);
    check_case::<f16, f16>(c);
    check_case::<bf16, bf16>(c);
    check_case::<bf16, f32>(c);
    check_case::<f16, f32>(c);
}

// ------------------------------------------------------------------------------
// edge cases
// ------------------------------------------------------------------------------

#[test]
fn packed_forms_small_exact() {
    // [T, K] x [G, K, N]
    let a = array![[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]];
    let b = array![[[1.0], [0.0]], [[0.0], [1.0]]];
    let y = grouped_mm(a.view(), b.view(), Some(aview1(&[1, 3]))).unwrap();
    assert_eq!(y, array![[1.0], [4.0], [6.0], [0.0]].into_dyn());
    // [M, T] x [T, N] -> [G, M, N]
    let a = array![[1.0, 2.0, 3.0]];
    let b = array![[1.0], [10.0], [100.0]];
    let y = grouped_mm(a.view(), b.view(), Some(aview1(&[1, 1, 2]))).unwrap();
    assert_eq!(y, array![[[1.0]], [[0.0]], [[20.0]]].into_dyn());
    // [G, M, K] x [K, N] -> [M, N]
    let a = array![[[1.0]], [[2.0]]];
    let b = array![[1.0, 1.0, 1.0, 1.0]];
    let y = grouped_mm(a.view(), b.view(), Some(aview1(&[2, 3]))).unwrap();
    assert_eq!(y, array![[1.0, 1.0, 2.0, 0.0]].into_dyn());
    // batched
    let a = array![[[1.0, 2.0]], [[3.0, 4.0]]];
    let b = array![[[1.0], [1.0]], [[2.0], [0.0]]];
    let y = grouped_mm(a.view(), b.view(), None).unwrap();
    assert_eq!(y, array![[[3.0]], [[6.0]]].into_dyn());
}

#[test]
fn zero_groups_every_form() {
    for form in FORMS {
        let offs = if form == Form::Batched {
            None
        } else {
            Some(vec![])
        };
        let c = Case::new(form, 0, (3, 4, 5), offs, 1);
        let y = grouped_mm(c.a.view(), c.b.view(), c.offs().map(aview1)).unwrap();
        let want = ref_forward(form, &c.a, &c.b, c.offs());
        assert_eq!(y, want, "{form:?}");
        assert!(y.iter().all(|&v| v == 0.0));
        let expect_shape: &[usize] = match form {
            Form::M => &[3, 4],
            Form::K => &[0, 3, 4],
            Form::N => &[3, 4],
            Form::Batched => &[0, 3, 4],
        };
        assert_eq!(y.shape(), expect_shape, "{form:?}");
    }
}

#[test]
fn zero_dims_every_form() {
    for form in FORMS {
        for dims in [(0, 3, 4), (3, 0, 4), (3, 4, 0), (0, 0, 0)] {
            let e = extent(form, dims);
            let offs = (form != Form::Batched).then(|| vec![0, e as i32 / 2, e as i32]);
            let c = Case::new(form, 3, dims, offs, 2);
            let y = grouped_mm(c.a.view(), c.b.view(), c.offs().map(aview1)).unwrap();
            assert_eq!(
                y,
                ref_forward(form, &c.a, &c.b, c.offs()),
                "{form:?} {dims:?}"
            );
        }
    }
}

#[test]
fn empty_groups_and_tail_are_zero() {
    // all groups empty: the whole output is a zero tail
    let a = Array2::<f32>::ones((5, 3));
    let b = Array3::<f32>::ones((3, 3, 2));
    let y = api::mm_2d_3d(a.view(), b.view(), &[0, 0, 0]).unwrap();
    assert_eq!(y, Array2::<f32>::zeros((5, 2)));
    // GroupedK: empty groups give zero blocks, the tail columns of a are ignored
    let a = Array2::<f32>::ones((2, 6));
    let b = Array2::<f32>::ones((6, 3));
    let y = api::mm_2d_2d(a.view(), b.view(), &[0, 2, 2, 5]).unwrap();
    let sums: Vec<f32> = y.axis_iter(Axis(0)).map(|g| g[[0, 0]]).collect();
    assert_eq!(sums, vec![0.0, 2.0, 0.0, 3.0]);
    // GroupedN
    let a = Array3::<f32>::ones((2, 2, 4));
    let b = Array2::<f32>::ones((4, 5));
    let y = api::mm_3d_2d(a.view(), b.view(), &[0, 3]).unwrap();
    assert_eq!(y.row(0).to_vec(), vec![4.0, 4.0, 4.0, 0.0, 0.0]);
}

#[test]
fn nan_in_tail_does_not_leak() {
    // rows past the last offset are zero even when a holds NaN there
    let mut a = Array2::<f64>::ones((4, 2));
    a.row_mut(3).fill(f64::NAN);
    let b = Array3::<f64>::ones((1, 2, 2));
    let y = api::mm_2d_3d(a.view(), b.view(), &[3]).unwrap();
    assert_eq!(y.row(3).to_vec(), vec![0.0, 0.0]);
    assert_eq!(y.row(0).to_vec(), vec![2.0, 2.0]);
}

#[test]
fn list_edge_cases() {
    // G = 0
    let out = grouped_mm_list::<f64>(&[], &[]).unwrap();
    assert!(out.is_empty());
    // mixed shapes with zeros
    let mut r = SplitMix64::new(3);
    let shapes = [
        (2, 3, 4),
        (0, 3, 4),
        (2, 0, 4),
        (2, 3, 0),
        (1, 1, 1),
        (7, 5, 9),
    ];
    let a: Vec<ArrayD<f64>> = shapes.iter().map(|&(m, _, k)| r.array(&[m, k])).collect();
    let b: Vec<ArrayD<f64>> = shapes.iter().map(|&(_, n, k)| r.array(&[k, n])).collect();
    let av: Vec<ArrayView2<f64>> = a
        .iter()
        .map(|x| x.view().into_dimensionality().unwrap())
        .collect();
    let bv: Vec<ArrayView2<f64>> = b
        .iter()
        .map(|x| x.view().into_dimensionality().unwrap())
        .collect();
    let out = grouped_mm_list(&av, &bv).unwrap();
    let want = ref_list(&a, &b);
    for (i, (o, w)) in out.iter().zip(&want).enumerate() {
        assert_eq!(o.shape(), w.shape(), "group {i}");
        for (x, y) in o.iter().zip(w) {
            assert!((x - y).abs() <= 1e-12, "group {i}");
        }
    }
    assert!(out[3].iter().all(|&v| v == 0.0)); // K = 0
}

#[test]
fn large_problems_split_into_tiles() {
    // big enough that the engine splits groups into row/column tiles
    for form in FORMS {
        // groups of 40..120 x 160 x 48 multiply-adds: several tiles each
        let dims = (200, 160, 48);
        let e = extent(form, dims) as i32;
        let offs = (form != Form::Batched).then(|| vec![e / 5, e / 5, e - 7]);
        let c = Case::new(form, 3, dims, offs, 11);
        check_case::<f64, f64>(&c);
        check_case::<bf16, f32>(&c);
    }
    // one big list group next to tiny ones
    let mut r = SplitMix64::new(5);
    let a = [r.array(&[257, 129]), r.array(&[1, 3]), r.array(&[3, 1])];
    let b = [r.array(&[129, 300]), r.array(&[3, 1]), r.array(&[1, 2])];
    let av: Vec<ArrayView2<f64>> = a
        .iter()
        .map(|x| x.view().into_dimensionality().unwrap())
        .collect();
    let bv: Vec<ArrayView2<f64>> = b
        .iter()
        .map(|x| x.view().into_dimensionality().unwrap())
        .collect();
    let want = ref_list(&a, &b);
    let got = grouped_mm_list(&av, &bv).unwrap();
    for (g, w) in got.iter().zip(&want) {
        let mag = w.mapv(|_| 129.0);
        assert_close("list f64", &g.clone().into_dyn(), w, &mag, 0.0, 1e-14, 0.0);
    }
}

#[test]
fn wide_problems_split_into_column_tiles() {
    // few rows, many columns: the engine splits each group along N
    for form in FORMS {
        let dims = (4, 640, 300);
        let e = extent(form, dims) as i32;
        let offs = (form != Form::Batched).then(|| vec![e / 3, e / 3, e - 1]);
        let c = Case::new(form, 3, dims, offs, 12);
        check_case::<f64, f64>(&c);
        check_case::<bf16, f32>(&c);
    }
    let mut r = SplitMix64::new(6);
    let a = [r.array(&[3, 300]), r.array(&[2, 200])];
    let b = [r.array(&[300, 700]), r.array(&[200, 900])];
    let want = ref_list(&a, &b);
    let got = grouped_mm_list(&views2(&a), &views2(&b)).unwrap();
    for (g, w) in got.iter().zip(&want) {
        let mag = w.mapv(|_| 300.0);
        assert_close("list f64", &g.clone().into_dyn(), w, &mag, 0.0, 1e-14, 0.0);
    }
}

#[test]
fn out_dtype_keeps_f32_precision() {
    // 257 = 256 + 1 is not a bfloat16 value; an f32 output keeps it
    let a = Array2::from_elem((1, 257), bf16::ONE);
    let b = Array3::from_elem((1, 257, 1), bf16::ONE);
    let y16 = grouped_mm(a.view(), b.view(), Some(aview1(&[1]))).unwrap();
    let y32 = grouped_mm_to::<bf16, f32, _, _>(a.view(), b.view(), Some(aview1(&[1]))).unwrap();
    assert_eq!(y32[[0, 0]], 257.0);
    assert_eq!(y16[[0, 0]].to_f32(), 256.0);
    let out = grouped_mm_list_to::<bf16, f32>(&[a.view()], &[b.index_axis(Axis(0), 0)]).unwrap();
    assert_eq!(out[0][[0, 0]], 257.0);
}

#[test]
fn broadcast_inputs() {
    // zero strides are fine for inputs
    let row = ndarray::arr1(&[1.0, 2.0, 3.0]);
    let a = row.broadcast((4, 3)).unwrap(); // [T=4, K=3], stride (0, 1)
    let b = Array3::<f64>::ones((2, 3, 2));
    let y = grouped_mm(a, b.view(), Some(aview1(&[2, 4]))).unwrap();
    assert!(y.iter().all(|&v| v == 6.0));
}

#[test]
fn into_writes_only_the_view_and_honours_its_strides() {
    let c = Case::new(Form::M, 3, (9, 5, 4), Some(vec![2, 2, 7]), 8);
    let want = ref_forward(c.form, &c.a, &c.b, c.offs());
    // a reversed, transposed window of a larger buffer
    let mut buf = Array2::<f64>::from_elem((7, 12), -1.0);
    {
        let view: ArrayViewMut2<f64> = buf.slice_mut(s![1..6;1, 1..10]).reversed_axes();
        let view = view.slice_move(s![..;-1, ..]);
        grouped_mm_into(c.a.view(), c.b.view(), c.offs().map(aview1), view).unwrap();
    }
    let got = buf
        .slice(s![1..6, 1..10])
        .reversed_axes()
        .slice_move(s![..;-1, ..])
        .to_owned();
    for (x, y) in got.iter().zip(&want) {
        assert!((x - y).abs() < 1e-12);
    }
    // everything outside the window is untouched
    let mut outside = buf.clone();
    outside.slice_mut(s![1..6, 1..10]).fill(-1.0);
    assert!(outside.iter().all(|&v| v == -1.0));
}

// ------------------------------------------------------------------------------
// property tests
// ------------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Every packed form in f64 against the definition.
    #[test]
    fn packed_f64_matches_reference(c in case(6, 40)) {
        check_case::<f64, f64>(&c);
    }

    /// The list form in f64 against the definition.
    #[test]
    fn list_f64_matches_reference((a, b) in list_case(6, 40)) {
        let av: Vec<ArrayView2<f64>> = a.iter().map(|x| x.view().into_dimensionality().unwrap()).collect();
        let bv: Vec<ArrayView2<f64>> = b.iter().map(|x| x.view().into_dimensionality().unwrap()).collect();
        let got = grouped_mm_list(&av, &bv).unwrap();
        let want = ref_list(&a, &b);
        let mag = ref_list(&a.iter().map(abs).collect::<Vec<_>>(), &b.iter().map(abs).collect::<Vec<_>>());
        prop_assert_eq!(got.len(), want.len());
        for (i, ((g, w), m)) in got.iter().zip(&want).zip(&mag).enumerate() {
            let k = a[i].shape()[1];
            assert_close(&format!("list group {i}"), &g.clone().into_dyn(), w, m, 0.0, k_err::<f64, f64>(k), 0.0);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// f32, f16, bf16 (and 16-bit in, f32 out) against the f64 reference on the rounded
    /// inputs: |err| <= u_out·|ref| + (K+2)·2^-24·Σ|a||b| + 1e-7.
    #[test]
    fn packed_low_precision_matches_reference(c in case(6, 40)) {
        check_all_dtypes(&c);
    }

    #[test]
    fn list_low_precision_matches_reference((a, b) in list_case(6, 40)) {
        fn one<TI: Element, TO: Element>(a: &[ArrayD<f64>], b: &[ArrayD<f64>]) {
            let a16: Vec<ArrayD<TI>> = a.iter().map(cast::<TI>).collect();
            let b16: Vec<ArrayD<TI>> = b.iter().map(cast::<TI>).collect();
            let av: Vec<ArrayView2<TI>> = a16.iter().map(|x| x.view().into_dimensionality().unwrap()).collect();
            let bv: Vec<ArrayView2<TI>> = b16.iter().map(|x| x.view().into_dimensionality().unwrap()).collect();
            let got = grouped_mm_list_to::<TI, TO>(&av, &bv).unwrap();
            let (ar, br): (Vec<_>, Vec<_>) = (a16.iter().map(widen).collect(), b16.iter().map(widen).collect());
            let want = ref_list(&ar, &br);
            let mag = ref_list(&ar.iter().map(abs).collect::<Vec<_>>(), &br.iter().map(abs).collect::<Vec<_>>());
            for (i, ((g, w), m)) in got.iter().zip(&want).zip(&mag).enumerate() {
                let g = widen(&g.clone().into_dyn());
                assert_close(&format!("list {:?}->{:?} group {i}", TI::DTYPE, TO::DTYPE), &g, w, m,
                    unit_roundoff::<TO>(), k_err::<TI, TO>(a[i].shape()[1]), 1e-7);
            }
        }
        one::<f32, f32>(&a, &b);
        one::<f16, f16>(&a, &b);
        one::<bf16, bf16>(&a, &b);
        one::<bf16, f32>(&a, &b);
    }

    /// Transposed, step-2 and reversed (negative-stride) inputs give exactly the result
    /// of contiguous inputs.
    #[test]
    fn strided_inputs_equal_contiguous(c in case(5, 24), sa in 0..4usize, sb in 0..4usize) {
        let (sa, sb) = (STRIDES[sa], STRIDES[sb]);
        let offs = c.offs().map(aview1);
        let want = grouped_mm(c.a.view(), c.b.view(), offs).unwrap();
        let (ta, tb) = (store(&c.a, sa), store(&c.b, sb));
        let (va, vb) = (view_as(&ta, sa), view_as(&tb, sb));
        prop_assert_eq!(&va, &c.a);
        prop_assert_eq!(&vb, &c.b);
        let got = grouped_mm(va, vb, offs).unwrap();
        prop_assert_eq!(&got, &want);
        prop_assert!(got.is_standard_layout());
        // 16-bit inputs too (the widening path reads strides itself)
        let (a16, b16) = (cast::<bf16>(&c.a), cast::<bf16>(&c.b));
        let want16 = grouped_mm(a16.view(), b16.view(), offs).unwrap();
        let (ta, tb) = (store(&a16, sa), store(&b16, sb));
        prop_assert_eq!(grouped_mm(view_as(&ta, sa), view_as(&tb, sb), offs).unwrap(), want16);
    }

    #[test]
    fn strided_list_inputs_equal_contiguous((a, b) in list_case(5, 24), sa in 0..4usize, sb in 0..4usize) {
        let (sa, sb) = (STRIDES[sa], STRIDES[sb]);
        let av: Vec<ArrayView2<f64>> = a.iter().map(|x| x.view().into_dimensionality().unwrap()).collect();
        let bv: Vec<ArrayView2<f64>> = b.iter().map(|x| x.view().into_dimensionality().unwrap()).collect();
        let want = grouped_mm_list(&av, &bv).unwrap();
        let ta: Vec<_> = a.iter().map(|x| store(x, sa)).collect();
        let tb: Vec<_> = b.iter().map(|x| store(x, sb)).collect();
        let av: Vec<ArrayView2<f64>> = ta.iter().map(|x| view_as(x, sa).into_dimensionality().unwrap()).collect();
        let bv: Vec<ArrayView2<f64>> = tb.iter().map(|x| view_as(x, sb).into_dimensionality().unwrap()).collect();
        prop_assert_eq!(grouped_mm_list(&av, &bv).unwrap(), want);
    }

    /// `_into` with a strided output equals the allocating call.
    #[test]
    fn into_strided_output_equals_fresh(c in case(5, 24), so in 0..4usize) {
        let so = STRIDES[so];
        let offs = c.offs().map(aview1);
        let want = grouped_mm(c.a.view(), c.b.view(), offs).unwrap();
        let mut st = store(&ArrayD::<f64>::from_elem(IxDyn(want.shape()), 99.0), so);
        {
            let view = match so {
                Strides::Contiguous => st.view_mut(),
                Strides::Transposed => { let n = st.ndim(); let mut v = st.view_mut(); v.swap_axes(n - 2, n - 1); v }
                Strides::Step2 => st.slice_each_axis_mut(|_| ndarray::Slice::new(0, None, 2)),
                Strides::Reversed => st.slice_each_axis_mut(|_| ndarray::Slice::new(0, None, -1)),
            };
            grouped_mm_into(c.a.view(), c.b.view(), offs, view).unwrap();
        }
        prop_assert_eq!(view_as(&st, so), want.view());
    }
}
