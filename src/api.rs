//! The Rust API on `ndarray`: forward and backward of every grouped form, without
//! Python.
//!
//! Inputs are views of any layout (slices, transposed views, negative or zero
//! strides); they are read in place, never copied. Outputs are freshly allocated
//! row-major arrays, or a caller's mutable view for the `*_into` functions. Every call
//! goes through the rules of [`crate::shape`], so the accepted shapes and the error
//! messages are those of the Python package.
//!
//! | function | a | b | offs | output |
//! | --- | --- | --- | --- | --- |
//! | [`grouped_mm_list`] | `[M_i, K_i]` each | `[K_i, N_i]` each | – | `[M_i, N_i]` each |
//! | [`grouped_mm`] / [`mm_2d_3d`] | `[T, K]` | `[G, K, N]` | `[G]` | `[T, N]` |
//! | [`grouped_mm`] / [`mm_2d_2d`] | `[M, T]` | `[T, N]` | `[G]` | `[G, M, N]` |
//! | [`grouped_mm`] / [`mm_3d_2d`] | `[G, M, K]` | `[K, N]` | `[G]` | `[M, N]` |
//! | [`grouped_mm`] / [`mm_3d_3d`] | `[G, M, K]` | `[G, K, N]` | none | `[G, M, N]` |
//!
//! `offs` holds the cumulative end of each group (int32, non-decreasing); rows or
//! columns past `offs[G-1]` are zero in the output and get zero gradient. Empty
//! groups, zero-sized dimensions and `G = 0` are all legal.
//!
//! Backward: [`grouped_mm_backward`] and [`grouped_mm_list_backward`] return
//! `dA = dC·Bᵀ` and `dB = Aᵀ·dC`, each only when asked for, computed by the same
//! kernels on transposed views (no transpose copies).
//!
//! Element types are [`f16`](half::f16), [`bf16`](half::bf16), `f32` and `f64`
//! ([`Element`]); 16-bit inputs accumulate in f32. The `*_to` functions choose the
//! output type separately, e.g. bfloat16 in, float32 out:
//!
//! ```
//! use groupmm::api::grouped_mm_to;
//! use half::bf16;
//! use ndarray::{aview1, Array2, Array3};
//!
//! let a = Array2::from_elem((4, 3), bf16::from_f32(0.5)); // [T, K]
//! let b = Array3::from_elem((2, 3, 5), bf16::from_f32(2.0)); // [G, K, N]
//! let out = grouped_mm_to::<bf16, f32, _, _>(a.view(), b.view(), Some(aview1(&[1, 4])))?;
//! assert_eq!(out.shape(), &[4, 5]);
//! assert!(out.iter().all(|&v| v == 3.0)); // 3 × (0.5 × 2.0), summed in f32
//! # Ok::<(), groupmm::Error>(())
//! ```

use crate::cpu;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::shape::{self, fmt_shape, Layout, PackedPlan};
use ndarray::{
    Array, Array2, Array3, ArrayD, ArrayView, ArrayView1, ArrayView2, ArrayView3, ArrayViewMut,
    ArrayViewMut2, Dimension, Ix2, Ix3, IxDyn,
};

/// The gradients of a backward call: `(dA, dB)`, each `None` unless it was asked for.
pub type Grads<A> = (Option<A>, Option<A>);

fn layout<T, D: Dimension>(v: &ArrayView<'_, T, D>) -> Layout {
    Layout::new(v.shape(), v.strides())
}

fn layout_mut<T, D: Dimension>(v: &ArrayViewMut<'_, T, D>) -> Layout {
    Layout::new(v.shape(), v.strides())
}

fn offs_vec(offs: Option<ArrayView1<'_, i32>>) -> Option<Vec<i32>> {
    offs.map(|o| o.iter().copied().collect())
}

/// A fresh zero-filled row-major array of `shape`.
fn zeros<TO: Element>(shape: &[usize]) -> ArrayD<TO> {
    ArrayD::from_elem(IxDyn(shape), TO::zero())
}

