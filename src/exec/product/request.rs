//! A product request as a face asks it, and its outputs.

use crate::dtype::DType;
use crate::exec::vocab::{IntTensor, Output, Tensor};
use crate::shape::{Epilogue, Form, Gathered};

/// One product of the MoE layer as a face asks it (built on the stack, per call).
#[derive(Debug)]
pub struct ProductRequest<'a, O> {
    /// GroupedM (groups along the routed rows: `gather_mm`, `swiglu_mm`, `dgated_mm`) or
    /// GroupedK (groups along the reduction over them: `gather_k_mm`).
    pub form: Form,
    /// The first operand: `x`, `dy` (DGated) or `a` (GroupedK); every other operand has
    /// its device and, but `offs`, `src` and `scale`, its dtype.
    pub a: &'a Tensor,
    /// The second: `w` (DGated reads it transposed, in place) or `b` (GroupedK).
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
    /// [`check_out`](crate::exec::operands::check_out); for DGated it may be `pre` itself,
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
            epilogue: Epilogue::Plain,
            transposed: false,
            out_dtype: None,
            out: None,
        }
    }
}

/// The outputs of a product: `c` (the product; with an epilogue the pre-activation
/// `pre`, or its gradient `dpre`), then the epilogue's: `act` (SwiGLU, DGated) and
/// `partial` (DGated); fresh and contiguous but an `out` given.
#[derive(Debug)]
pub struct Outputs<O> {
    /// The product, `pre` or `dpre`.
    pub c: O,
    /// `act [R, F]`, of `c`'s dtype.
    pub act: Option<O>,
    /// float32 `partial [⌈F/64⌉, R]`.
    pub partial: Option<O>,
}

impl<O> Outputs<O> {
    pub(super) fn new(c: O, act: Option<Output<O>>, partial: Option<Output<O>>) -> Self {
        Outputs {
            c,
            act: act.map(|(o, _)| o),
            partial: partial.map(|(o, _)| o),
        }
    }
}
