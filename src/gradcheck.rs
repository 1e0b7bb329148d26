//! Gradient checking: central finite differences in f64 against an analytic backward.
//!
//! [`check`] works for any function of several f64 arrays that returns one array:
//! it draws a random upstream gradient `v` (deterministic, from [`Options::seed`]),
//! asks the analytic backward for `∂⟨v, f(x)⟩/∂x` of every input, and compares each
//! element with the central difference
//! `(⟨v, f(x + ε·e_j)⟩ − ⟨v, f(x − ε·e_j)⟩) / 2ε`.
//! An element passes when `|analytic − numeric| <= atol` or
//! `<= rtol · max(|analytic|, |numeric|)` (approx's `relative_eq`).
//!
//! [`check_grouped_mm`] and [`check_grouped_mm_list`] apply it to this crate's
//! [`api`] functions.
//!
//! ```
//! use groupmm::gradcheck::{check, Options};
//! use ndarray::{ArrayD, ArrayViewD, IxDyn};
//!
//! // f(x, y) = x * y elementwise; ∂/∂x = v * y, ∂/∂y = v * x
//! let x = ArrayD::from_shape_vec(IxDyn(&[3]), vec![1.0, -2.0, 0.5]).unwrap();
//! let y = ArrayD::from_shape_vec(IxDyn(&[3]), vec![4.0, 0.0, 2.0]).unwrap();
//! let report = check(
//!     &[x, y],
//!     |i: &[ArrayViewD<f64>]| &i[0] * &i[1],
//!     |i: &[ArrayViewD<f64>], v: ArrayViewD<f64>| vec![&v * &i[1], &v * &i[0]],
//!     &Options::default(),
//! )
//! .expect("gradients agree");
//! assert_eq!(report.checked, 6);
//! ```

use crate::api;
use crate::error::Error;
use approx::RelativeEq;
use ndarray::{ArrayD, ArrayView1, ArrayView2, ArrayViewD, Dimension, IxDyn};
use std::fmt;

/// Settings of a gradient check.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// Finite-difference step.
    pub eps: f64,
    /// Absolute tolerance.
    pub atol: f64,
    /// Relative tolerance.
    pub rtol: f64,
    /// Seed of the random upstream gradient.
    pub seed: u64,
}

impl Default for Options {
    /// `torch.autograd.gradcheck`'s defaults: `eps = 1e-6`, `atol = 1e-5`,
    /// `rtol = 1e-3`; seed 0.
    fn default() -> Self {
        Options {
            eps: 1e-6,
            atol: 1e-5,
            rtol: 1e-3,
            seed: 0,
        }
    }
}

/// What a passing check looked at.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// Number of inputs.
    pub inputs: usize,
    /// Number of input elements whose gradient was checked.
    pub checked: usize,
    /// Largest `|analytic − numeric|` seen.
    pub max_abs_err: f64,
    /// Largest `|analytic − numeric| / max(|analytic|, |numeric|)` seen (0 where both
    /// are 0).
    pub max_rel_err: f64,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "gradcheck passed: {} elements of {} inputs, max abs err {:.3e}, max rel err {:.3e}",
            self.checked, self.inputs, self.max_abs_err, self.max_rel_err
        )
    }
}

/// One gradient element that disagreed with its finite difference.
#[derive(Debug, Clone, PartialEq)]
pub struct Mismatch {
    /// Which input (position in `inputs`).
    pub input: usize,
    /// Index of the element inside that input.
    pub index: Vec<usize>,
    /// The backward's value.
    pub analytic: f64,
    /// The central difference.
    pub numeric: f64,
    /// `|analytic − numeric|`.
    pub abs_err: f64,
    /// The largest error allowed here: `max(atol, rtol · max(|analytic|, |numeric|))`.
    pub allowed: f64,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "gradient of input {} at {:?}: analytic {:.9e}, numeric {:.9e}, |diff| {:.3e} > allowed {:.3e}",
            self.input, self.index, self.analytic, self.numeric, self.abs_err, self.allowed
        )
    }
}

/// Why a gradient check failed.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// An analytic gradient element is off.
    Mismatch(Mismatch),
    /// The backward returned the wrong number of gradients or a gradient of the wrong
    /// shape.
    Shape(String),
    /// The operation itself rejected the inputs.
    Op(Error),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Mismatch(m) => write!(f, "gradcheck failed: {m}"),
            Failure::Shape(s) => write!(f, "gradcheck failed: {s}"),
            Failure::Op(e) => write!(f, "gradcheck could not run the operation: {e}"),
        }
    }
}

impl std::error::Error for Failure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Failure::Op(e) => Some(e),
            _ => None,
        }
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Op(e)
    }
}