/// Validates a packed product (shapes, then `offs` values) and returns its plan.
fn plan<T, DA: Dimension, DB: Dimension>(
    a: &ArrayView<'_, T, DA>,
    b: &ArrayView<'_, T, DB>,
    offs: Option<&[i32]>,
) -> Result<PackedPlan> {
    let plan = shape::plan_packed(&layout(a), &layout(b), offs.map(<[i32]>::len))?;
    if let Some(o) = offs {
        shape::check_offs(o, &plan)?;
    }
    Ok(plan)
}

/// Runs an already validated packed product `a · b` into `out`.
///
/// `a`, `b` and `out` are described by the layouts and base pointers; `out` must have
/// shape `plan.out_shape`, must not overlap itself and must not alias `a` or `b`.
fn run_packed<TI: Element, TO: Element>(
    (la, pa): (&Layout, *const TI),
    (lb, pb): (&Layout, *const TI),
    offs: Option<&[i32]>,
    (lc, pc): (&Layout, *mut TO),
) -> Result<()> {
    let plan = shape::plan_packed(la, lb, offs.map(<[i32]>::len))?;
    if let Some(o) = offs {
        shape::check_offs(o, &plan)?;
    }
    if lc.shape != plan.out_shape {
        return Err(Error::Shape(format!(
            "internal: output shape {} does not match the plan's {}",
            fmt_shape(&lc.shape),
            fmt_shape(&plan.out_shape)
        )));
    }
    let problems = shape::packed_problems(&plan, la, lb, lc, offs);
    // SAFETY: the problems come from `packed_problems` on the layouts of the memory
    // behind `pa`, `pb` (views borrowed by our callers for the whole call) and `pc`
    // (an array or mutable view of shape `plan.out_shape`, borrowed mutably, so
    // non-overlapping per `check_out`/fresh allocation and not aliasing the inputs).
    unsafe { cpu::run_packed(&problems, pa, pb, pc) };
    Ok(())
}

// ---------------------------------------------------------------------------------
// Packed forms
// ---------------------------------------------------------------------------------

/// Grouped matrix multiply of a packed form: `[T,K]×[G,K,N]`, `[M,T]×[T,N]`,
/// `[G,M,K]×[K,N]` (each with `offs`) or `[G,M,K]×[G,K,N]` (without).
///
/// The form follows from the dimensions of `a` and `b` (see the [module docs](self)).
/// `offs` gives the cumulative end of each group along the grouped dimension.
/// Returns a fresh row-major array.
///
/// # Errors
/// [`Error::Shape`] when the dimensions do not make a form, `offs` is missing, present
/// for the batched form, or of the wrong length; [`Error::Value`] when `offs` is
/// negative, decreasing or past the grouped extent. Messages name the argument.
///
/// # Example
/// MoE experts: 5 tokens routed to 2 experts (tokens `0..2` to expert 0, `2..5` to
/// expert 1).
/// ```
/// use groupmm::api::grouped_mm;
/// use ndarray::{array, aview1};
///
/// let x = array![[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0], [0.0, 2.0]]; // [T=5, K=2]
/// let w = array![[[1.0, 2.0], [3.0, 4.0]], [[0.0, 1.0], [1.0, 0.0]]]; // [G=2, K=2, N=2]
/// let y = grouped_mm(x.view(), w.view(), Some(aview1(&[2, 5])))?;
/// assert_eq!(
///     y,
///     array![[1.0, 2.0], [3.0, 4.0], [1.0, 1.0], [0.0, 2.0], [2.0, 0.0]].into_dyn()
/// );
/// # Ok::<(), groupmm::Error>(())
/// ```
pub fn grouped_mm<T: Element, DA: Dimension, DB: Dimension>(
    a: ArrayView<'_, T, DA>,
    b: ArrayView<'_, T, DB>,
    offs: Option<ArrayView1<'_, i32>>,
) -> Result<ArrayD<T>> {
    grouped_mm_to::<T, T, DA, DB>(a, b, offs)
}

