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

mod list;
mod packed;

pub use list::{
    grouped_mm_list, grouped_mm_list_backward, grouped_mm_list_backward_to, grouped_mm_list_into,
    grouped_mm_list_to,
};
pub use packed::{
    grouped_mm, grouped_mm_backward, grouped_mm_backward_to, grouped_mm_into, grouped_mm_to,
    mm_2d_2d, mm_2d_3d, mm_3d_2d, mm_3d_3d,
};

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::exec::{Device, IntTensor, Output, Runtime, Tensor};
use crate::layout::Layout;
use ndarray::{
    Array, Array2, ArrayD, ArrayView, ArrayView1, ArrayView2, ArrayViewMut, Dimension, Ix2, IxDyn,
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

fn fixed<T, D: Dimension>(out: ArrayD<T>) -> Array<T, D> {
    out.into_dimensionality::<D>()
        .expect("the plan's output rank is fixed by the form")
}
