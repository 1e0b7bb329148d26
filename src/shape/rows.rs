//! The row ops of the MoE glue: the memory-bound steps around the grouped GEMMs of a
//! routed SwiGLU expert block, each one pass over its rows. Their shapes here; dtype and
//! device agreement by [`super::check_like`] / [`super::check_like_or_f32`] (the engine,
//! `crate::exec::rows`, applies them).
//!
//! | op | operands | output |
//! | --- | --- | --- |
//! | [`RowsOp::Swiglu`] | `pre [R, 2F]` | `[R, F]`: `silu(gate) * up`, `pre = [gate \| up]` |
//! | [`RowsOp::SwigluBackward`] | `grad [R, F]`, `pre [R, 2F]` | `[R, 2F]`: `[d gate \| d up]` |
//! | [`RowsOp::GatherSum`] | `y [R, D]`, `inverse [T, k]`, `weights?` | `[T, D]`: `sum_j w[t, j] * y[inverse[t, j]]` |
//! | [`RowsOp::ScatterRows`] | `grad [T, D]`, `inverse [T, k]`, `weights?`, `R` | `[R, D]`: `out[inverse[t, j]] = w[t, j] * grad[t]` |
//! | [`RowsOp::RowDots`] | `grad [T, D]`, `y [R, D]`, `inverse [T, k]` | `[T, k]`: `<grad[t], y[inverse[t, j]]>` |
//! | [`RowsOp::TopK`] | `scores [T, E]`, `k` | int64 `[T, k]`: the router's top-k ids of each row |
//!
//! `inverse[t, j]` is the row of the expert-ordered operand that holds token `t`'s `j`-th
//! choice; `weights` (absent: weight 1) has its shape. An index outside `[0, R)` is an
//! error ([`check_indices`] on the host, before the CPU loops run; on CUDA the kernels of
//! `cuda/device/rows.cu` skip it, reading and writing nothing for it, and raise the
//! deferred flag that the device's next call reports: `super::index_error_pending`).
//!
//! TopK's order ([`topk_before`]): row `t` of its output holds the columns of the `k`
//! largest values of `scores[t]`, best first: a greater value first, NaN greater than
//! every number (as `torch.topk` ranks it), equal values (NaNs among themselves, and
//! `-0.0 == 0.0`) lower column first. On rows of distinct numbers that is
//! `torch.topk(scores, k).indices`. On CUDA rows are at most [`TOPK_CUDA_MAX_COLS`] wide.

use super::{fmt_shape, need_ndim};
use crate::error::{shape_err, Result};
use crate::layout::Layout;

/// Which row op; the CUDA side has the same enum (`gmm::RowsOp`, cuda/device/rows.h),
/// which the engine maps this one to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowsOp {
    /// `out[r, c] = silu(pre[r, c]) * pre[r, F + c]`.
    Swiglu,
    /// The gradient of `Swiglu` w.r.t. `pre`, from the output gradient.
    SwigluBackward,
    /// `out[t] = sum_j w[t, j] * y[inverse[t, j]]`.
    GatherSum,
    /// `out[inverse[t, j]] = w[t, j] * grad[t]`, every row written (zeros where unnamed).
    ScatterRows,
    /// `out[t, j] = <grad[t], y[inverse[t, j]]>`.
    RowDots,
    /// `out[t, j]` (int64) = the column of the `j`-th of the `k` largest values of row
    /// `t` ([`topk_before`]'s order).
    TopK,
}

/// The extents of a validated row op: what its loops and kernels iterate over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowsDims {
    /// The op.
    pub op: RowsOp,
    /// Rows `T` of `inverse` (0 for the SwiGLU ops; TopK: rows of `scores`).
    pub tokens: usize,
    /// Columns `k` of `inverse` (0 for the SwiGLU ops; TopK: `k`).
    pub top_k: usize,
    /// Rows `R` of the expert-ordered operand (TopK: `T`, the rows of `scores`).
    pub rows: usize,
    /// `F` for the SwiGLU ops (their `[R, 2F]` operands have twice as many), `D` for the
    /// others (TopK: `E`, the columns of `scores`).
    pub cols: usize,
}

impl RowsDims {
    /// The shape of the op's output.
    pub fn out_shape(&self) -> [usize; 2] {
        match self.op {
            RowsOp::Swiglu => [self.rows, self.cols],
            RowsOp::SwigluBackward => [self.rows, 2 * self.cols],
            RowsOp::GatherSum => [self.tokens, self.cols],
            RowsOp::ScatterRows => [self.rows, self.cols],
            RowsOp::RowDots | RowsOp::TopK => [self.tokens, self.top_k],
        }
    }

