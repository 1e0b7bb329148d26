//! The list form on ndarray views (see the [module docs](super)): forward, into a
//! caller's views, backward.

use super::{descs, fresh2, out_desc, Fresh, Grads, Owned};
use crate::dtype::Element;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::exec::{self, Output};
use ndarray::{Array2, ArrayView2, ArrayViewMut2};

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
    // SAFETY: the descriptions are of the borrowed views, live for the call; outputs are
    // allocated by `Owned`.
    let out = unsafe {
        exec::list(
            &mut Owned::<TO>::new(),
            &descs(a),
            &descs(b),
            Some(TO::DTYPE),
            None,
        )?
    };
    out.into_iter().map(fresh2).collect()
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
    let outs: Vec<Output<Fresh<TO>>> = out.iter_mut().map(out_desc).collect();
    // SAFETY: the descriptions are of the borrowed views (outputs borrowed mutably, so
    // distinct and not aliasing an input), live for the call.
    unsafe {
        exec::list(
            &mut Owned::<TO>::new(),
            &descs(a),
            &descs(b),
            Some(TO::DTYPE),
            Some(outs),
        )?
    };
    Ok(())
}

/// Backward of [`grouped_mm_list`]: `dA[i] = grads[i] · b[i]ᵀ`,
/// `dB[i] = a[i]ᵀ · grads[i]` (each list `None` unless asked for).
///
/// # Errors
/// As [`grouped_mm_list`], plus [`Error::Shape`] naming `grads` or `grads[i]` when the
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
    grads: &[ArrayView2<'_, T>],
    a: &[ArrayView2<'_, T>],
    b: &[ArrayView2<'_, T>],
    need_a: bool,
    need_b: bool,
) -> Result<Grads<Vec<Array2<T>>>> {
    grouped_mm_list_backward_to::<T, T>(grads, a, b, need_a, need_b)
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
    grads: &[ArrayView2<'_, TI>],
    a: &[ArrayView2<'_, TI>],
    b: &[ArrayView2<'_, TI>],
    need_a: bool,
    need_b: bool,
) -> Result<Grads<Vec<Array2<TO>>>> {
    // SAFETY: the descriptions are of the borrowed views, live for the call; outputs are
    // allocated by `Owned`.
    let (da, db) = unsafe {
        exec::list_backward(
            &mut Owned::<TO>::new(),
            &descs(grads),
            &descs(a),
            &descs(b),
            need_a,
            need_b,
            Some(TO::DTYPE),
        )?
    };
    let arrays = |v: Vec<Fresh<TO>>| v.into_iter().map(fresh2).collect::<Result<Vec<_>>>();
    Ok((da.map(arrays).transpose()?, db.map(arrays).transpose()?))
}