/// [`grouped_mm`] with a separate output type `TO`, e.g. bfloat16 inputs and a float32
/// output (`out_dtype=torch.float32`). Accumulation is in f64 only when `TI` and `TO`
/// are both `f64`; every other pair converts the inputs to f32 and accumulates in f32
/// (so `f64 -> f32` rounds the inputs first; `f32 -> f64` is an f32 product widened).
///
/// ```
/// use groupmm::api::grouped_mm_to;
/// use half::f16;
/// use ndarray::Array3;
///
/// let a = Array3::from_elem((2, 3, 4), f16::from_f32(0.25));
/// let b = Array3::from_elem((2, 4, 1), f16::from_f32(1.0));
/// let y = grouped_mm_to::<f16, f32, _, _>(a.view(), b.view(), None)?; // batched
/// assert_eq!(y.shape(), &[2, 3, 1]);
/// assert!(y.iter().all(|&v| v == 1.0));
/// # Ok::<(), groupmm::Error>(())
/// ```
pub fn grouped_mm_to<TI: Element, TO: Element, DA: Dimension, DB: Dimension>(
    a: ArrayView<'_, TI, DA>,
    b: ArrayView<'_, TI, DB>,
    offs: Option<ArrayView1<'_, i32>>,
) -> Result<ArrayD<TO>> {
    let offs = offs_vec(offs);
    let plan = plan(&a, &b, offs.as_deref())?;
    let mut out = zeros::<TO>(&plan.out_shape);
    let lc = Layout::new(out.shape(), out.strides());
    run_packed(
        (&layout(&a), a.as_ptr()),
        (&layout(&b), b.as_ptr()),
        offs.as_deref(),
        (&lc, out.as_mut_ptr()),
    )?;
    Ok(out)
}

/// [`grouped_mm_to`] writing into a caller's array or view `out` (any strides that do
/// not overlap, e.g. a slice of a larger buffer or a transposed view).
///
/// Everything is validated before anything is written: on error `out` is untouched.
///
/// # Errors
/// As [`grouped_mm`], plus [`Error::Shape`] naming `out` when its shape differs from
/// the product's or its memory overlaps itself.
///
/// ```
/// use groupmm::api::grouped_mm_into;
/// use ndarray::{aview1, s, Array2};
///
/// let a = Array2::<f64>::ones((3, 6)); // [M, T]
/// let b = Array2::<f64>::ones((6, 2)); // [T, N]
/// let mut buf = ndarray::Array3::<f64>::zeros((2, 3, 4)); // write into columns 0..2
/// grouped_mm_into(a.view(), b.view(), Some(aview1(&[1, 6])), buf.slice_mut(s![.., .., ..2]))?;
/// assert_eq!(buf[[0, 0, 0]], 1.0); // group 0 sums t in 0..1
/// assert_eq!(buf[[1, 2, 1]], 5.0); // group 1 sums t in 1..6
/// assert_eq!(buf[[1, 2, 3]], 0.0); // untouched
/// # Ok::<(), groupmm::Error>(())
/// ```
pub fn grouped_mm_into<TI: Element, TO: Element, DA: Dimension, DB: Dimension, DC: Dimension>(
    a: ArrayView<'_, TI, DA>,
    b: ArrayView<'_, TI, DB>,
    offs: Option<ArrayView1<'_, i32>>,
    mut out: ArrayViewMut<'_, TO, DC>,
) -> Result<()> {
    let offs = offs_vec(offs);
    let plan = plan(&a, &b, offs.as_deref())?;
    let lc = layout_mut(&out);
    shape::check_out("out", &lc, &plan.out_shape)?;
    run_packed(
        (&layout(&a), a.as_ptr()),
        (&layout(&b), b.as_ptr()),
        offs.as_deref(),
        (&lc, out.as_mut_ptr()),
    )
}

