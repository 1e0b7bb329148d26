//! The products of the MoE layer beyond the plain packed forms, as one rule
//! ([`plan_product`]): a GroupedM product over routed rows, alone or with an epilogue that
//! does the glue around it (the fused expert products), or a GroupedK product over them
//! (the weight gradient), each reading its routed rows in order or through the routed-row
//! index `src`. The engine (`crate::exec::product`) runs them; what each epilogue computes,
//! element by element: the bridge's `Fusion` (src/exec/ffi.rs). Dtype and device agreement
//! by [`super::check_like`] and [`check_f32`], which the engine applies first.
//!
//! | request ([`Form`], [`Epilogue`]) | operands | product | outputs |
//! | --- | --- | --- | --- |
//! | `gather_mm` (GroupedM, `Plain`) | `x [T, K]`, `w [G, K, N]`, `src [R]` | `x[src] · w[g]` | `[R, N]` |
//! | `swiglu_mm` (GroupedM, `SwiGLU`) | `x [T, K]`, `w [G, K, 2F]`, `src [R]` | `p = x[src] · w[g]`, `[R, 2F]` | `pre [R, 2F]` (`= p`), `act [R, F]` |
//! | `swiglu_mm` with `up` (GroupedM, `SwiGLU { up }`) | `x [T, K]`, `w [G, K, F]` (the gate), `up [G, K, F]`, `src [R]` | `p = x[src] · [w[g] \| up[g]]`, `[R, 2F]` | as above |
//! | `dgated_mm` (GroupedM, `DGated`) | `dy [T, D]`, `w [G, F, D]` (the down projection's), `pre [R, 2F]`, `scale [R]`, `src [R]` | `p = dy[src] · w[g]ᵀ`, `[R, F]` | `dpre [R, 2F]`, `act [R, F]`, `partial [⌈F/64⌉, R]` |
//! | `row_scaled_mm` (GroupedM, `RowScale`) | `x [T, K]`, `w [G, K, N]`, `scale [R]`, `src [R]` | `p = x[src] · w[g]` | `scale[r] · p[r]`, `[R, N]` |
//! | `gather_k_mm` (GroupedK, `Plain`) | `a [Ta, K]`, `b [Tb, N]`, `src [R]` gathering one of them | `Σ a_rᵀ · b_r` per group | `[G, K, N]` |
//!
//! `src` absent: `R` is the rows of the first operand, read in order. `offs` (1-D,
//! [`super::offs_len`]) holds the group ends over the `R` rows; rows past its last entry
//! are zeros in every output (GroupedK: belong to no group). `src` values are never a
//! shape error (the row ops' rule, [`super::check_indices`], on the host).
//!
//! The rule of each request lives in `rules`; this module holds the request, its extents
//! and the dispatch between the rules.

mod rules;

use super::{rows::gate_up_half, Epilogue, Form, PackedDims};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;
use rules::{dgated, grouped_k, grouped_m, per_row, swiglu_pair};
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
    /// GroupedM (groups along the routed rows: `gather_mm`, `swiglu_mm`, `dgated_mm`) or
    /// GroupedK (groups along the reduction over them: `gather_k_mm`).
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
    /// The epilogue's kind.
    pub epilogue: Epilogue<()>,
    /// The product that runs: GroupedM over the `R` rows (`m = R`; with an epilogue
    /// `n = 2F` for SwiGLU, `F` for DGated), or GroupedK over them (`k = R`; transposed:
    /// `[N, R] · [R, K]`, whose output's transposed view is the result).
    pub product: PackedDims,
    /// `F`: the columns of `act` (half those of the pre-activation); 0 without an
    /// epilogue.
    pub f: usize,
}

impl ProductDims {
    /// The shapes of an epilogue's outputs, in the order the op returns them: SwiGLU
    /// `pre`, `act`; DGated `dpre`, `act`, `partial`. None for a plain product, whose one
    /// output is the product's (`product.out_shape`).
    pub fn out_shapes(&self) -> Vec<[usize; 2]> {
        let (r, f) = (self.product.m, self.f);
        match self.epilogue {
            Epilogue::Plain | Epilogue::RowScale { .. } => Vec::new(),
            Epilogue::SwiGLU { .. } => vec![[r, 2 * f], [r, f]],
            Epilogue::DGated { .. } => vec![[r, 2 * f], [r, f], [f.div_ceil(PARTIAL_COLS), r]],
        }
    }

    /// An epilogue product none of whose outputs has an element (no routed rows, e.g. an
    /// expert-parallel rank that received none, or no columns: `F = 0`): nothing to
    /// compute, no kernel to ask. A plain product always runs.
    pub fn is_empty(&self) -> bool {
        let p = &self.product;
        self.epilogue != Epilogue::Plain && (p.m == 0 || p.n == 0)
    }
}

/// The names of a product's two operands in messages, as the faces call them:
/// `gather_k_mm`'s `a`, `b`; `gather_mm`'s and `swiglu_mm`'s `x`, `w`; `dgated_mm`'s
/// `dy`, `w`.
pub fn operand_names<T>(form: Form, epilogue: &Epilogue<T>) -> [&'static str; 2] {
    match (form, epilogue) {
        (Form::GroupedK, _) => ["a", "b"],
        (_, Epilogue::DGated { .. }) => ["dy", "w"],
        _ => ["x", "w"],
    }
}

/// Validates a product request and returns its extents: the GroupedM rule of the
/// gathered rows (`x [T, K]`, `w [G, K, N]`, `src [R]`; then with SwiGLU `w`'s columns
/// `[gate | up]` even, with DGated `dy [T, D]`, `w [G, F, D]`, `pre [R, 2F]`,
/// `scale [R]`), or the GroupedK rule (`a`, `b` 2-D, the operand read in order with
/// `R = len(src)` rows, the gathered one any number). Names in messages are the faces'
/// ([`operand_names`]).
pub fn plan_product(p: &ProductShape<'_>) -> Result<ProductDims> {
    let epilogue = p.epilogue.kind();
    let (product, f) = match (p.form, p.src, p.transposed) {
        (Form::GroupedK, Some((src, gathered)), transposed) if epilogue == Epilogue::Plain => {
            let gathered_b = gathered == Gathered::B;
            (
                grouped_k(p.a, p.b, src, p.offs_len, gathered_b, transposed)?,
                0,
            )
        }
        (Form::GroupedM, None | Some((_, Gathered::A)), false) => {
            let src = p.src.map(|(s, _)| s);
            match p.epilogue {
                Epilogue::Plain => (grouped_m(p.a, p.b, src, p.offs_len)?, 0),
                Epilogue::SwiGLU { up: None } => {
                    let product = grouped_m(p.a, p.b, src, p.offs_len)?;
                    (product, gate_up_half("w", &p.b.shape)?)
                }
                Epilogue::SwiGLU { up: Some(up) } => swiglu_pair(p.a, p.b, up, src, p.offs_len)?,
                Epilogue::DGated { pre, scale } => dgated(p.a, p.b, pre, scale, src, p.offs_len)?,
                Epilogue::RowScale { scale } => {
                    let product = grouped_m(p.a, p.b, src, p.offs_len)?;
                    per_row("scale", scale, product.m, src.is_some())?;
                    (product, 0)
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

/// An operand the kernels read as float32 only (`dgated_mm`'s `scale`); `what` says
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
