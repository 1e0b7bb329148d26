//! The products of the MoE layer beyond the plain packed forms, as one rule
//! ([`plan_product`]): a GroupedM product over routed rows, alone or with an epilogue that
//! does the glue around it (the fused expert products), or a GroupedK product over them
//! (the weight gradient), each reading its routed rows in order or through the routed-row
//! index `src`. The engine (`crate::exec::product`) runs them; what each epilogue computes,
//! element by element: the bridge's `Fusion` (src/exec/ffi.rs). Dtype and device agreement
//! by [`super::check_like`] and [`check_f32`], which the engine applies first.
//!
//! | request ([`Form`], epilogue) | operands | product | outputs |
//! | --- | --- | --- | --- |
//! | `gather_mm` (GroupedM, plain) | `x [T, K]`, `w [G, K, N]`, `src [R]` | `x[src] · w[g]` | `[R, N]` |
//! | `product` (GroupedM, a rule of [`EPILOGUES`]) | `x [T, K]` (or `dy`), `w`, `src [R]`, the rule's operands | the rule's (`a · w[g]`, or `a · w[g]ᵀ`) | the rule's outputs |
//! | `gather_k_mm` (GroupedK, plain) | `a [Ta, K]`, `b [Tb, N]`, `src [R]` gathering one of them | `Σ a_rᵀ · b_r` per group | `[G, K, N]` |
//!
//! `src` absent: `R` is the rows of the first operand, read in order. `offs` (1-D,
//! [`super::offs_len`]) holds the group ends over the `R` rows; rows past its last entry
//! are zeros in every output (GroupedK: belong to no group). `src` values are never a
//! shape error (the row ops' rule, [`super::check_indices`], on the host).
//!
//! The rule of each request lives in `rules`, each epilogue's entry in `epilogues`; this
//! module holds the request, its extents and the dispatch between the rules.

mod epilogues;
mod rules;

pub use epilogues::{check_operands, epilogue, EPILOGUES};

use super::epilogue::{EpilogueRule, EpilogueShapes};
use super::{Epilogue, Form, PackedDims};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;
use rules::{grouped_k, grouped_m};
use std::fmt::Display;

/// The columns of `p` that one row of `DGated`'s `partial` output sums (its rows are
/// `⌈F / PARTIAL_COLS⌉` column chunks; the router weight's gradient of row `r` is the
/// sum of `partial[.., r]`).
pub const PARTIAL_COLS: usize = 64;

/// Which operand of a product the routed-row index `src` gathers: routed row `r` of it
/// is its row `src[r]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Gathered {
    /// The first operand (`a`, `x`, `dy`).
    A,
    /// The second (`b`; GroupedK only).
    B,
}

/// A product request as the rules see it (the engine's request reduced to layouts).
#[derive(Debug, Clone, Copy)]
pub struct ProductShape<'a> {
    /// GroupedM (groups along the routed rows: `gather_mm`, `product`) or GroupedK (groups along the reduction over them: `gather_k_mm`).
    pub form: Form,
    /// The first operand.
    pub a: &'a Layout,
    /// The second operand.
    pub b: &'a Layout,
    /// The length of `offs`.
    pub offs_len: usize,
    /// The routed-row index and the operand it gathers; absent: the rows in order.
    pub src: Option<(&'a Layout, Gathered)>,
    /// The epilogue (GroupedM only) and its operands.
    pub epilogue: Epilogue<&'a Layout>,
    /// GroupedK only: the result computed transposed, `(Σ b_rᵀ · a_r)ᵀ`.
    pub transposed: bool,
}

/// The extents of a validated product request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProductDims {
    /// The epilogue's rule; `None`: a plain product.
    pub epilogue: Option<&'static EpilogueRule>,
    /// The product that runs: GroupedM over the `R` rows (`m = R`; with an epilogue its
    /// rule's), or GroupedK over them (`k = R`; transposed: `[N, R] · [R, K]`, whose
    /// output's transposed view is the result).
    pub product: PackedDims,
    /// `F`: the epilogue rule's column count (the outputs' shapes); 0 without one.
    pub f: usize,
}

impl ProductDims {
    /// The shapes of an epilogue's outputs, in the order the op returns them (its rule's
    /// `outputs`). None where the one output is the product's (`product.out_shape`).
    pub fn out_shapes(&self) -> Vec<[usize; 2]> {
        let (r, f) = (self.product.m, self.f);
        let outputs = self.epilogue.map_or(&[][..], |e| e.outputs);
        outputs.iter().map(|o| (o.shape)(r, f)).collect()
    }

    /// An epilogue product none of whose outputs has an element (no routed rows, e.g. an
    /// expert-parallel rank that received none, or no columns: `F = 0`): nothing to
    /// compute, no kernel to ask. A plain product always runs.
    pub fn is_empty(&self) -> bool {
        let p = &self.product;
        self.epilogue.is_some() && (p.m == 0 || p.n == 0)
    }
}

/// The names of a product's two operands in messages, as the faces call them:
/// `gather_k_mm`'s `a`, `b`; `gather_mm`'s `x`, `w`; an epilogue's its rule's `a`
/// (`x`, `dy`) and `w`.
pub fn operand_names<T>(form: Form, epilogue: &Epilogue<T>) -> [&'static str; 2] {
    match form {
        Form::GroupedK => ["a", "b"],
        _ => [epilogue.a_name(), "w"],
    }
}

/// Validates a product request and returns its extents: the GroupedM rule of the
/// gathered rows (`x [T, K]`, `w [G, K, N]`, `src [R]`; with an epilogue its rule's,
/// [`EPILOGUES`]), or the GroupedK rule (`a`, `b` 2-D, the operand read in order with
/// `R = len(src)` rows, the gathered one any number). Names in messages are the faces'
/// ([`operand_names`]).
pub fn plan_product(p: &ProductShape<'_>) -> Result<ProductDims> {
    let epilogue = p.epilogue.rule;
    let (product, f) = match (p.form, p.src, p.transposed) {
        (Form::GroupedK, Some((src, gathered)), transposed) if epilogue.is_none() => {
            let gathered_b = gathered == Gathered::B;
            (
                grouped_k(p.a, p.b, src, p.offs_len, gathered_b, transposed)?,
                0,
            )
        }
        (Form::GroupedM, None | Some((_, Gathered::A)), false) => {
            let src = p.src.map(|(s, _)| s);
            match epilogue {
                None => (grouped_m(p.a, p.b, src, p.offs_len)?, 0),
                Some(e) => {
                    epilogues::check_operands(e, &p.epilogue.operands)?;
                    (e.plan)(&EpilogueShapes {
                        a: p.a,
                        b: p.b,
                        operands: &p.epilogue.operands,
                        src,
                        offs_len: p.offs_len,
                    })?
                }
            }
        }
        _ => {
            return Err(Error::Type(format!(
                "internal: no product rule for {:?} with {epilogue:?}, src {:?}, transposed {}",
                p.form,
                p.src.map(|(_, g)| g),
                p.transposed
            )))
        }
    };
    Ok(ProductDims {
        epilogue,
        product,
        f,
    })
}

/// An operand the kernels read as float32 only (an epilogue's `scale`); `what` says
/// what it is.
pub fn check_f32(arg: impl Display, found: DType, what: &str) -> Result<()> {
    if found != DType::F32 {
        return Err(Error::Dtype(format!(
            "{arg}: expected dtype torch.float32 ({what}), found {}",
            found.torch_name()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