/// Backward of [`grouped_mm`]: given `grad = ∂L/∂out`, returns `(∂L/∂a, ∂L/∂b)` with
/// `dA = grad·bᵀ` and `dB = aᵀ·grad` per group (each `None` unless `need_a` /
/// `need_b`). Gradients have the shapes of `a` and `b`; rows or columns past the last
/// offset get zero gradient.
///
/// # Errors
/// As [`grouped_mm`] for `a`, `b`, `offs`, plus [`Error::Shape`] naming `grad` when its
/// shape is not the forward output's.
///
/// # Example
/// ```
/// use groupmm::api::{grouped_mm, grouped_mm_backward};
/// use ndarray::{array, aview1, Array2};
///
/// let x = array![[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]; // [T=3, K=2]
/// let w = array![[[1.0], [1.0]], [[2.0], [0.0]]]; // [G=2, K=2, N=1]
/// let offs = aview1(&[1, 2]); // token 2 is past the last group
/// let y = grouped_mm(x.view(), w.view(), Some(offs))?;
/// assert_eq!(y, array![[3.0], [6.0], [0.0]].into_dyn());
///
/// let grad = Array2::<f64>::ones((3, 1));
/// let (dx, dw) = grouped_mm_backward(grad.view(), x.view(), w.view(), Some(offs), true, true)?;
/// assert_eq!(dx.unwrap(), array![[1.0, 1.0], [2.0, 0.0], [0.0, 0.0]].into_dyn());
/// assert_eq!(dw.unwrap(), array![[[1.0], [2.0]], [[3.0], [4.0]]].into_dyn());
/// # Ok::<(), groupmm::Error>(())
/// ```
pub fn grouped_mm_backward<T: Element, DG: Dimension, DA: Dimension, DB: Dimension>(
    grad: ArrayView<'_, T, DG>,
    a: ArrayView<'_, T, DA>,
    b: ArrayView<'_, T, DB>,
    offs: Option<ArrayView1<'_, i32>>,
    need_a: bool,
    need_b: bool,
) -> Result<Grads<ArrayD<T>>> {
    grouped_mm_backward_to::<T, T, DG, DA, DB>(grad, a, b, offs, need_a, need_b)
}

/// [`grouped_mm_backward`] with a separate gradient type `TO` (e.g. bfloat16
/// activations and weights, float32 gradients).
///
/// ```
/// use groupmm::api::grouped_mm_backward_to;
/// use half::bf16;
/// use ndarray::Array3;
///
/// let a = Array3::from_elem((2, 3, 4), bf16::ONE); // [G, M, K]
/// let b = Array3::from_elem((2, 4, 5), bf16::ONE); // [G, K, N]
/// let grad = Array3::from_elem((2, 3, 5), bf16::ONE);
/// let (da, db) = grouped_mm_backward_to::<bf16, f32, _, _, _>(
///     grad.view(), a.view(), b.view(), None, true, false)?;
/// assert!(da.unwrap().iter().all(|&v| v == 5.0) && db.is_none());
/// # Ok::<(), groupmm::Error>(())
/// ```
pub fn grouped_mm_backward_to<
    TI: Element,
    TO: Element,
    DG: Dimension,
    DA: Dimension,
    DB: Dimension,
>(
    grad: ArrayView<'_, TI, DG>,
    a: ArrayView<'_, TI, DA>,
    b: ArrayView<'_, TI, DB>,
    offs: Option<ArrayView1<'_, i32>>,
    need_a: bool,
    need_b: bool,
) -> Result<Grads<ArrayD<TO>>> {
    let offs = offs_vec(offs);
    let offs = offs.as_deref();
    let fwd = plan(&a, &b, offs)?;
    let (lg, la, lb) = (layout(&grad), layout(&a), layout(&b));
    check_grad("grad", &lg, &fwd.out_shape)?;
    let [(ga, gb), (ha, hb)] = shape::backward_layouts(&lg, &la, &lb);
    let da = if need_a {
        // dA = grad · bᵀ
        let mut da = zeros::<TO>(a.shape());
        let lc = Layout::new(da.shape(), da.strides());
        run_packed(
            (&ga, grad.as_ptr()),
            (&gb, b.as_ptr()),
            offs,
            (&lc, da.as_mut_ptr()),
        )?;
        Some(da)
    } else {
        None
    };
    let db = if need_b {
        // dB = aᵀ · grad
        let mut db = zeros::<TO>(b.shape());
        let lc = Layout::new(db.shape(), db.strides());
        run_packed(
            (&ha, a.as_ptr()),
            (&hb, grad.as_ptr()),
            offs,
            (&lc, db.as_mut_ptr()),
        )?;
        Some(db)
    } else {
        None
    };
    Ok((da, db))
}

