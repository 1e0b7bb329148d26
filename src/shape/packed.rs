//! The packed forms: which form two operands make, the output's shape, and the
//! backward's operands (the gathered products of the MoE layer: `product.rs`).
//!
//! | a | b | offs | out | [`Form`] |
//! | --- | --- | --- | --- | --- |
//! | `[T, K]` | `[G, K, N]` | `[G]` | `[T, N]` | [`Form::GroupedM`] |
//! | `[M, T]` | `[T, N]` | `[G]` | `[G, M, N]` | [`Form::GroupedK`] |
//! | `[G, M, K]` | `[K, N]` | `[G]` | `[M, N]` | [`Form::GroupedN`] |
//! | `[G, M, K]` | `[G, K, N]` | none | `[G, M, N]` | [`Form::Batched`] |
//!
//! `offs` holds the cumulative end of each group. Output rows (GroupedM) or columns
//! (GroupedN) past `offs[G-1]` are zero; a group with an empty reduction (K = 0, or an
//! empty group in GroupedK) gives zeros.
//!
//! For every form, `dA = grouped_mm(dC, bᵀ, offs)` and `dB = grouped_mm(aᵀ, dC, offs)`,
//! where `ᵀ` swaps the last two dimensions (a stride swap, no copy). The form of each
//! product follows from the dimensions, so [`backward_layouts`] is all the backward
//! needs. A column-major operand (a transposed view) gets its gradient in its own
//! layout, computed as `dAᵀ = grouped_mm(b, dCᵀ)` / `dBᵀ = grouped_mm(dCᵀ, a)`.

use super::{fmt_shape, need_ndim};
use crate::error::{shape_err, Result};
use crate::layout::{Layout, Transposable};

/// Which packed form a product is; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Form {
    /// `[T, K] x [G, K, N] -> [T, N]`, groups along the rows.
    GroupedM,
    /// `[M, T] x [T, N] -> [G, M, N]`, groups along the reduction.
    GroupedK,
    /// `[G, M, K] x [K, N] -> [M, N]`, groups along the columns.
    GroupedN,
    /// `[G, M, K] x [G, K, N] -> [G, M, N]`.
    Batched,
}

/// The extents of a validated packed product (what the rules decided; the C++
/// `PackedPlan` is a different thing: the kernels and workspace of one launch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedDims {
    /// The form.
    pub form: Form,
    /// Number of groups G.
    pub groups: usize,
    /// Rows of the whole product: T for GroupedM, M otherwise.
    pub m: usize,
    /// Columns of the whole product: N_total for GroupedN, N otherwise.
    pub n: usize,
    /// Reduction length: T for GroupedK, K otherwise.
    pub k: usize,
    /// Shape of the output.
    pub out_shape: Vec<usize>,
    /// The extent `offs` indexes into (T or N_total), or 0 for Batched.
    pub offs_extent: usize,
}

