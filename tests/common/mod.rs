//! Shared helpers of the integration tests: naive references written from the
//! definition of each form (independent of `groupmm::shape`'s problem splitting),
//! proptest strategies, layout shufflers and tolerance checks.
#![allow(dead_code)]

use groupmm::gradcheck::SplitMix64;
use groupmm::Element;
use ndarray::{ArrayD, ArrayViewD, Dimension, IxDyn, Slice};
use proptest::prelude::*;

/// The packed forms, by the dimensions of `a` and `b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// `[T, K] x [G, K, N] -> [T, N]`
    M,
    /// `[M, T] x [T, N] -> [G, M, N]`
    K,
    /// `[G, M, K] x [K, N] -> [M, N]`
    N,
    /// `[G, M, K] x [G, K, N] -> [G, M, N]`
    Batched,
}

pub const FORMS: [Form; 4] = [Form::M, Form::K, Form::N, Form::Batched];

/// The group that index `i` of the grouped extent belongs to: the first `g` with
/// `i < offs[g]`; `None` past the last offset.
pub fn group_of(offs: &[i32], i: usize) -> Option<usize> {
    offs.iter().position(|&o| i < o as usize)
}

/// A packed problem: shapes, offsets and data.
#[derive(Debug, Clone)]
pub struct Case {
    pub form: Form,
    pub a: ArrayD<f64>,
    pub b: ArrayD<f64>,
    pub offs: Option<Vec<i32>>,
}

impl Case {
    /// Builds a case of `form` from group count and the dims `(m, n, k)`; for the
    /// offset forms the grouped extent is `m` (rows, `Form::M`), `k` (`Form::K`) or `n`
    /// (`Form::N`).
    pub fn new(
        form: Form,
        g: usize,
        (m, n, k): (usize, usize, usize),
        offs: Option<Vec<i32>>,
        seed: u64,
    ) -> Self {
        let (sa, sb): (Vec<usize>, Vec<usize>) = match form {
            Form::M => (vec![m, k], vec![g, k, n]),
            Form::K => (vec![m, k], vec![k, n]),
            Form::N => (vec![g, m, k], vec![k, n]),
            Form::Batched => (vec![g, m, k], vec![g, k, n]),
        };
        let mut r = SplitMix64::new(seed);
        Case {
            form,
            a: r.array(&sa),
            b: r.array(&sb),
            offs,
        }
    }

    pub fn offs(&self) -> Option<&[i32]> {
        self.offs.as_deref()
    }

    /// One line naming the case and the dtype pair, for assertion messages.
    pub fn describe<TI: Element, TO: Element>(&self) -> String {
        format!(
            "{:?} {:?}->{:?} a{:?} b{:?} offs {:?}",
            self.form,
            TI::DTYPE,
            TO::DTYPE,
            self.a.shape(),
            self.b.shape(),
            self.offs
        )
    }

    /// Length of the reduction of one output element (for error bounds).
    pub fn k(&self) -> usize {
        match self.form {
            Form::K => self.a.shape()[1],
            Form::M => self.a.shape()[1],
            Form::N | Form::Batched => self.a.shape()[2],
        }
    }
}

/// The extent `offs` indexes, for a form and dims `(m, n, k)`.
pub fn extent(form: Form, (m, n, k): (usize, usize, usize)) -> usize {
    match form {
        Form::M => m,
        Form::K => k,
        Form::N => n,
        Form::Batched => 0,
    }
}

/// A row-major copy with plain index arithmetic (ndarray indexing is slow in debug
/// builds, and the references run in debug under `cargo test`).
struct Flat {
    d: Vec<f64>,
    s: Vec<usize>,
}

impl Flat {
    fn new(x: &ArrayD<f64>) -> Self {
        let s = x.shape().to_vec();
        Flat {
            d: x.iter().copied().collect(),
            s,
        }
    }
    #[inline]
    fn at2(&self, i: usize, j: usize) -> f64 {
        self.d[i * self.s[1] + j]
    }
    #[inline]
    fn at3(&self, g: usize, i: usize, j: usize) -> f64 {
        self.d[(g * self.s[1] + i) * self.s[2] + j]
    }
}

fn build2(shape: (usize, usize), f: impl Fn(usize, usize) -> f64) -> ArrayD<f64> {
    let mut v = Vec::with_capacity(shape.0 * shape.1);
    for i in 0..shape.0 {
        for j in 0..shape.1 {
            v.push(f(i, j));
        }
    }
    ArrayD::from_shape_vec(IxDyn(&[shape.0, shape.1]), v).unwrap()
}