/// The upstream gradient must have the forward output's shape (any strides, including
/// broadcast zero strides, are fine for an input).
fn check_grad(arg: &str, grad: &Layout, expected: &[usize]) -> Result<()> {
    if grad.shape != expected {
        return Err(Error::Shape(format!(
            "{arg}: expected shape {} (the output of the forward), found {}",
            fmt_shape(expected),
            fmt_shape(&grad.shape)
        )));
    }
    Ok(())
}

fn fixed<T, D: Dimension>(out: ArrayD<T>) -> Array<T, D> {
    out.into_dimensionality::<D>()
        .expect("the plan's output rank is fixed by the form")
}

/// `[T, K] × [G, K, N] → [T, N]`: rows `offs[g-1]..offs[g]` of `a` use expert `b[g]`
/// (the MoE expert forward). Typed shorthand for [`grouped_mm`].
///
/// ```
/// use groupmm::api::mm_2d_3d;
/// use ndarray::{Array2, Array3};
///
/// let x = Array2::<f32>::ones((6, 4));
/// let w = Array3::<f32>::ones((3, 4, 8));
/// let y = mm_2d_3d(x.view(), w.view(), &[2, 2, 5])?; // expert 1 gets no tokens
/// assert_eq!(y.row(4).sum(), 32.0);
/// assert_eq!(y.row(5).sum(), 0.0); // past the last offset
/// # Ok::<(), groupmm::Error>(())
/// ```
pub fn mm_2d_3d<T: Element>(
    a: ArrayView2<'_, T>,
    b: ArrayView3<'_, T>,
    offs: &[i32],
) -> Result<Array2<T>> {
    grouped_mm(a, b, Some(ArrayView1::from(offs))).map(fixed::<T, Ix2>)
}

/// `[M, T] × [T, N] → [G, M, N]`: group `g` sums over `t` in `offs[g-1]..offs[g]` (the
/// per-expert weight gradient). Typed shorthand for [`grouped_mm`].
///
/// ```
/// use groupmm::api::mm_2d_2d;
/// use ndarray::Array2;
///
/// let a = Array2::<f64>::ones((2, 5));
/// let b = Array2::<f64>::ones((5, 3));
/// let y = mm_2d_2d(a.view(), b.view(), &[0, 4])?;
/// assert_eq!(y.shape(), &[2, 2, 3]);
/// assert_eq!((y[[0, 0, 0]], y[[1, 0, 0]]), (0.0, 4.0)); // empty group -> zeros
/// # Ok::<(), groupmm::Error>(())
/// ```
pub fn mm_2d_2d<T: Element>(
    a: ArrayView2<'_, T>,
    b: ArrayView2<'_, T>,
    offs: &[i32],
) -> Result<Array3<T>> {
    grouped_mm(a, b, Some(ArrayView1::from(offs))).map(fixed::<T, Ix3>)
}

/// `[G, M, K] × [K, N] → [M, N]`: columns `offs[g-1]..offs[g]` of the output use
/// `a[g]`. Typed shorthand for [`grouped_mm`].
///
/// ```
/// use groupmm::api::mm_3d_2d;
/// use ndarray::{Array2, Array3};
///
/// let a = Array3::<f64>::from_shape_fn((2, 1, 2), |(g, _, _)| g as f64 + 1.0);
/// let b = Array2::<f64>::ones((2, 4));
/// let y = mm_3d_2d(a.view(), b.view(), &[1, 3])?;
/// assert_eq!(y, ndarray::array![[2.0, 4.0, 4.0, 0.0]]);
/// # Ok::<(), groupmm::Error>(())
/// ```
pub fn mm_3d_2d<T: Element>(
    a: ArrayView3<'_, T>,
    b: ArrayView2<'_, T>,
    offs: &[i32],
) -> Result<Array2<T>> {
    grouped_mm(a, b, Some(ArrayView1::from(offs))).map(fixed::<T, Ix2>)
}

