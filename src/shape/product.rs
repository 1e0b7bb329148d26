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

use super::{
    fmt_shape, need_ndim, packed::plan_packed, rows::gate_up_half, Epilogue, Form, PackedDims,
};
use crate::dtype::DType;
use crate::error::{shape_err, Error, Result};
use crate::layout::Layout;
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

/// The SwiGLU product over two weights, `p = x[src] · [w | up]`: the gathered GroupedM
/// rule of `x` and `w` (the gate, `[G, K, F]`), `up` of `w`'s shape; the product that runs
/// has `2F` columns.
fn swiglu_pair(
    x: &Layout,
    w: &Layout,
    up: &Layout,
    src: Option<&Layout>,
    offs_len: usize,
) -> Result<(PackedDims, usize)> {
    let mut product = grouped_m(x, w, src, offs_len)?;
    if up.shape != w.shape {
        return Err(shape_err(format!(
            "up: expected shape {} (the shape of w, the gate), found {}",
            fmt_shape(&w.shape),
            fmt_shape(&up.shape)
        )));
    }
    let f = product.n;
    product.n = 2 * f;
    product.out_shape = vec![product.m, 2 * f];
    Ok((product, f))
}

/// The gathered GroupedM product, `out[r] = x[src[r]] · w[g]` for the rows `r` of group
/// `g`: `x [T, K]` the tokens, `w [G, K, N]` the weights, `src [R]` the token of each
/// routed row (absent: `R = T`, the rows in order), validated as the GroupedM product of
/// the gathered rows `[R, K]`.
fn grouped_m(x: &Layout, w: &Layout, src: Option<&Layout>, offs_len: usize) -> Result<PackedDims> {
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
    groups(w, offs_len, &format_args!("K={k}, N"))?;
    let r = routed_rows(src, x.shape[0], "x")?;
    plan_packed(&Layout::contiguous(&[r, k]), w, Some(offs_len))
}