/// Validates a packed product and returns its plan.
///
/// `offs_len` is `Some(len)` when `offs` was given. Names in messages are `a`, `b` and
/// `offs`, the arguments of `grouped_mm`.
pub fn plan_packed(a: &Layout, b: &Layout, offs_len: Option<usize>) -> Result<PackedDims> {
    need_ndim("a", a, &[2, 3])?;
    need_ndim("b", b, &[2, 3])?;
    let (sa, sb) = (&a.shape, &b.shape);
    let need_offs = |what: &str| -> Result<usize> {
        offs_len.ok_or_else(|| {
            shape_err(format!(
                "offs: required when a is {}-D and b is {}-D ({what}); pass offs=int32 tensor of group ends",
                a.ndim(),
                b.ndim()
            ))
        })
    };
    match (a.ndim(), b.ndim()) {
        (2, 3) => {
            let g = need_offs("a [T, K] x b [G, K, N] -> [T, N]")?;
            let (t, k) = (sa[0], sa[1]);
            if sb[0] != g {
                return Err(shape_err(format!(
                    "b: expected shape [G={g}, K={k}, N] (G = len(offs)), found {}",
                    fmt_shape(sb)
                )));
            }
            if sb[1] != k {
                return Err(shape_err(format!(
                    "b: expected shape [G={g}, K={k}, N] (K = a.shape[1]), found {}",
                    fmt_shape(sb)
                )));
            }
            let n = sb[2];
            Ok(PackedDims {
                form: Form::GroupedM,
                groups: g,
                m: t,
                n,
                k,
                out_shape: vec![t, n],
                offs_extent: t,
            })
        }
        (2, 2) => {
            let g = need_offs("a [M, T] x b [T, N] -> [G, M, N]")?;
            let (m, t) = (sa[0], sa[1]);
            if sb[0] != t {
                return Err(shape_err(format!(
                    "b: expected shape [T={t}, N] (T = a.shape[1]), found {}",
                    fmt_shape(sb)
                )));
            }
            let n = sb[1];
            Ok(PackedDims {
                form: Form::GroupedK,
                groups: g,
                m,
                n,
                k: t,
                out_shape: vec![g, m, n],
                offs_extent: t,
            })
        }
        (3, 2) => {
            let g = need_offs("a [G, M, K] x b [K, N] -> [M, N]")?;
            let (m, k) = (sa[1], sa[2]);
            if sa[0] != g {
                return Err(shape_err(format!(
                    "a: expected shape [G={g}, M, K] (G = len(offs)), found {}",
                    fmt_shape(sa)
                )));
            }
            if sb[0] != k {
                return Err(shape_err(format!(
                    "b: expected shape [K={k}, N] (K = a.shape[2]), found {}",
                    fmt_shape(sb)
                )));
            }
            let n = sb[1];
            Ok(PackedDims {
                form: Form::GroupedN,
                groups: g,
                m,
                n,
                k,
                out_shape: vec![m, n],
                offs_extent: n,
            })
        }
        (3, 3) => {
            if offs_len.is_some() {
                return Err(shape_err(format!(
                    "offs: must be None when a and b are both 3-D (batched [G, M, K] x [G, K, N]); got a {} and b {}",
                    fmt_shape(sa),
                    fmt_shape(sb)
                )));
            }
            let (g, m, k) = (sa[0], sa[1], sa[2]);
            if sb[0] != g || sb[1] != k {
                return Err(shape_err(format!(
                    "b: expected shape [G={g}, K={k}, N] to match a {}, found {}",
                    fmt_shape(sa),
                    fmt_shape(sb)
                )));
            }
            let n = sb[2];
            Ok(PackedDims {
                form: Form::Batched,
                groups: g,
                m,
                n,
                k,
                out_shape: vec![g, m, n],
                offs_extent: 0,
            })
        }
        _ => unreachable!("ndim checked above"),
    }
}

/// Which gradients `(dA, dB)` to compute transposed so that each has its operand's own
/// layout: those of column-major operands (given as the caller received them, before
/// any contiguous copy). torch's grouped_mm backward does the same, and autograd then
/// keeps the gradient without copying it into the parameter's layout (for `[E, N, K]`
/// expert weights that copy was as long as the whole backward of a fine-grained MoE
/// block's GEMMs).
pub fn transposed_grads(a: &Layout, b: &Layout) -> [bool; 2] {
    [a.is_column_major(), b.is_column_major()]
}

