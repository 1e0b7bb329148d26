//! The Rust API on `ndarray`: forward and backward of every grouped form, without
//! Python.
//!
//! Inputs are views of any layout (slices, transposed views, negative or zero
//! strides); they are read in place, never copied. Outputs are freshly allocated
//! row-major arrays, or a caller's mutable view for the `*_into` functions. Every call
//! runs through the same engine and the same rules ([`crate::shape`]) as the Python
//! package, so the accepted shapes and the error messages are the same.
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

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::exec::{self, Device, IntTensor, Output, Runtime, Tensor};
use crate::layout::Layout;
use ndarray::{
    Array, Array2, Array3, ArrayD, ArrayView, ArrayView1, ArrayView2, ArrayView3, ArrayViewMut,
    ArrayViewMut2, Dimension, Ix2, Ix3, IxDyn,
};
use std::marker::PhantomData;

/// The gradients of a backward call: `(dA, dB)`, each `None` unless it was asked for.
pub type Grads<A> = (Option<A>, Option<A>);

/// The engine's view of a host array of `T` at `ptr`.
fn cpu_tensor<T: Element>(ptr: usize, shape: &[usize], strides: &[isize]) -> Tensor {
    Tensor {
        ptr,
        dtype: T::DTYPE,
        layout: Layout::new(shape, strides),
        device: Device::Cpu,
        id: 0,
        transposed: false,
    }
}

/// The engine's view of an input array (read in place, never copied).
fn desc<T: Element, D: Dimension>(v: &ArrayView<'_, T, D>) -> Tensor {
    cpu_tensor::<T>(v.as_ptr() as usize, v.shape(), v.strides())
}

/// The engine's view of a caller's output, which it writes in place.
fn out_desc<T: Element, D: Dimension>(v: &mut ArrayViewMut<'_, T, D>) -> Output<Fresh<T>> {
    let t = cpu_tensor::<T>(v.as_mut_ptr() as usize, v.shape(), v.strides());
    (None, t)
}

fn descs<T: Element>(v: &[ArrayView2<'_, T>]) -> Vec<Tensor> {
    v.iter().map(desc).collect()
}

fn offs_desc(offs: &Option<ArrayView1<'_, i32>>) -> Option<IntTensor> {
    offs.as_ref().map(|o| IntTensor {
        ptr: o.as_ptr() as usize,
        layout: Layout::new(o.shape(), o.strides()),
        device: Device::Cpu,
        id: 0,
        int32: true,
    })
}

/// An output the engine allocated (`Some`), or a caller's view it wrote (`None`).
type Fresh<T> = Option<ArrayD<T>>;

/// The runtime of this face: fresh zero-filled row-major arrays of `TO`; the CPU kernels
/// run on the calling thread's rayon pool.
struct Owned<TO>(PhantomData<TO>);

impl<TO: Element> Owned<TO> {
    fn new() -> Self {
        Owned(PhantomData)
    }
}

impl<TO: Element> Runtime for Owned<TO> {
    type Out = Fresh<TO>;

    fn alloc(
        &mut self,
        shape: &[usize],
        dtype: DType,
        device: Device,
    ) -> Result<Output<Fresh<TO>>> {
        if dtype != TO::DTYPE || device != Device::Cpu {
            return Err(Error::Type(format!(
                "internal: the ndarray API allocates {} on cpu, asked for {} on {device}",
                TO::DTYPE.torch_name(),
                dtype.torch_name()
            )));
        }
        let mut a = ArrayD::from_elem(IxDyn(shape), TO::zero());
        let (_, t) = out_desc(&mut a.view_mut());
        Ok((Some(a), t))
    }
}

/// The array the engine allocated for an output.
fn fresh<T>(out: Fresh<T>) -> Result<ArrayD<T>> {
    out.ok_or_else(|| Error::Type("internal: no output array".into()))
}

fn fresh2<T>(out: Fresh<T>) -> Result<Array2<T>> {
    fresh(out).map(fixed::<T, Ix2>)
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