/// A small deterministic generator (SplitMix64), used for the random upstream
/// gradient; public so callers can draw reproducible test data without a `rand`
/// dependency.
///
/// ```
/// use groupmm::gradcheck::SplitMix64;
/// let mut r = SplitMix64::new(7);
/// let x = r.uniform();
/// assert!((-1.0..1.0).contains(&x));
/// assert_eq!(SplitMix64::new(7).uniform(), x);
/// ```
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform draw from `[-1, 1)`.
    pub fn uniform(&mut self) -> f64 {
        // 53 random bits -> [0, 1) -> [-1, 1)
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }

    /// An array of `shape` with uniform entries in `[-1, 1)`.
    pub fn array(&mut self, shape: &[usize]) -> ArrayD<f64> {
        ArrayD::from_shape_simple_fn(IxDyn(shape), || self.uniform())
    }
}

fn views(x: &[ArrayD<f64>]) -> Vec<ArrayViewD<'_, f64>> {
    x.iter().map(|a| a.view()).collect()
}

fn dot(x: &ArrayD<f64>, y: &ArrayD<f64>) -> f64 {
    x.iter().zip(y).map(|(a, b)| a * b).sum()
}

/// Checks `backward` against central finite differences of `f` at `inputs`.
///
/// `f` maps the inputs to one output array. `backward(inputs, v)` must return one
/// gradient per input, of that input's shape: `∂⟨v, f(inputs)⟩/∂inputs[i]`. The
/// upstream gradient `v` is uniform in `[-1, 1)`, drawn from `opts.seed`. The check
/// costs two calls of `f` per input element.
///
/// # Errors
/// [`Failure::Mismatch`] for the first element (inputs in order, elements in logical
/// row-major order) outside tolerance; [`Failure::Shape`] when the backward returns the
/// wrong number or shapes of gradients, or `f` changes its output shape.
pub fn check<F, B>(
    inputs: &[ArrayD<f64>],
    f: F,
    backward: B,
    opts: &Options,
) -> Result<Report, Failure>
where
    F: Fn(&[ArrayViewD<'_, f64>]) -> ArrayD<f64>,
    B: Fn(&[ArrayViewD<'_, f64>], ArrayViewD<'_, f64>) -> Vec<ArrayD<f64>>,
{
    let mut x: Vec<ArrayD<f64>> = inputs.to_vec();
    let y0 = f(&views(&x));
    let v = SplitMix64::new(opts.seed).array(y0.shape());
    let grads = backward(&views(&x), v.view());
    if grads.len() != x.len() {
        return Err(Failure::Shape(format!(
            "backward returned {} gradients for {} inputs",
            grads.len(),
            x.len()
        )));
    }
    for (i, (g, xi)) in grads.iter().zip(&x).enumerate() {
        if g.shape() != xi.shape() {
            return Err(Failure::Shape(format!(
                "gradient of input {i} has shape {:?}, the input has {:?}",
                g.shape(),
                xi.shape()
            )));
        }
    }
    let mut report = Report {
        inputs: x.len(),
        checked: 0,
        max_abs_err: 0.0,
        max_rel_err: 0.0,
    };
    let probe = |x: &[ArrayD<f64>]| -> Result<f64, Failure> {
        let y = f(&views(x));
        if y.shape() != v.shape() {
            return Err(Failure::Shape(format!(
                "f returned shape {:?} for perturbed inputs, {:?} at the start",
                y.shape(),
                v.shape()
            )));
        }
        Ok(dot(&y, &v))
    };
    for i in 0..x.len() {
        let shape = x[i].shape().to_vec();
        for (index, &analytic) in grads[i].indexed_iter() {
            let index: Vec<usize> = index.slice().to_vec();
            let orig = x[i][index.as_slice()];
            x[i][index.as_slice()] = orig + opts.eps;
            let plus = probe(&x)?;
            x[i][index.as_slice()] = orig - opts.eps;
            let minus = probe(&x)?;
            x[i][index.as_slice()] = orig;
            let numeric = (plus - minus) / (2.0 * opts.eps);
            let abs_err = (analytic - numeric).abs();
            let scale = analytic.abs().max(numeric.abs());
            report.checked += 1;
            report.max_abs_err = report.max_abs_err.max(abs_err);
            if scale > 0.0 {
                report.max_rel_err = report.max_rel_err.max(abs_err / scale);
            }
            if !analytic.relative_eq(&numeric, opts.atol, opts.rtol) {
                return Err(Failure::Mismatch(Mismatch {
                    input: i,
                    index,
                    analytic,
                    numeric,
                    abs_err,
                    allowed: opts.atol.max(opts.rtol * scale),
                }));
            }
        }
        debug_assert_eq!(x[i].shape(), shape.as_slice());
    }
    Ok(report)
}

/// Gradient check of the packed [`api::grouped_mm`] at `(a, b, offs)`: both inputs,
/// every element, with [`api::grouped_mm_backward`] as the analytic side.
///
/// # Errors
/// [`Failure::Op`] when the shapes or `offs` are invalid; otherwise as [`check`].
///
/// ```
/// use groupmm::gradcheck::{check_grouped_mm, Options, SplitMix64};
///
/// let mut r = SplitMix64::new(1);
/// let (a, b) = (r.array(&[6, 3]), r.array(&[2, 3, 4])); // [T, K] x [G, K, N]
/// let report = check_grouped_mm(&a, &b, Some(&[2, 5]), &Options::default())?;
/// assert_eq!(report.checked, 6 * 3 + 2 * 3 * 4);
/// # Ok::<(), groupmm::gradcheck::Failure>(())
/// ```
pub fn check_grouped_mm(
    a: &ArrayD<f64>,
    b: &ArrayD<f64>,
    offs: Option<&[i32]>,
    opts: &Options,
) -> Result<Report, Failure> {
    let offs = offs.map(ArrayView1::from);
    // validate once so that the closures below cannot fail
    api::grouped_mm(a.view(), b.view(), offs)?;
    check(
        &[a.clone(), b.clone()],
        |x| api::grouped_mm(x[0].view(), x[1].view(), offs).expect("validated above"),
        |x, v| {
            let (da, db) = api::grouped_mm_backward(v, x[0].view(), x[1].view(), offs, true, true)
                .expect("validated above");
            vec![da.expect("asked for dA"), db.expect("asked for dB")]
        },
        opts,
    )
}

fn as2<'a>(x: &ArrayViewD<'a, f64>) -> ArrayView2<'a, f64> {
    x.clone().into_dimensionality().expect("2-D input")
}

/// Gradient check of [`api::grouped_mm_list`] at `(a, b)`: inputs are
/// `a[0], …, a[G-1], b[0], …, b[G-1]`, checked with
/// [`api::grouped_mm_list_backward`]. The outputs are concatenated (flattened) into
/// one vector for the check.
///
/// # Errors
/// [`Failure::Op`] when the shapes are invalid; otherwise as [`check`] (a mismatch in
/// input `i < G` is in `a[i]`, otherwise in `b[i - G]`).
///
/// ```
/// use groupmm::gradcheck::{check_grouped_mm_list, Options, SplitMix64};
///
/// let mut r = SplitMix64::new(2);
/// let a = vec![r.array(&[2, 3]).into_dimensionality().unwrap(), r.array(&[0, 1]).into_dimensionality().unwrap()];
/// let b = vec![r.array(&[3, 4]).into_dimensionality().unwrap(), r.array(&[1, 5]).into_dimensionality().unwrap()];
/// let report = check_grouped_mm_list(&a, &b, &Options::default())?;
/// assert_eq!(report.inputs, 4);
/// # Ok::<(), groupmm::gradcheck::Failure>(())
/// ```
pub fn check_grouped_mm_list(
    a: &[ndarray::Array2<f64>],
    b: &[ndarray::Array2<f64>],
    opts: &Options,
) -> Result<Report, Failure> {
    let g = a.len();
    let av: Vec<_> = a.iter().map(|x| x.view()).collect();
    let bv: Vec<_> = b.iter().map(|x| x.view()).collect();
    let outs = api::grouped_mm_list(&av, &bv)?;
    let out_shapes: Vec<(usize, usize)> = outs.iter().map(|o| o.dim()).collect();
    let inputs: Vec<ArrayD<f64>> = a.iter().chain(b).map(|x| x.clone().into_dyn()).collect();
    let forward = |x: &[ArrayViewD<'_, f64>]| -> ArrayD<f64> {
        let xa: Vec<_> = x[..g].iter().map(as2).collect();
        let xb: Vec<_> = x[g..].iter().map(as2).collect();
        let outs = api::grouped_mm_list(&xa, &xb).expect("validated above");
        let flat: Vec<f64> = outs.iter().flat_map(|o| o.iter().copied()).collect();
        ArrayD::from_shape_vec(IxDyn(&[flat.len()]), flat).expect("1-D")
    };
    let backward = |x: &[ArrayViewD<'_, f64>], v: ArrayViewD<'_, f64>| -> Vec<ArrayD<f64>> {
        let xa: Vec<_> = x[..g].iter().map(as2).collect();
        let xb: Vec<_> = x[g..].iter().map(as2).collect();
        let v: Vec<f64> = v.iter().copied().collect();
        let mut grads = Vec::with_capacity(g);
        let mut at = 0;
        for &(m, n) in &out_shapes {
            let piece = ndarray::Array2::from_shape_vec((m, n), v[at..at + m * n].to_vec())
                .expect("sizes add up");
            at += m * n;
            grads.push(piece);
        }
        let gv: Vec<_> = grads.iter().map(|x| x.view()).collect();
        let (da, db) =
            api::grouped_mm_list_backward(&gv, &xa, &xb, true, true).expect("validated above");
        da.expect("asked for dA")
            .into_iter()
            .chain(db.expect("asked for dB"))
            .map(|x| x.into_dyn())
            .collect()
    };
    check(&inputs, forward, backward, opts)
}