fn build3(shape: (usize, usize, usize), f: impl Fn(usize, usize, usize) -> f64) -> ArrayD<f64> {
    let mut v = Vec::with_capacity(shape.0 * shape.1 * shape.2);
    for g in 0..shape.0 {
        for i in 0..shape.1 {
            for j in 0..shape.2 {
                v.push(f(g, i, j));
            }
        }
    }
    ArrayD::from_shape_vec(IxDyn(&[shape.0, shape.1, shape.2]), v).unwrap()
}

/// `group_of` for every index of an extent.
fn groups(offs: &[i32], extent: usize) -> Vec<Option<usize>> {
    (0..extent).map(|i| group_of(offs, i)).collect()
}

/// Naive forward from the definition of each form.
pub fn ref_forward(
    form: Form,
    a: &ArrayD<f64>,
    b: &ArrayD<f64>,
    offs: Option<&[i32]>,
) -> ArrayD<f64> {
    let (sa, sb) = (a.shape(), b.shape());
    let (a, b) = (Flat::new(a), Flat::new(b));
    match form {
        Form::M => {
            let (t, kk, n) = (sa[0], sa[1], sb[2]);
            let grp = groups(offs.unwrap(), t);
            build2((t, n), |i, j| match grp[i] {
                Some(g) => (0..kk).map(|p| a.at2(i, p) * b.at3(g, p, j)).sum(),
                None => 0.0,
            })
        }
        Form::K => {
            let (m, t, n) = (sa[0], sa[1], sb[1]);
            let offs = offs.unwrap();
            let grp = groups(offs, t);
            build3((offs.len(), m, n), |gi, i, j| {
                (0..t)
                    .filter(|&p| grp[p] == Some(gi))
                    .map(|p| a.at2(i, p) * b.at2(p, j))
                    .sum()
            })
        }
        Form::N => {
            let (m, kk, n) = (sa[1], sa[2], sb[1]);
            let grp = groups(offs.unwrap(), n);
            build2((m, n), |i, j| match grp[j] {
                Some(g) => (0..kk).map(|p| a.at3(g, i, p) * b.at2(p, j)).sum(),
                None => 0.0,
            })
        }
        Form::Batched => {
            let (g, m, kk, n) = (sa[0], sa[1], sa[2], sb[2]);
            build3((g, m, n), |gi, i, j| {
                (0..kk).map(|p| a.at3(gi, i, p) * b.at3(gi, p, j)).sum()
            })
        }
    }
}

/// Naive backward from the definition: `(dA, dB)` with `dX = ∂⟨grad, f(a, b)⟩/∂X`.
pub fn ref_backward(
    form: Form,
    grad: &ArrayD<f64>,
    a: &ArrayD<f64>,
    b: &ArrayD<f64>,
    offs: Option<&[i32]>,
) -> (ArrayD<f64>, ArrayD<f64>) {
    let (sa, sb) = (a.shape().to_vec(), b.shape().to_vec());
    let (a, b, gr) = (Flat::new(a), Flat::new(b), Flat::new(grad));
    match form {
        Form::M => {
            let (t, n) = (sa[0], sb[2]);
            let grp = groups(offs.unwrap(), t);
            let da = build2((sa[0], sa[1]), |i, p| match grp[i] {
                Some(g) => (0..n).map(|j| gr.at2(i, j) * b.at3(g, p, j)).sum(),
                None => 0.0,
            });
            let db = build3((sb[0], sb[1], sb[2]), |g, p, j| {
                (0..t)
                    .filter(|&i| grp[i] == Some(g))
                    .map(|i| a.at2(i, p) * gr.at2(i, j))
                    .sum()
            });
            (da, db)
        }
        Form::K => {
            let (m, t, n) = (sa[0], sa[1], sb[1]);
            let grp = groups(offs.unwrap(), t);
            let da = build2((m, t), |i, p| match grp[p] {
                Some(g) => (0..n).map(|j| gr.at3(g, i, j) * b.at2(p, j)).sum(),
                None => 0.0,
            });
            let db = build2((t, n), |p, j| match grp[p] {
                Some(g) => (0..m).map(|i| a.at2(i, p) * gr.at3(g, i, j)).sum(),
                None => 0.0,
            });
            (da, db)
        }
        Form::N => {
            let (m, n) = (sa[1], sb[1]);
            let grp = groups(offs.unwrap(), n);
            let da = build3((sa[0], sa[1], sa[2]), |g, i, p| {
                (0..n)
                    .filter(|&j| grp[j] == Some(g))
                    .map(|j| gr.at2(i, j) * b.at2(p, j))
                    .sum()
            });
            let db = build2((sb[0], sb[1]), |p, j| match grp[j] {
                Some(g) => (0..m).map(|i| a.at3(g, i, p) * gr.at2(i, j)).sum(),
                None => 0.0,
            });
            (da, db)
        }
        Form::Batched => {
            let (m, n) = (sa[1], sb[2]);
            let da = build3((sa[0], sa[1], sa[2]), |g, i, p| {
                (0..n).map(|j| gr.at3(g, i, j) * b.at3(g, p, j)).sum()
            });
            let db = build3((sb[0], sb[1], sb[2]), |g, p, j| {
                (0..m).map(|i| a.at3(g, i, p) * gr.at3(g, i, j)).sum()
            });
            (da, db)
        }
    }
}