/// The operands of the two backward products, each to be run through the forward rules
/// with the same `offs`: `dA = (dC, bᵀ)` and `dB = (aᵀ, dC)`, or where `transposed`
/// says so (see [`transposed_grads`]) `dAᵀ = (b, dCᵀ)` and `dBᵀ = (dCᵀ, a)`, whose
/// results the face returns as transposed views.
pub fn backward_layouts<T: Transposable>(
    grad: &T,
    a: &T,
    b: &T,
    transposed: [bool; 2],
) -> [(T, T); 2] {
    let da = if transposed[0] {
        (b.clone(), grad.transposed())
    } else {
        (grad.clone(), b.transposed())
    };
    let db = if transposed[1] {
        (grad.transposed(), a.clone())
    } else {
        (a.transposed(), grad.clone())
    };
    [da, db]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::plan_list;

    fn c(shape: &[usize]) -> Layout {
        Layout::contiguous(shape)
    }

    #[test]
    fn forms_and_output_shapes() {
        let p = plan_packed(&c(&[10, 4]), &c(&[3, 4, 5]), Some(3)).unwrap();
        assert_eq!((p.form, p.out_shape.clone()), (Form::GroupedM, vec![10, 5]));
        let p = plan_packed(&c(&[4, 10]), &c(&[10, 5]), Some(3)).unwrap();
        assert_eq!(
            (p.form, p.out_shape.clone()),
            (Form::GroupedK, vec![3, 4, 5])
        );
        let p = plan_packed(&c(&[3, 4, 6]), &c(&[6, 10]), Some(3)).unwrap();
        assert_eq!((p.form, p.out_shape.clone()), (Form::GroupedN, vec![4, 10]));
        let p = plan_packed(&c(&[3, 4, 6]), &c(&[3, 6, 2]), None).unwrap();
        assert_eq!(
            (p.form, p.out_shape.clone()),
            (Form::Batched, vec![3, 4, 2])
        );
    }

    #[test]
    fn errors_name_the_argument() {
        let e = plan_packed(&c(&[10, 4]), &c(&[3, 5, 5]), Some(3)).unwrap_err();
        assert!(
            e.to_string().starts_with("b: expected shape [G=3, K=4, N]"),
            "{e}"
        );
        let e = plan_packed(&c(&[10, 4]), &c(&[3, 4, 5]), None).unwrap_err();
        assert!(e.to_string().starts_with("offs: required"), "{e}");
        let e = plan_packed(&c(&[10]), &c(&[3, 4, 5]), Some(3)).unwrap_err();
        assert!(e.to_string().starts_with("a: expected a 2- or 3-D"), "{e}");
        let e = plan_list(&[c(&[2, 3])], &[c(&[4, 1])]).unwrap_err();
        assert!(
            e.to_string().starts_with("Bs[0]: expected shape [K=3, N]"),
            "{e}"
        );
    }

    #[test]
    fn backward_shapes_match_inputs() {
        for (a, b, offs) in [
            (c(&[10, 4]), c(&[3, 4, 5]), Some(3)),
            (c(&[4, 10]), c(&[10, 5]), Some(3)),
            (c(&[3, 4, 6]), c(&[6, 10]), Some(3)),
            (c(&[3, 4, 6]), c(&[3, 6, 2]), None),
        ] {
            let p = plan_packed(&a, &b, offs).unwrap();
            let grad = c(&p.out_shape);
            assert_eq!(transposed_grads(&a, &b), [false, false]);
            let [(ga, gb), (ha, hb)] = backward_layouts(&grad, &a, &b, [false, false]);
            assert_eq!(plan_packed(&ga, &gb, offs).unwrap().out_shape, a.shape);
            assert_eq!(plan_packed(&ha, &hb, offs).unwrap().out_shape, b.shape);
            // column-major operands: the transposed gradient, a valid form of its own
            let (at, bt) = (
                c(&a.transposed().shape).transposed(),
                c(&b.transposed().shape).transposed(),
            );
            let t = transposed_grads(&at, &bt);
            assert_eq!(t, [true, true]);
            let [(ga, gb), (ha, hb)] = backward_layouts(&grad, &at, &bt, t);
            assert_eq!(
                plan_packed(&ga, &gb, offs).unwrap().out_shape,
                a.transposed().shape
            );
            assert_eq!(
                plan_packed(&ha, &hb, offs).unwrap().out_shape,
                b.transposed().shape
            );
        }
    }
}
