//! The shape rules that `plan_product` and the epilogues' entries (`epilogues`) build on:
//! the gathered GroupedM product (plain, over two weights, transposed weights) and
//! the GroupedK product over gathered rows, with the checks they share (`R` from `src`,
//! `G = len(offs)`). Messages name the operands as the faces do.

use crate::error::{shape_err, Result};
use crate::layout::Layout;
use crate::shape::{fmt_shape, need_ndim, packed::plan_packed, PackedDims};
use std::fmt::Display;

/// The SwiGLU product over two weights, `p = x[src] · [w | up]`: the gathered GroupedM
/// rule of `x` and `w` (the gate, `[G, K, F]`), `up` of `w`'s shape; the product that runs
/// has `2F` columns.
pub(super) fn swiglu_pair(
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
pub(super) fn grouped_m(
    x: &Layout,
    w: &Layout,
    src: Option<&Layout>,
    offs_len: usize,
) -> Result<PackedDims> {
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
pub(super) fn grouped_k(
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
pub(super) fn dgated(
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

/// An operand with one value per row of the product, `[R]` (`R` the rows of `x`, or with
/// `src` its length), e.g. a scale.
pub(super) fn per_row(name: &str, scale: &Layout, r: usize, gathered: bool) -> Result<()> {
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