/// Elementwise absolute value (to bound rounding errors: the reference on |a|, |b|
/// gives `Σ|a||b|` per output element).
pub fn abs(x: &ArrayD<f64>) -> ArrayD<f64> {
    x.mapv(f64::abs)
}

/// Unit roundoff of an element type.
pub fn unit_roundoff<T: Element>() -> f64 {
    match T::DTYPE {
        groupmm::DType::F16 => 2f64.powi(-11),
        groupmm::DType::BF16 => 2f64.powi(-8),
        groupmm::DType::F32 => 2f64.powi(-24),
        groupmm::DType::F64 => 2f64.powi(-53),
    }
}

/// Asserts `|got - want| <= u_out·|want| + k_err·mag + atol` elementwise, where `mag`
/// is `Σ|a||b|` of each output element.
///
/// `u_out` covers the final rounding to the output type, `k_err` the accumulation
/// (`(K + 2)·u_acc` for a reduction of length K in a type of unit roundoff `u_acc`).
pub fn assert_close(
    what: &str,
    got: &ArrayD<f64>,
    want: &ArrayD<f64>,
    mag: &ArrayD<f64>,
    u_out: f64,
    k_err: f64,
    atol: f64,
) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    for ((ix, &g), (&w, &m)) in got.indexed_iter().zip(want.iter().zip(mag.iter())) {
        let tol = u_out * w.abs() + k_err * m + atol;
        assert!(
            (g - w).abs() <= tol,
            "{what}: at {:?} got {g:e}, want {w:e} (|diff| {:e} > tol {tol:e})",
            ix.slice(),
            (g - w).abs()
        );
    }
}

/// Accumulation error bound `(K + 2)·u_acc` for `TI` inputs: f32 accumulation for
/// everything but f64.
pub fn k_err<TI: Element, TO: Element>(k: usize) -> f64 {
    let u_acc = if TI::DTYPE == groupmm::DType::F64 && TO::DTYPE == groupmm::DType::F64 {
        2f64.powi(-53)
    } else {
        2f64.powi(-24)
    };
    (k as f64 + 2.0) * u_acc
}

pub fn cast<T: Element>(x: &ArrayD<f64>) -> ArrayD<T> {
    x.mapv(T::from_f64)
}

pub fn widen<T: Element>(x: &ArrayD<T>) -> ArrayD<f64> {
    x.mapv(|v| v.to_f64())
}

/// How an input is laid out in memory (same logical content).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strides {
    /// Row-major contiguous.
    Contiguous,
    /// The last two axes swapped in memory (a transposed view).
    Transposed,
    /// Every other element of a twice-as-large buffer along every axis.
    Step2,
    /// Every axis reversed in memory (negative strides).
    Reversed,
}

pub const STRIDES: [Strides; 4] = [
    Strides::Contiguous,
    Strides::Transposed,
    Strides::Step2,
    Strides::Reversed,
];

/// Storage for `x` in layout `s`; [`view_as`] turns it back into a view equal to `x`.
pub fn store<T: Element>(x: &ArrayD<T>, s: Strides) -> ArrayD<T> {
    let n = x.ndim();
    match s {
        Strides::Contiguous => x.as_standard_layout().into_owned(),
        Strides::Transposed => {
            let mut v = x.view();
            if n >= 2 {
                v.swap_axes(n - 2, n - 1);
            }
            v.as_standard_layout().into_owned()
        }
        Strides::Step2 => {
            let shape: Vec<usize> = x.shape().iter().map(|&d| 2 * d).collect();
            let mut st = ArrayD::from_elem(IxDyn(&shape), T::from_f64(1234.5));
            st.slice_each_axis_mut(|_| Slice::new(0, None, 2)).assign(x);
            st
        }
        Strides::Reversed => x
            .slice_each_axis(|_| Slice::new(0, None, -1))
            .as_standard_layout()
            .into_owned(),
    }
}

