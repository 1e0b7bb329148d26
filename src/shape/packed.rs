//! The packed forms: which form two operands make, the output's shape, the gathered
//! products of the MoE layer (forward: GroupedM, weight gradients: GroupedK), and the
//! backward's operands.
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

/// The gathered product of the MoE forward, `out[r] = x[src[r]] · w[g]` for the rows `r`
/// of group `g`: `x [T, K]` the tokens, `w [G, K, N]` the weights, `src [R]` the token
/// of each routed row (int32, any value: a row whose `src` is outside `[0, T)` is a zero
/// row), `offs_len` the length of `offs` (1-D, checked by [`super::offs_len`]).
/// Validates it as the GroupedM product of the gathered rows `[R, K]` and returns that
/// product's extents.
pub fn plan_gather(x: &Layout, w: &Layout, src: &Layout, offs_len: usize) -> Result<PackedDims> {
    if x.ndim() != 2 {
        return Err(shape_err(format!(
            "x: expected a 2-D tensor [T, K] (the tokens), found shape {}",
            fmt_shape(&x.shape)
        )));
    }
    let k = x.shape[1];
    if w.ndim() != 3 || w.shape[1] != k {
        return Err(shape_err(format!(
            "w: expected 3-D weights [G, K={k}, N] (K: the columns of x), found shape {}",
            fmt_shape(&w.shape)
        )));
    }
    if w.shape[0] != offs_len {
        return Err(shape_err(format!(
            "w: expected shape [G={offs_len}, K={k}, N] (G = len(offs)), found {}",
            fmt_shape(&w.shape)
        )));
    }
    if src.ndim() != 1 {
        return Err(shape_err(format!(
            "src: expected a 1-D tensor [R] (the row of x of each routed row), found shape {}",
            fmt_shape(&src.shape)
        )));
    }
    plan_packed(&Layout::contiguous(&[src.shape[0], k]), w, Some(offs_len))
}