/// The GroupedK product with gathered rows: `out[g] = Σ a_rᵀ · b_r` over the routed rows
/// `r` of group `g`, `[G, K, N]`, where routed row `r` reads `a_r = a[src[r]]`,
/// `b_r = b[r]`, or with `gathered_b`, `a_r = a[r]`, `b_r = b[src[r]]`: `a [Ta, K]` and
/// `b [Tb, N]` 2-D, the operand read in order with exactly `R` rows, the gathered one any
/// number. The product that runs: `[K, R] · [R, N]`, or with `transposed`
/// `[N, R] · [R, K]` (`[G, N, K]`, whose transposed view is the result).
fn grouped_k(
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

/// `dgated_mm`'s product: `dy [R, D]`, or with `src [R]` `dy [T, D]` (the rows in token
/// order, row `r` of the product is `dy[src[r]]`), `w [G, F, D]` (`G = len(offs)`),
/// `pre [R, 2F]`, `scale [R]`; the product is `dy[src] · w[g]ᵀ` (GroupedM, `m = R`,
/// `n = F`, `k = D`). Returns it and `F`.
fn dgated(
    dy: &Layout,
    w: &Layout,
    pre: &Layout,
    scale: &Layout,
    src: Option<&Layout>,
    offs_len: usize,
) -> Result<(PackedDims, usize)> {
    if dy.ndim() != 2 {
        let what = match src {
            None => "[R, D] (the gradient of the down projection's rows)",
            Some(_) => {
                "[T, D] (the gradient of the down projection's output, the rows src indexes)"
            }
        };
        return Err(shape_err(format!(
            "dy: expected a 2-D tensor {what}, found shape {}",
            fmt_shape(&dy.shape)
        )));
    }
    let r = routed_rows(src, dy.shape[0], "dy")?;
    let d = dy.shape[1];
    if w.ndim() != 3 || w.shape[2] != d {
        return Err(shape_err(format!(
            "w: expected 3-D weights [G, F, D={d}] (the down projection's; D: the columns of dy), found shape {}",
            fmt_shape(&w.shape)
        )));
    }
    groups(w, offs_len, &format_args!("F, D={d}"))?;
    let f = w.shape[1];
    let rows = match src {
        None => "the rows of dy",
        Some(_) => "R = len(src)",
    };
    need_ndim("pre", pre, &[2])?;
    if pre.shape != [r, 2 * f] {
        return Err(shape_err(format!(
            "pre: expected shape {} ([R, 2F]: {rows}, twice w.shape[1]), found {}",
            fmt_shape(&[r, 2 * f]),
            fmt_shape(&pre.shape)
        )));
    }
    if scale.shape != [r] {
        let per = match src {
            None => "row of dy",
            Some(_) => "routed row, R = len(src)",
        };
        return Err(shape_err(format!(
            "scale: expected shape [{r}] (one router weight per {per}), found {}",
            fmt_shape(&scale.shape)
        )));
    }
    let rows = Layout::contiguous(&[r, d]);
    Ok((plan_packed(&rows, &w.transposed(), Some(offs_len))?, f))
}

/// `RowScale`'s `scale`: one value per row of the product, `[R]` (`R` the rows of `x`, or
/// with `src` its length).
fn per_row(name: &str, scale: &Layout, r: usize, gathered: bool) -> Result<()> {
    if scale.shape == [r] {
        return Ok(());
    }
    let per = if gathered {
        "routed row, R = len(src)"
    } else {
        "row of x"
    };
    Err(shape_err(format!(
        "{name}: expected shape [{r}] (one scale per {per}), found {}",
        fmt_shape(&scale.shape)
    )))
}

/// `R`: the length of `src` (1-D, the row of `of` of each routed row), or without it
/// `rows`, the rows of `of` in order.
fn routed_rows(src: Option<&Layout>, rows: usize, of: &str) -> Result<usize> {
    match src {
        None => Ok(rows),
        Some(s) if s.ndim() == 1 => Ok(s.shape[0]),
        Some(s) => Err(shape_err(format!(
            "src: expected a 1-D tensor [R] (the row of {of} of each routed row), found shape {}",
            fmt_shape(&s.shape)
        ))),
    }
}

/// The weights `w` hold one matrix per group: `G = len(offs)` (`dims`: the rest of the
/// expected shape, for the message).
fn groups(w: &Layout, offs_len: usize, dims: &dyn Display) -> Result<()> {
    if w.shape[0] != offs_len {
        return Err(shape_err(format!(
            "w: expected shape [G={offs_len}, {dims}] (G = len(offs)), found {}",
            fmt_shape(&w.shape)
        )));
    }
    Ok(())
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
mod tests {
    use super::*;
    use crate::shape::Form;

    fn c(shape: &[usize]) -> Layout {
        Layout::contiguous(shape)
    }

    /// The request of one product, as a face makes it.
    fn request<'a>(
        form: Form,
        (a, b): (&'a Layout, &'a Layout),
        src: Option<(&'a Layout, Gathered)>,
        epilogue: Epilogue<&'a Layout>,
        offs_len: usize,
        transposed: bool,
    ) -> Result<ProductDims> {
        plan_product(&ProductShape {
            form,
            a,
            b,
            offs_len,
            src,
            epilogue,
            transposed,
        })
    }

    /// `gather_mm`'s rule.
    fn plan_gather(x: &Layout, w: &Layout, src: &Layout, offs_len: usize) -> Result<PackedDims> {
        let src = Some((src, Gathered::A));
        request(
            Form::GroupedM,
            (x, w),
            src,
            Epilogue::Plain,
            offs_len,
            false,
        )
        .map(|d| d.product)
    }

    /// `gather_k_mm`'s rule.
    fn plan_gather_k(
        a: &Layout,
        b: &Layout,
        src: &Layout,
        offs_len: usize,
        gathered_b: bool,
        transposed: bool,
    ) -> Result<PackedDims> {
        let gathered = if gathered_b { Gathered::B } else { Gathered::A };
        let d = request(
            Form::GroupedK,
            (a, b),
            Some((src, gathered)),
            Epilogue::Plain,
            offs_len,
            transposed,
        )?;
        assert_eq!((d.f, d.out_shapes(), d.is_empty()), (0, vec![], false));
        Ok(d.product)
    }

    /// `swiglu_mm`'s rule.
    fn plan_swiglu_mm(
        x: &Layout,
        w: &Layout,
        src: Option<&Layout>,
        offs_len: usize,
    ) -> Result<ProductDims> {
        let src = src.map(|s| (s, Gathered::A));
        request(
            Form::GroupedM,
            (x, w),
            src,
            Epilogue::SwiGLU { up: None },
            offs_len,
            false,
        )
    }

    /// `dgated_mm`'s rule.
    fn plan_dgated_mm(
        dy: &Layout,
        w: &Layout,
        pre: &Layout,
        scale: &Layout,
        src: Option<&Layout>,
        offs_len: usize,
    ) -> Result<ProductDims> {
        let src = src.map(|s| (s, Gathered::A));
        let epilogue = Epilogue::DGated { pre, scale };
        request(Form::GroupedM, (dy, w), src, epilogue, offs_len, false)
    }

    const DGATED: Epilogue<()> = Epilogue::DGated { pre: (), scale: () };

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
    fn names_and_requests_without_a_rule() {
        let (x, w) = (c(&[10, 4]), c(&[3, 4, 6]));
        assert_eq!(
            operand_names(Form::GroupedK, &Epilogue::<()>::Plain),
            ["a", "b"]
        );
        assert_eq!(
            operand_names(Form::GroupedM, &Epilogue::<()>::SwiGLU { up: None }),
            ["x", "w"]
        );
        assert_eq!(operand_names(Form::GroupedM, &DGATED), ["dy", "w"]);
        // in order: R = T
        let d = request(Form::GroupedM, (&x, &w), None, Epilogue::Plain, 3, false).unwrap();
        assert_eq!(
            (d.product.m, d.out_shapes(), d.is_empty()),
            (10, vec![], false)
        );
        // what no face asks: an internal error, never a panic
        let src = c(&[24]);
        for (form, src, epilogue, transposed) in [
            (
                Form::GroupedM,
                Some((&src, Gathered::B)),
                Epilogue::Plain,
                false,
            ),
            (Form::GroupedM, None, Epilogue::SwiGLU { up: None }, true),
            (Form::GroupedK, None, Epilogue::Plain, false),
            (
                Form::GroupedK,
                Some((&src, Gathered::A)),
                Epilogue::SwiGLU { up: None },
                false,
            ),
            (Form::Batched, None, Epilogue::Plain, false),
        ] {
            let e = request(form, (&x, &w), src, epilogue, 3, transposed).unwrap_err();
            assert!(
                e.to_string().starts_with("internal: no product rule"),
                "{e}"
            );
        }
    }

    #[test]
    fn swiglu_product_and_outputs() {
        // gathered: R = len(src) rows of x
        let d = plan_swiglu_mm(&c(&[10, 4]), &c(&[3, 4, 6]), Some(&c(&[24])), 3).unwrap();
        assert_eq!(d.epilogue, Epilogue::SwiGLU { up: None });
        let p = &d.product;
        assert_eq!(
            (p.form, p.groups, p.m, p.n, p.k),
            (Form::GroupedM, 3, 24, 6, 4)
        );
        assert_eq!((d.f, d.out_shapes()), (3, vec![[24, 6], [24, 3]]));
        // in order: R = T
        let d = plan_swiglu_mm(&c(&[10, 4]), &c(&[3, 4, 6]), None, 3).unwrap();
        assert_eq!((d.product.m, d.out_shapes()), (10, vec![[10, 6], [10, 3]]));
        assert!(!d.is_empty());
        // nothing to do is valid
        let d = plan_swiglu_mm(&c(&[0, 4]), &c(&[1, 4, 0]), None, 1).unwrap();
        assert_eq!(d.out_shapes(), vec![[0, 0], [0, 0]]);
        assert!(d.is_empty());
        // no routed rows (an expert-parallel rank that received none): empty outputs
        let d = plan_swiglu_mm(&c(&[0, 4]), &c(&[3, 4, 6]), Some(&c(&[0])), 3).unwrap();
        assert_eq!((d.out_shapes(), d.is_empty()), (vec![[0, 6], [0, 3]], true));
    }

    #[test]
    fn swiglu_over_two_weights() {
        // the gate [G, K, F] and up [G, K, F]: a product of 2F columns, F odd allowed
        let (x, w, src) = (c(&[10, 4]), c(&[3, 4, 5]), c(&[24]));
        let up = c(&[3, 4, 5]);
        let epilogue = Epilogue::SwiGLU { up: Some(&up) };
        let d = request(
            Form::GroupedM,
            (&x, &w),
            Some((&src, Gathered::A)),
            epilogue,
            3,
            false,
        )
        .unwrap();
        assert_eq!(d.epilogue, Epilogue::SwiGLU { up: Some(()) });
        assert_eq!((d.product.m, d.product.n, d.product.k), (24, 10, 4));
        assert_eq!(d.product.out_shape, vec![24, 10]);
        assert_eq!((d.f, d.out_shapes()), (5, vec![[24, 10], [24, 5]]));
        // up of another shape: named, with w's
        let bad = c(&[3, 4, 6]);
        let epilogue = Epilogue::SwiGLU { up: Some(&bad) };
        let e = request(Form::GroupedM, (&x, &w), None, epilogue, 3, false).unwrap_err();
        assert_eq!(
            e.to_string(),
            "up: expected shape [3, 4, 5] (the shape of w, the gate), found [3, 4, 6]"
        );
        // the gate's own rule first
        let epilogue = Epilogue::SwiGLU { up: Some(&up) };
        let e = request(
            Form::GroupedM,
            (&x, &c(&[3, 5, 5])),
            None,
            epilogue,
            3,
            false,
        );
        assert!(e
            .unwrap_err()
            .to_string()
            .starts_with("w: expected 3-D weights [G, K=4, N]"));
    }

    #[test]
    fn swiglu_errors_name_the_argument() {
        let msg = |x: &[usize], w: &[usize], src: Option<&[usize]>, g| {
            let src = src.map(c);
            plan_swiglu_mm(&c(x), &c(w), src.as_ref(), g)
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            msg(&[10, 4], &[3, 4, 5], Some(&[24]), 3),
            "w: expected an even last dimension [gate | up], found [3, 4, 5]"
        );
        assert_eq!(
            msg(&[10, 4], &[3, 4, 5], None, 3),
            "w: expected an even last dimension [gate | up], found [3, 4, 5]"
        );
        assert!(msg(&[10], &[3, 4, 6], None, 3).starts_with("x: expected a 2-D tensor [T, K]"));
        assert!(msg(&[10, 4], &[4, 6], None, 3).starts_with("w: expected 3-D weights [G, K=4, N]"));
        assert!(
            msg(&[10, 4], &[3, 5, 6], None, 3).starts_with("w: expected 3-D weights [G, K=4, N]")
        );
        assert_eq!(
            msg(&[10, 4], &[3, 4, 6], None, 2),
            "w: expected shape [G=2, K=4, N] (G = len(offs)), found [3, 4, 6]"
        );
        assert!(msg(&[10, 4], &[3, 4, 6], Some(&[4, 6]), 3)
            .starts_with("src: expected a 1-D tensor [R]"));
    }

    #[test]
    fn dgated_product_and_outputs() {
        // dy [R=24, D=8], w [3, F=130, 8]: p = dy · w[g]ᵀ is [24, 130]
        let d = plan_dgated_mm(
            &c(&[24, 8]),
            &c(&[3, 130, 8]),
            &c(&[24, 260]),
            &c(&[24]),
            None,
            3,
        )
        .unwrap();
        assert_eq!(d.epilogue, DGATED);
        let p = &d.product;
        assert_eq!(
            (p.form, p.groups, p.m, p.n, p.k),
            (Form::GroupedM, 3, 24, 130, 8)
        );
        assert_eq!(d.f, 130);
        assert_eq!(d.out_shapes(), vec![[24, 260], [24, 130], [3, 24]]);
        // F a multiple of the chunk, and F = 0
        let d = plan_dgated_mm(
            &c(&[5, 8]),
            &c(&[2, 128, 8]),
            &c(&[5, 256]),
            &c(&[5]),
            None,
            2,
        )
        .unwrap();
        assert_eq!(d.out_shapes()[2], [2, 5]);
        let d =
            plan_dgated_mm(&c(&[5, 8]), &c(&[2, 0, 8]), &c(&[5, 0]), &c(&[5]), None, 2).unwrap();
        assert_eq!(d.out_shapes(), vec![[5, 0], [5, 0], [0, 5]]);
    }

    #[test]
    fn row_scale_is_the_gathered_rule_with_one_scale_per_row() {
        let plan = |x: &[usize], scale: &[usize], src: Option<&[usize]>| {
            let src = src.map(c);
            let scale = c(scale);
            let epilogue = Epilogue::RowScale { scale: &scale };
            let src = src.as_ref().map(|s| (s, Gathered::A));
            request(
                Form::GroupedM,
                (&c(x), &c(&[3, 8, 5])),
                src,
                epilogue,
                3,
                false,
            )
        };
        let d = plan(&[6, 8], &[6], None).unwrap();
        assert_eq!(
            (d.product.out_shape.clone(), d.out_shapes(), d.f),
            (vec![6, 5], vec![], 0)
        );
        assert!(!d.is_empty());
        assert!(plan(&[0, 8], &[0], None).unwrap().is_empty());
        let d = plan(&[4, 8], &[9], Some(&[9])).unwrap();
        assert_eq!(d.product.m, 9);
        assert_eq!(
            plan(&[6, 8], &[5], None).unwrap_err().to_string(),
            "scale: expected shape [6] (one scale per row of x), found [5]"
        );
        assert_eq!(
            plan(&[4, 8], &[4], Some(&[9])).unwrap_err().to_string(),
            "scale: expected shape [9] (one scale per routed row, R = len(src)), found [4]"
        );
        assert!(plan(&[6, 7], &[6], None)
            .unwrap_err()
            .to_string()
            .starts_with("w: expected 3-D weights [G, K=7, N]"));
    }

    #[test]
    fn dgated_errors_name_the_argument() {
        let msg = |dy: &[usize], w: &[usize], pre: &[usize], scale: &[usize], g| {
            plan_dgated_mm(&c(dy), &c(w), &c(pre), &c(scale), None, g)
                .unwrap_err()
                .to_string()
        };
        let (dy, w, pre, s) = ([6, 8], [3, 4, 8], [6, 8], [6]);
        assert!(plan_dgated_mm(&c(&dy), &c(&w), &c(&pre), &c(&s), None, 3).is_ok());
        assert!(msg(&[6, 8, 1], &w, &pre, &s, 3).starts_with("dy: expected a 2-D tensor [R, D]"));
        assert!(msg(&dy, &[4, 8], &pre, &s, 3).starts_with("w: expected 3-D weights [G, F, D=8]"));
        assert!(
            msg(&dy, &[3, 8, 4], &pre, &s, 3).starts_with("w: expected 3-D weights [G, F, D=8]")
        );
        assert_eq!(
            msg(&dy, &w, &pre, &s, 2),
            "w: expected shape [G=2, F, D=8] (G = len(offs)), found [3, 4, 8]"
        );
        assert_eq!(
            msg(&dy, &w, &[6, 7], &s, 3),
            "pre: expected shape [6, 8] ([R, 2F]: the rows of dy, twice w.shape[1]), found [6, 7]"
        );
        assert!(msg(&dy, &w, &[48], &s, 3).starts_with("pre: expected a 2-D tensor"));
        assert_eq!(
            msg(&dy, &w, &pre, &[5], 3),
            "scale: expected shape [6] (one router weight per row of dy), found [5]"
        );
        assert_eq!(
            msg(&dy, &w, &pre, &[6, 1], 3),
            "scale: expected shape [6] (one router weight per row of dy), found [6, 1]"
        );
    }

    #[test]
    fn dgated_with_src_reads_the_routed_rows_of_dy() {
        // dy [T=10, D=8] in token order, src [R=24]: the product is [R, F] over the routes
        let src = c(&[24]);
        let d = plan_dgated_mm(
            &c(&[10, 8]),
            &c(&[3, 130, 8]),
            &c(&[24, 260]),
            &c(&[24]),
            Some(&src),
            3,
        )
        .unwrap();
        let p = &d.product;
        assert_eq!(
            (p.form, p.groups, p.m, p.n, p.k),
            (Form::GroupedM, 3, 24, 130, 8)
        );
        assert_eq!(d.out_shapes(), vec![[24, 260], [24, 130], [3, 24]]);
        // any number of token rows, none included
        for t in [0, 1, 24, 100] {
            let d = plan_dgated_mm(
                &c(&[t, 8]),
                &c(&[3, 4, 8]),
                &c(&[6, 8]),
                &c(&[6]),
                Some(&c(&[6])),
                3,
            );
            assert_eq!(d.unwrap().product.m, 6);
        }
    }

    #[test]
    fn dgated_with_src_errors_name_the_argument() {
        let msg = |dy: &[usize], pre: &[usize], scale: &[usize], src: &[usize]| {
            plan_dgated_mm(&c(dy), &c(&[3, 4, 8]), &c(pre), &c(scale), Some(&c(src)), 3)
                .unwrap_err()
                .to_string()
        };
        let (dy, pre, s, src) = ([10, 8], [6, 8], [6], [6]);
        assert!(msg(&[10], &pre, &s, &src).starts_with(
            "dy: expected a 2-D tensor [T, D] (the gradient of the down projection's output, the rows src indexes)"
        ));
        assert_eq!(
            msg(&dy, &pre, &s, &[6, 1]),
            "src: expected a 1-D tensor [R] (the row of dy of each routed row), found shape [6, 1]"
        );
        assert_eq!(
            msg(&dy, &[10, 8], &s, &src),
            "pre: expected shape [6, 8] ([R, 2F]: R = len(src), twice w.shape[1]), found [10, 8]"
        );
        assert_eq!(
            msg(&dy, &pre, &[10], &src),
            "scale: expected shape [6] (one router weight per routed row, R = len(src)), found [10]"
        );
        assert!(plan_dgated_mm(
            &c(&[10, 7]),
            &c(&[3, 4, 8]),
            &c(&pre),
            &c(&s),
            Some(&c(&src)),
            3
        )
        .unwrap_err()
        .to_string()
        .starts_with("w: expected 3-D weights [G, F, D=7]"));
    }

    #[test]
    fn scale_is_float32() {
        assert!(check_f32("scale", DType::F32, "the router weights").is_ok());
        assert!(matches!(
            check_f32("scale", DType::BF16, "the router weights"),
            Err(Error::Dtype(m)) if m == "scale: expected dtype torch.float32 (the router weights), found torch.bfloat16"
        ));
    }
}