    /// Whether the output holds int64 indices (TopK) rather than values.
    pub fn writes_index(&self) -> bool {
        self.op == RowsOp::TopK
    }
}

/// Addresses of a row op's operands, each contiguous row-major (0: absent), as the CPU
/// loops (`crate::cpu::rows`) and the CUDA request (`RowsRequest`, src/exec/ffi.rs) take
/// them: `x` is the first operand (`pre`, `grad` or `y`), `y` the second (`pre` of
/// SwigluBackward, `y` of RowDots), `inverse` the int32 row index of each output slot
/// (`[T, k]`: slot `(t, j)`'s row of the expert-ordered operand, the `R` rows GatherSum
/// and RowDots read and ScatterRows writes; a gathered product's `src` as a one-column
/// index), `weights` the router weights (`[T, k]`). TopK: `x` is `scores`, `out` its int64
/// `[T, k]` ids.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RowPtrs {
    pub x: usize,
    pub y: usize,
    pub inverse: usize,
    pub weights: usize,
    pub out: usize,
}

/// A 2-D operand's `(rows, columns)`.
fn matrix(name: &str, l: &Layout) -> Result<(usize, usize)> {
    need_ndim(name, l, &[2])?;
    Ok((l.shape[0], l.shape[1]))
}

/// `found` is `expected`, which `why` explains.
fn expect_shape(
    name: &str,
    found: (usize, usize),
    expected: (usize, usize),
    why: &str,
) -> Result<()> {
    if found != expected {
        return Err(shape_err(format!(
            "{name}: expected shape {} ({why}), found {}",
            fmt_shape(&[expected.0, expected.1]),
            fmt_shape(&[found.0, found.1])
        )));
    }
    Ok(())
}

/// `inverse [T, k]` and the optional `weights` of its shape: `(T, k)`.
fn routing(inverse: &Layout, weights: Option<&Layout>) -> Result<(usize, usize)> {
    let i = matrix("inverse", inverse)?;
    if let Some(w) = weights {
        expect_shape("weights", matrix("weights", w)?, i, "the shape of inverse")?;
    }
    Ok(i)
}

/// The half `F` of the last dimension of `name`'s `shape`, `[gate | up]`, which must be
/// even (the SwiGLU pre-activation and the weights that make it: one rule, one wording).
pub(super) fn gate_up_half(name: &str, shape: &[usize]) -> Result<usize> {
    match shape.last() {
        Some(&c) if c % 2 == 0 => Ok(c / 2),
        _ => Err(shape_err(format!(
            "{name}: expected an even last dimension [gate | up], found {}",
            fmt_shape(shape)
        ))),
    }
}

/// The rule for routing index values on the host: every index (`inverse`, or `src` as a
/// one-column `inverse`) names a row in `[0, rows)`; the first one that does not is the
/// error, naming its value and position.
pub fn check_indices(idx: &[i32], rows: usize) -> Result<()> {
    match idx.iter().position(|&r| r < 0 || r as usize >= rows) {
        None => Ok(()),
        Some(i) => Err(crate::error::Error::Value(format!(
            "src/inverse: routing index {} at position {i} is out of range: expected a row \
             in [0, {rows})",
            idx[i]
        ))),
    }
}

/// `swiglu(pre)`: `pre [R, 2F]`, an even number of columns `[gate | up]`.
pub fn plan_swiglu(pre: &Layout) -> Result<RowsDims> {
    let (rows, _) = matrix("pre", pre)?;
    Ok(RowsDims {
        op: RowsOp::Swiglu,
        tokens: 0,
        top_k: 0,
        rows,
        cols: gate_up_half("pre", &pre.shape)?,
    })
}

/// `swiglu_backward(grad, pre)`: `grad [R, F]`, `pre [R, 2F]`.
pub fn plan_swiglu_backward(grad: &Layout, pre: &Layout) -> Result<RowsDims> {
    let (rows, cols) = matrix("grad", grad)?;
    let p = matrix("pre", pre)?;
    expect_shape(
        "pre",
        p,
        (rows, 2 * cols),
        "[rows of grad, 2 x its columns]",
    )?;
    Ok(RowsDims {
        op: RowsOp::SwigluBackward,
        tokens: 0,
        top_k: 0,
        rows,
        cols,
    })
}

