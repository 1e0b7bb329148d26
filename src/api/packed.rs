//! The packed forms on ndarray views (see the [module docs](super)): forward, into a
//! caller's view, backward, and the typed shorthands of each form.

use super::{desc, fixed, fresh, offs_desc, out_desc, Fresh, Grads, Owned};
use crate::dtype::Element;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::exec::{self, Output};
use ndarray::{
    Array2, Array3, ArrayD, ArrayView, ArrayView1, ArrayView2, ArrayView3, ArrayViewMut, Dimension,
    Ix2, Ix3,
};

/// Grouped matrix multiply of a packed form: `[T,K]×[G,K,N]`, `[M,T]×[T,N]`,
/// `[G,M,K]×[K,N]` (each with `offs`) or `[G,M,K]×[G,K,N]` (without).
///
/// The form follows from the dimensions of `a` and `b` (see the [module docs](super)).
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
    fresh(packed(a, b, offs, None)?)
}

/// The packed product into `out` (a caller's view), or into a fresh array (`None`).
fn packed<TI: Element, TO: Element, DA: Dimension, DB: Dimension>(
    a: ArrayView<'_, TI, DA>,
    b: ArrayView<'_, TI, DB>,
    offs: Option<ArrayView1<'_, i32>>,
    out: Option<Output<Fresh<TO>>>,
) -> Result<Fresh<TO>> {
    let (a, b, offs) = (desc(&a), desc(&b), offs_desc(&offs));
    // SAFETY: the descriptions are of the borrowed views, live for the call (a caller's
    // `out` is borrowed mutably, so no input aliases it); fresh outputs are allocated
    // by `Owned`.
    unsafe {
        exec::packed(
            &mut Owned::<TO>::new(),
            &a,
            &b,
            offs.as_ref(),
            Some(TO::DTYPE),
            out,
        )
    }
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
    packed(a, b, offs, Some(out_desc(&mut out))).map(drop)
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
    let (grad, a, b, offs) = (desc(&grad), desc(&a), desc(&b), offs_desc(&offs));
    // SAFETY: the descriptions are of the borrowed views, live for the call; outputs are
    // allocated by `Owned`.
    let (da, db) = unsafe {
        exec::packed_backward(
            &mut Owned::<TO>::new(),
            &grad,
            &a,
            &b,
            offs.as_ref(),
            need_a,
            need_b,
            Some(TO::DTYPE),
        )?
    };
    Ok((da.map(fresh).transpose()?, db.map(fresh).transpose()?))
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
