//! A product request as a face asks it, and its outputs.

use crate::dtype::DType;
use crate::exec::vocab::{IntTensor, Output, Tensor};
use crate::shape::{Epilogue, Form, Gathered};

/// One product of the MoE layer as a face asks it (built on the stack, per call).
#[derive(Debug)]
pub struct ProductRequest<'a, O> {
    /// GroupedM (groups along the routed rows: `gather_mm`, `product`) or GroupedK (groups along the reduction over them: `gather_k_mm`).
    pub form: Form,
    /// The first operand: `x`, an epilogue's (its rule's `a`, e.g. `dy`) or `a`
    /// (GroupedK); every other operand has its device and, but `offs`, `src` and the
    /// epilogue's float32 ones, its dtype.
    pub a: &'a Tensor,
    /// The second: `w` (read transposed, in place, where the epilogue's rule says so) or
    /// `b` (GroupedK).
    pub b: &'a Tensor,
    /// int32 `[G]`, the group ends over the routed rows.
    pub offs: &'a IntTensor,
    /// The routed-row index (any integer dtype, converted to int32 once) and the operand
    /// it gathers; absent: the rows in order.
    pub src: Option<(&'a IntTensor, Gathered)>,
    /// The epilogue with its operands (GroupedM only).
    pub epilogue: Epilogue<&'a Tensor>,
    /// GroupedK only: the same values computed as `(Σ b_rᵀ · a_r)ᵀ`, the transposed view
    /// of a fresh contiguous `[G, N, K]` (the gradient of a column-major weight in its own
    /// layout, as `packed_backward` gives it).
    pub transposed: bool,
    /// The dtype of `c` (default: `a`'s).
    pub out_dtype: Option<DType>,
    /// Written instead of a fresh `c` (checked as every output is,
    /// [`check_out`](crate::exec::operands::check_out); it may be an epilogue operand
    /// whose rule says so,
    /// [`shape::check_same_or_disjoint`](crate::shape::check_same_or_disjoint)) and
    /// returned in its place: in place wherever the kernels can write it as it is
    /// (GroupedK: any row-major layout, e.g. a slab of a larger gradient; else contiguous),
    /// else through a fresh output copied into it after the product ran.
    pub out: Option<Output<O>>,
}

impl<'a, O> ProductRequest<'a, O> {
    /// The plain product of `form` over `a`, `b` and `offs`, the rows in order, a fresh
    /// output of `a`'s dtype: the base that a face's request updates.
    pub fn new(form: Form, a: &'a Tensor, b: &'a Tensor, offs: &'a IntTensor) -> Self {
        ProductRequest {
            form,
            a,
            b,
            offs,
            src: None,
            epilogue: Epilogue::plain(),
            transposed: false,
            out_dtype: None,
            out: None,
        }
    }
}

/// The outputs of a product: `c` (the product; with an epilogue that lists outputs, its
/// first), then the epilogue's others in its rule's order (e.g. `act`, `partial`); fresh
/// and contiguous but an `out` given.
#[derive(Debug)]
pub struct Outputs<O> {
    /// The product, or the epilogue's first output.
    pub c: O,
    /// The epilogue's other outputs (its rule's `outputs[1..]`).
    pub rest: Vec<O>,
}

impl<O> Outputs<O> {
    pub(super) fn new(c: O, rest: Vec<Output<O>>) -> Self {
        Outputs {
            c,
            rest: rest.into_iter().map(|(o, _)| o).collect(),
        }
    }

    /// Every output, `c` first.
    pub fn all(self) -> Vec<O> {
        std::iter::once(self.c).chain(self.rest).collect()
    }
}