/// The GroupedK product with gathered rows, the weight gradient of the MoE layer on
/// tokens kept in token order: `out[g] = Σ a_rᵀ · b_r` over the routed rows `r` of group
/// `g` (`offs` over the `R = len(src)` routed rows; rows past its last entry belong to no
/// group), `[G, K, N]`, where routed row `r` reads `a_r = a[src[r]]`, `b_r = b[r]`, or with
/// `gathered_b`, `a_r = a[r]`, `b_r = b[src[r]]`. `a [Ta, K]` and `b [Tb, N]` are 2-D; the
/// operand read in order has exactly `R` rows, the gathered one any number (`src` values:
/// the row ops' rule, [`super::check_indices`], not a shape rule). `offs_len`: the length
/// of `offs` (1-D, checked by [`super::offs_len`]).
///
/// Returns the extents of the GroupedK product over the `R` routed rows that runs:
/// `[K, R] · [R, N]` (`[G, K, N]`), or with `transposed` `[N, R] · [R, K]` (`[G, N, K]`,
/// whose transposed view is the result).
pub fn plan_gather_k(
    a: &Layout,
    b: &Layout,
    src: &Layout,
    offs_len: usize,
    gathered_b: bool,
    transposed: bool,
) -> Result<PackedDims> {
    let role = |gathered: bool, rows: &str, cols: &str| {
        if gathered {
            format!("[{rows}, {cols}] (the rows src indexes)")
        } else {
            format!("[R, {cols}] (one row per entry of src)")
        }
    };
    for (name, l, gathered, rows, cols) in [
        ("a", a, !gathered_b, "Ta", "K"),
        ("b", b, gathered_b, "Tb", "N"),
    ] {
        if l.ndim() != 2 {
            return Err(shape_err(format!(
                "{name}: expected a 2-D tensor {}, found shape {}",
                role(gathered, rows, cols),
                fmt_shape(&l.shape)
            )));
        }
    }
    if src.ndim() != 1 {
        return Err(shape_err(format!(
            "src: expected a 1-D tensor [R] (the source row of each routed row), found shape {}",
            fmt_shape(&src.shape)
        )));
    }
    let r = src.shape[0];
    let (name, in_order, cols) = if gathered_b {
        ("a", a, "K")
    } else {
        ("b", b, "N")
    };
    if in_order.shape[0] != r {
        return Err(shape_err(format!(
            "{name}: expected shape [R={r}, {cols}] (R = len(src): one row per routed row), found {}",
            fmt_shape(&in_order.shape)
        )));
    }
    let rows = |l: &Layout| Layout::contiguous(&[r, l.shape[1]]);
    let (first, second) = if transposed { (b, a) } else { (a, b) };
    plan_packed(&rows(first).transposed(), &rows(second), Some(offs_len))
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
    fn gathered_product_is_grouped_m_over_the_routed_rows() {
        let p = plan_gather(&c(&[10, 4]), &c(&[3, 4, 5]), &c(&[24]), 3).unwrap();
        assert_eq!((p.form, p.m, p.k, p.n), (Form::GroupedM, 24, 4, 5));
        assert_eq!(p.out_shape, vec![24, 5]);
        let msg = |x: &[usize], w: &[usize], src: &[usize], g| {
            plan_gather(&c(x), &c(w), &c(src), g)
                .unwrap_err()
                .to_string()
        };
        assert!(
            msg(&[1, 10, 4], &[3, 4, 5], &[24], 3).starts_with("x: expected a 2-D tensor [T, K]")
        );
        assert!(
            msg(&[10, 4], &[3, 3, 5], &[24], 3).starts_with("w: expected 3-D weights [G, K=4, N]")
        );
        assert!(
            msg(&[10, 4], &[3, 4, 5], &[24, 1], 3).starts_with("src: expected a 1-D tensor [R]")
        );
        assert_eq!(
            msg(&[10, 4], &[3, 4, 5], &[24], 2),
            "w: expected shape [G=2, K=4, N] (G = len(offs)), found [3, 4, 5]"
        );
    }

    #[test]
    fn gathered_k_product_is_grouped_k_over_the_routed_rows() {
        // a [Ta=10, K=4] gathered through src [R=24], b [R, N=5] in order
        let p = plan_gather_k(&c(&[10, 4]), &c(&[24, 5]), &c(&[24]), 3, false, false).unwrap();
        assert_eq!(
            (p.form, p.groups, p.m, p.n, p.k),
            (Form::GroupedK, 3, 4, 5, 24)
        );
        assert_eq!((p.out_shape.clone(), p.offs_extent), (vec![3, 4, 5], 24));
        // transposed: [N, R] · [R, K], whose transposed view is the [G, K, N] result
        let p = plan_gather_k(&c(&[10, 4]), &c(&[24, 5]), &c(&[24]), 3, false, true).unwrap();
        assert_eq!((p.form, p.m, p.n, p.k), (Form::GroupedK, 5, 4, 24));
        assert_eq!(p.out_shape, vec![3, 5, 4]);
        // gathered b: a [R, K] in order, b [Tb=7, N] any number of rows
        let p = plan_gather_k(&c(&[24, 4]), &c(&[7, 5]), &c(&[24]), 2, true, false).unwrap();
        assert_eq!(
            (p.m, p.n, p.k, p.out_shape.clone()),
            (4, 5, 24, vec![2, 4, 5])
        );
        let p = plan_gather_k(&c(&[24, 4]), &c(&[7, 5]), &c(&[24]), 2, true, true).unwrap();
        assert_eq!(p.out_shape, vec![2, 5, 4]);
        // nothing routed, no source rows, no groups: valid
        let p = plan_gather_k(&c(&[0, 4]), &c(&[0, 5]), &c(&[0]), 0, false, false).unwrap();
        assert_eq!((p.k, p.out_shape.clone()), (0, vec![0, 4, 5]));
    }

    #[test]
    fn gathered_k_errors_name_the_argument() {
        let msg = |a: &[usize], b: &[usize], src: &[usize], gathered_b| {
            plan_gather_k(&c(a), &c(b), &c(src), 3, gathered_b, false)
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            msg(&[10, 4, 1], &[24, 5], &[24], false),
            "a: expected a 2-D tensor [Ta, K] (the rows src indexes), found shape [10, 4, 1]"
        );
        assert_eq!(
            msg(&[10], &[7, 5], &[10], true),
            "a: expected a 2-D tensor [R, K] (one row per entry of src), found shape [10]"
        );
        assert_eq!(
            msg(&[10, 4], &[24], &[24], false),
            "b: expected a 2-D tensor [R, N] (one row per entry of src), found shape [24]"
        );
        assert_eq!(
            msg(&[24, 4], &[2, 7, 5], &[24], true),
            "b: expected a 2-D tensor [Tb, N] (the rows src indexes), found shape [2, 7, 5]"
        );
        assert!(
            msg(&[10, 4], &[24, 5], &[24, 1], false).starts_with("src: expected a 1-D tensor [R]")
        );
        assert_eq!(
            msg(&[10, 4], &[23, 5], &[24], false),
            "b: expected shape [R=24, N] (R = len(src): one row per routed row), found [23, 5]"
        );
        assert_eq!(
            msg(&[10, 4], &[7, 5], &[24], true),
            "a: expected shape [R=24, K] (R = len(src): one row per routed row), found [10, 4]"
        );
        // the gathered operand has any number of rows, the other exactly R
        for t in [0, 1, 24, 100] {
            assert!(plan_gather_k(&c(&[t, 4]), &c(&[24, 5]), &c(&[24]), 3, false, false).is_ok());
            assert!(plan_gather_k(&c(&[24, 4]), &c(&[t, 5]), &c(&[24]), 3, true, false).is_ok());
        }
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
