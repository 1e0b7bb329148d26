//! Where a product writes `c`: the caller's `out` itself where the kernels write it as it
//! is, else a fresh output, copied into `out` (when given) after the product ran.

use crate::dtype::DType;
use crate::error::Result;
use crate::exec::cuda;
use crate::exec::operands::writes_in_place;
use crate::exec::vocab::{Device, Output, Runtime, Tensor};
use crate::layout::Transposable;
use crate::shape::Form;

/// Where `c` is written: the caller's `out` itself, or a fresh output (copied into the
/// caller's `out`, when given, after the product ran).
pub(super) enum Target<O> {
    Out(O),
    Fresh(O, Option<O>),
}

impl<O> Target<O> {
    /// `out` where the kernels write it as it is (its transposed view when the product
    /// runs transposed; [`writes_as_is`]), else a fresh output of `shape`; with the
    /// description of what the product writes.
    pub(super) fn new<R: Runtime<Out = O>>(
        rt: &mut R,
        out: Option<Output<O>>,
        (form, transposed): (Form, bool),
        shape: &[usize],
        (dtype, device): (DType, Device),
    ) -> Result<(Self, Tensor)> {
        let out = match out {
            Some((o, t)) => {
                let t = if transposed { t.transposed() } else { t };
                if writes_as_is(form, &t) {
                    return Ok((Target::Out(o), t));
                }
                Some(o)
            }
            None => None,
        };
        let (fresh, c) = rt.alloc(shape, dtype, device)?;
        Ok((Target::Fresh(fresh, out), c))
    }

    /// The output the caller gets, as it is: nothing ran (no element to write).
    pub(super) fn unwritten(self) -> O {
        match self {
            Target::Out(o) | Target::Fresh(_, Some(o)) | Target::Fresh(o, None) => o,
        }
    }

    /// The output the caller gets after the product ran: `out`, or the fresh output
    /// (its transposed view when the product ran transposed), copied into `out` if given.
    pub(super) fn finish<R: Runtime<Out = O>>(self, rt: &mut R, transposed: bool) -> Result<O> {
        let Target::Fresh(fresh, out) = self else {
            return Ok(self.unwritten());
        };
        let fresh = if transposed {
            rt.transposed(fresh)?
        } else {
            fresh
        };
        match out {
            Some(o) => {
                rt.copy_into(&o, &fresh)?;
                Ok(o)
            }
            None => Ok(fresh),
        }
    }
}

/// True when the product writes `c` as it is: any layout on the CPU; on CUDA, GroupedK
/// any layout the kernels describe as row-major ([`cuda::operand`]: unit column stride,
/// rows and groups apart), e.g. a slab of the rows or columns of a larger contiguous
/// gradient; else contiguous.
fn writes_as_is(form: Form, c: &Tensor) -> bool {
    match (form, c.device) {
        (Form::GroupedK, Device::Cuda(_)) => cuda::operand(c).is_some_and(|o| !o.col_major),
        _ => writes_in_place(c),
    }
}