/// The view of `st` (made by [`store`] with the same `s`) that equals the original.
pub fn view_as<T: Element>(st: &ArrayD<T>, s: Strides) -> ArrayViewD<'_, T> {
    let n = st.ndim();
    match s {
        Strides::Contiguous => st.view(),
        Strides::Transposed => {
            let mut v = st.view();
            if n >= 2 {
                v.swap_axes(n - 2, n - 1);
            }
            v
        }
        Strides::Step2 => st.slice_each_axis(|_| Slice::new(0, None, 2)),
        Strides::Reversed => st.slice_each_axis(|_| Slice::new(0, None, -1)),
    }
}

// ------------------------------------------------------------------------------
// proptest strategies
// ------------------------------------------------------------------------------

/// A dimension: 0, 1, or random up to `max`.
pub fn dim(max: usize) -> impl Strategy<Value = usize> {
    prop_oneof![1 => Just(0usize), 1 => Just(1usize), 4 => 2..=max]
}

/// `g` non-decreasing offsets in `0..=extent`; half the time the last one is `extent`
/// (no tail), otherwise tails past the last offset are likely. Duplicates give empty
/// groups.
pub fn offs(g: usize, extent: usize) -> impl Strategy<Value = Vec<i32>> {
    (
        prop::collection::vec(0..=extent, g),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(move |(mut v, full, empty0)| {
            v.sort_unstable();
            if full && g > 0 {
                *v.last_mut().unwrap() = extent;
            }
            if empty0 && g > 1 {
                v[0] = 0; // an empty first group
            }
            v.into_iter().map(|o| o as i32).collect()
        })
}

pub fn form() -> impl Strategy<Value = Form> {
    prop_oneof![
        Just(Form::M),
        Just(Form::K),
        Just(Form::N),
        Just(Form::Batched)
    ]
}

/// A random packed case: G in `0..max_g`, each dim from [`dim`]`(max_dim)`.
pub fn case(max_g: usize, max_dim: usize) -> impl Strategy<Value = Case> {
    (
        form(),
        0..max_g,
        dim(max_dim),
        dim(max_dim),
        dim(max_dim),
        any::<u64>(),
    )
        .prop_flat_map(|(form, g, m, n, k, seed)| {
            let offs = if form == Form::Batched {
                Just(None).boxed()
            } else {
                offs(g, extent(form, (m, n, k))).prop_map(Some).boxed()
            };
            offs.prop_map(move |o| Case::new(form, g, (m, n, k), o, seed))
        })
}

/// A random list case: G in `0..max_g`, per-group dims from [`dim`]`(max_dim)`.
pub fn list_case(
    max_g: usize,
    max_dim: usize,
) -> impl Strategy<Value = (Vec<ArrayD<f64>>, Vec<ArrayD<f64>>)> {
    (
        prop::collection::vec((dim(max_dim), dim(max_dim), dim(max_dim)), 0..max_g),
        any::<u64>(),
    )
        .prop_map(|(dims, seed)| {
            let mut r = SplitMix64::new(seed);
            let a = dims.iter().map(|&(m, _, k)| r.array(&[m, k])).collect();
            let b = dims.iter().map(|&(_, n, k)| r.array(&[k, n])).collect();
            (a, b)
        })
}

/// Naive list reference.
pub fn ref_list(a: &[ArrayD<f64>], b: &[ArrayD<f64>]) -> Vec<ArrayD<f64>> {
    a.iter()
        .zip(b)
        .map(|(a, b)| {
            let (m, k, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
            let (a, b) = (Flat::new(a), Flat::new(b));
            build2((m, n), |i, j| {
                (0..k).map(|p| a.at2(i, p) * b.at2(p, j)).sum()
            })
        })
        .collect()
}

/// 2-D views of a list of 2-D arrays (of any dimension type).
pub fn views2<T, D: Dimension>(x: &[ndarray::Array<T, D>]) -> Vec<ndarray::ArrayView2<'_, T>> {
    x.iter()
        .map(|x| x.view().into_dimensionality().expect("2-D"))
        .collect()
}