/// `[G, M, K] × [G, K, N] → [G, M, N]`: a batched product. Typed shorthand for
/// [`grouped_mm`].
///
/// ```
/// use groupmm::api::mm_3d_3d;
/// use ndarray::Array3;
///
/// let a = Array3::<f32>::ones((4, 2, 3));
/// let b = Array3::<f32>::ones((4, 3, 5));
/// let y = mm_3d_3d(a.view(), b.view())?;
/// assert!(y.iter().all(|&v| v == 3.0));
/// # Ok::<(), groupmm::Error>(())
/// ```
pub fn mm_3d_3d<T: Element>(a: ArrayView3<'_, T>, b: ArrayView3<'_, T>) -> Result<Array3<T>> {
    grouped_mm(a, b, None).map(fixed::<T, Ix3>)
}

// ---------------------------------------------------------------------------------
// List form
// ---------------------------------------------------------------------------------

/// Grouped matrix multiply of a list of independent products: `out[i] = a[i] · b[i]`
/// with `a[i]` of shape `[M_i, K_i]` and `b[i]` of `[K_i, N_i]`; every group may have
/// its own shape and any dimension may be 0 (`K_i = 0` gives zeros).
///
/// # Errors
/// [`Error::Shape`] when the lists differ in length or a pair does not fit; the message
/// names `As[i]` or `Bs[i]`.
///
/// # Example
/// ```
/// use groupmm::api::grouped_mm_list;
/// use ndarray::{array, Array2};
///
/// let a0 = array![[1.0, 2.0]];
/// let b0 = array![[3.0], [4.0]];
/// let a1 = Array2::<f64>::zeros((2, 0)); // K = 0
/// let b1 = Array2::<f64>::zeros((0, 3));
/// let out = grouped_mm_list(&[a0.view(), a1.view()], &[b0.view(), b1.view()])?;
/// assert_eq!(out[0], array![[11.0]]);
/// assert_eq!(out[1], Array2::<f64>::zeros((2, 3)));
/// # Ok::<(), groupmm::Error>(())
/// ```
pub fn grouped_mm_list<T: Element>(
    a: &[ArrayView2<'_, T>],
    b: &[ArrayView2<'_, T>],
) -> Result<Vec<Array2<T>>> {
    grouped_mm_list_to::<T, T>(a, b)
}

/// [`grouped_mm_list`] with a separate output type `TO` (e.g. bfloat16 in, float32
/// out).
///
/// ```
/// use groupmm::api::grouped_mm_list_to;
/// use half::bf16;
/// use ndarray::Array2;
///
/// let a = Array2::from_elem((2, 257), bf16::ONE);
/// let b = Array2::from_elem((257, 1), bf16::ONE);
/// let out = grouped_mm_list_to::<bf16, f32>(&[a.view()], &[b.view()])?;
/// assert_eq!(out[0][[1, 0]], 257.0); // a bfloat16 output would round it to 256
/// # Ok::<(), groupmm::Error>(())
/// ```
pub fn grouped_mm_list_to<TI: Element, TO: Element>(
    a: &[ArrayView2<'_, TI>],
    b: &[ArrayView2<'_, TI>],
) -> Result<Vec<Array2<TO>>> {
    let (la, lb) = (layouts(a), layouts(b));
    let dims = shape::plan_list(&la, &lb)?;
    let mut out: Vec<Array2<TO>> = dims
        .iter()
        .map(|d| Array2::from_elem((d.m, d.n), TO::zero()))
        .collect();
    let mut views: Vec<_> = out.iter_mut().map(|o| o.view_mut()).collect();
    run_list(&dims, (&la, a), (&lb, b), &mut views);
    drop(views);
    Ok(out)
}

/// [`grouped_mm_list_to`] writing into caller-provided views `out[i]` of shape
/// `[M_i, N_i]` (any non-overlapping strides). On error nothing is written.
///
/// # Errors
/// As [`grouped_mm_list`], plus [`Error::Shape`] naming `out` or `out[i]`.
///
/// ```
/// use groupmm::api::grouped_mm_list_into;
/// use ndarray::Array2;
///
/// let a = Array2::<f32>::from_shape_fn((2, 3), |(i, _)| i as f32); // rows of 0s and 1s
/// let b = Array2::<f32>::ones((3, 4));
/// let mut c = Array2::<f32>::zeros((4, 2)); // receives the [2, 4] result transposed
/// grouped_mm_list_into(&[a.view()], &[b.view()], &mut [c.view_mut().reversed_axes()])?;
/// assert!(c.column(0).iter().all(|&v| v == 0.0));
/// assert!(c.column(1).iter().all(|&v| v == 3.0));
/// # Ok::<(), groupmm::Error>(())
/// ```
pub fn grouped_mm_list_into<TI: Element, TO: Element>(
    a: &[ArrayView2<'_, TI>],
    b: &[ArrayView2<'_, TI>],
    out: &mut [ArrayViewMut2<'_, TO>],
) -> Result<()> {
    let (la, lb) = (layouts(a), layouts(b));
    let dims = shape::plan_list(&la, &lb)?;
    if out.len() != dims.len() {
        return Err(Error::Shape(format!(
            "out: expected a sequence of {} outputs (one per group), found {}",
            dims.len(),
            out.len()
        )));
    }
    for (i, (o, d)) in out.iter().zip(&dims).enumerate() {
        shape::check_out(format!("out[{i}]"), &layout_mut(o), &[d.m, d.n])?;
    }
    run_list(&dims, (&la, a), (&lb, b), out);
    Ok(())
}

/// Backward of [`grouped_mm_list`]: `dA[i] = grad[i] · b[i]ᵀ`, `dB[i] = a[i]ᵀ · grad[i]`
/// (each list `None` unless asked for).
///
/// # Errors
/// As [`grouped_mm_list`], plus [`Error::Shape`] naming `grad` or `grad[i]` when the
/// upstream gradients do not match the forward outputs.
///
/// # Example
/// ```
/// use groupmm::api::grouped_mm_list_backward;
/// use ndarray::array;
///
/// let a = array![[1.0, 2.0]]; // [1, 2]
/// let b = array![[3.0], [4.0]]; // [2, 1]
/// let g = array![[10.0]]; // dL/d(out) of shape [1, 1]
/// let (da, db) = grouped_mm_list_backward(&[g.view()], &[a.view()], &[b.view()], true, true)?;
/// assert_eq!(da.unwrap()[0], array![[30.0, 40.0]]);
/// assert_eq!(db.unwrap()[0], array![[10.0], [20.0]]);
/// # Ok::<(), groupmm::Error>(())
/// ```
pub fn grouped_mm_list_backward<T: Element>(
    grad: &[ArrayView2<'_, T>],
    a: &[ArrayView2<'_, T>],
    b: &[ArrayView2<'_, T>],
    need_a: bool,
    need_b: bool,
) -> Result<Grads<Vec<Array2<T>>>> {
    grouped_mm_list_backward_to::<T, T>(grad, a, b, need_a, need_b)
}

/// [`grouped_mm_list_backward`] with a separate gradient type `TO`.
///
/// ```
/// use groupmm::api::grouped_mm_list_backward_to;
/// use half::f16;
/// use ndarray::Array2;
///
/// let a = Array2::from_elem((3, 2), f16::ONE);
/// let b = Array2::from_elem((2, 4), f16::ONE);
/// let g = Array2::from_elem((3, 4), f16::ONE);
/// let (_, db) = grouped_mm_list_backward_to::<f16, f64>(&[g.view()], &[a.view()], &[b.view()], false, true)?;
/// assert!(db.unwrap()[0].iter().all(|&v| v == 3.0));
/// # Ok::<(), groupmm::Error>(())
/// ```
pub fn grouped_mm_list_backward_to<TI: Element, TO: Element>(
    grad: &[ArrayView2<'_, TI>],
    a: &[ArrayView2<'_, TI>],
    b: &[ArrayView2<'_, TI>],
    need_a: bool,
    need_b: bool,
) -> Result<Grads<Vec<Array2<TO>>>> {
    let (la, lb, lg) = (layouts(a), layouts(b), layouts(grad));
    let dims = shape::plan_list(&la, &lb)?;
    if lg.len() != dims.len() {
        return Err(Error::Shape(format!(
            "grad: expected a sequence of {} gradients (one per output), found {}",
            dims.len(),
            lg.len()
        )));
    }
    for (i, (g, d)) in lg.iter().zip(&dims).enumerate() {
        check_grad(&format!("grad[{i}]"), g, &[d.m, d.n])?;
    }
    let mut bl: [(Vec<Layout>, Vec<Layout>); 2] = Default::default();
    for ((g, la), lb) in lg.iter().zip(&la).zip(&lb) {
        let [(ga, gb), (ha, hb)] = shape::backward_layouts(g, la, lb);
        bl[0].0.push(ga);
        bl[0].1.push(gb);
        bl[1].0.push(ha);
        bl[1].1.push(hb);
    }
    let run_one = |(xl, yl): &(Vec<Layout>, Vec<Layout>),
                   x: &[ArrayView2<'_, TI>],
                   y: &[ArrayView2<'_, TI>]|
     -> Result<Vec<Array2<TO>>> {
        let dims = shape::plan_list(xl, yl)?;
        let mut out: Vec<Array2<TO>> = dims
            .iter()
            .map(|d| Array2::from_elem((d.m, d.n), TO::zero()))
            .collect();
        let mut views: Vec<_> = out.iter_mut().map(|o| o.view_mut()).collect();
        run_list(&dims, (xl, x), (yl, y), &mut views);
        drop(views);
        Ok(out)
    };
    let da = if need_a {
        Some(run_one(&bl[0], grad, b)?)
    } else {
        None
    };
    let db = if need_b {
        Some(run_one(&bl[1], a, grad)?)
    } else {
        None
    };
    Ok((da, db))
}

fn layouts<T>(v: &[ArrayView2<'_, T>]) -> Vec<Layout> {
    v.iter().map(layout).collect()
}

/// Runs a validated list product: group `i` reads `x[i]` (layout `xl[i]`) and `y[i]`
/// (layout `yl[i]`) and writes `out[i]`, which has shape `[dims[i].m, dims[i].n]`.
fn run_list<TI: Element, TO: Element>(
    dims: &[shape::GroupDims],
    (xl, x): (&[Layout], &[ArrayView2<'_, TI>]),
    (yl, y): (&[Layout], &[ArrayView2<'_, TI>]),
    out: &mut [ArrayViewMut2<'_, TO>],
) {
    let cl: Vec<Layout> = out.iter().map(layout_mut).collect();
    let problems = shape::list_problems(dims, xl, yl, &cl);
    let px: Vec<*const TI> = x.iter().map(|v| v.as_ptr()).collect();
    let py: Vec<*const TI> = y.iter().map(|v| v.as_ptr()).collect();
    let pc: Vec<*mut TO> = out.iter_mut().map(|v| v.as_mut_ptr()).collect();
    // SAFETY: `problems` come from `list_problems` on the layouts of exactly these
    // views (the layouts were taken from them, and `dims` from `plan_list` on the input
    // layouts, with every output of shape `[m_i, n_i]`). The input views stay borrowed
    // for the call; each output is a distinct `&mut` view (so outputs cannot alias one
    // another or any input) that is non-overlapping by construction or by `check_out`.
    unsafe { cpu::run_list(&problems, &px, &py, &pc) };
}