/// `gather_sum(y, inverse, weights)`: `y [R, D]`, `inverse [T, k]`, `weights [T, k]`.
pub fn plan_gather_sum(y: &Layout, inverse: &Layout, weights: Option<&Layout>) -> Result<RowsDims> {
    let (rows, cols) = matrix("y", y)?;
    let (tokens, top_k) = routing(inverse, weights)?;
    Ok(RowsDims {
        op: RowsOp::GatherSum,
        tokens,
        top_k,
        rows,
        cols,
    })
}

/// `scatter_rows(grad, inverse, weights, rows)`: `grad [T, D]`, `inverse [T, k]`,
/// `weights [T, k]`, an output of `rows` rows.
pub fn plan_scatter_rows(
    grad: &Layout,
    inverse: &Layout,
    weights: Option<&Layout>,
    rows: usize,
) -> Result<RowsDims> {
    let g = matrix("grad", grad)?;
    let (tokens, top_k) = routing(inverse, weights)?;
    expect_shape("grad", g, (tokens, g.1), "[rows of inverse, D]")?;
    Ok(RowsDims {
        op: RowsOp::ScatterRows,
        tokens,
        top_k,
        rows,
        cols: g.1,
    })
}

/// `row_dots(grad, y, inverse)`: `grad [T, D]`, `y [R, D]`, `inverse [T, k]`.
pub fn plan_row_dots(grad: &Layout, y: &Layout, inverse: &Layout) -> Result<RowsDims> {
    let g = matrix("grad", grad)?;
    let (rows, cols) = matrix("y", y)?;
    let (tokens, top_k) = routing(inverse, None)?;
    expect_shape("grad", g, (tokens, cols), "[rows of inverse, columns of y]")?;
    Ok(RowsDims {
        op: RowsOp::RowDots,
        tokens,
        top_k,
        rows,
        cols,
    })
}

/// The widest rows TopK takes on CUDA: its kernel holds a row in one warp's registers, at
/// most 32 values a lane (`cuda/device/rows.h`, `kTopKMaxCols`). Wider rows
/// are an error there; `_native.TOPK_CUDA_MAX_COLS` tells the Python router, which uses
/// `torch.topk` for them instead.
pub const TOPK_CUDA_MAX_COLS: usize = 1024;

/// `topk_ids(scores, k)`: `scores [T, E]` with `E >= 1`, and `1 <= k <= E`.
pub fn plan_topk(scores: &Layout, k: i64) -> Result<RowsDims> {
    let (tokens, cols) = matrix("scores", scores)?;
    if cols == 0 {
        return Err(shape_err(format!(
            "scores: expected at least one column (E >= 1), found shape {}",
            fmt_shape(&scores.shape)
        )));
    }
    let top_k = usize::try_from(k)
        .ok()
        .filter(|&k| (1..=cols).contains(&k))
        .ok_or_else(|| {
            crate::error::Error::Value(format!(
                "k: expected an integer in [1, {cols}] (1 to the columns of scores), found {k}"
            ))
        })?;
    Ok(RowsDims {
        op: RowsOp::TopK,
        tokens,
        top_k,
        rows: tokens,
        cols,
    })
}

/// TopK's bound on CUDA ([`TOPK_CUDA_MAX_COLS`]), applied by the engine to CUDA calls.
pub fn check_topk_cuda(d: &RowsDims) -> Result<()> {
    if d.cols > TOPK_CUDA_MAX_COLS {
        return Err(shape_err(format!(
            "scores: expected at most {TOPK_CUDA_MAX_COLS} columns on CUDA (the top-k \
             kernel's bound; torch.topk takes wider rows), found shape {}",
            fmt_shape(&[d.tokens, d.cols])
        )));
    }
    Ok(())
}

/// TopK's order: whether value `a` at column `ia` ranks before value `b` at column `ib`
/// (`ia != ib`): the greater value, NaN greater than every number, equal values (NaNs
/// among themselves; `-0.0 == 0.0`) the lower column. A strict total order on
/// `(value, column)` pairs of distinct columns. The CUDA kernel's comparator
/// (`topk_before`, `cuda/device/rows_topk.cuh`) is this one.
pub fn topk_before(a: f64, ia: usize, b: f64, ib: usize) -> bool {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => ia < ib,
        (true, false) => true,
        (false, true) => false,
        (false, false) => a > b || (a == b && ia < ib),
    }
}

#[cfg(test)]
mod tests;
