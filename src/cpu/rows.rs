//! The CPU loops of the MoE glue's row ops (what each computes: [`crate::shape::RowsOp`];
//! the CUDA kernels are `cuda/device/rows.cu`): one parallel pass over the output rows
//! with rayon, arithmetic in f64 and one rounding per output element, a fixed summation
//! order (deterministic), and an index outside `[0, R)` read and written nowhere (the
//! engine rejects one before the loops run: `shape::check_indices`). TopK selects each
//! row's `k` best columns in `shape::topk_before`'s order, comparing the values exactly.

use crate::dtype::{DType, Element};
use crate::shape::{topk_before, RowPtrs, RowsDims, RowsOp};
use half::{bf16, f16};
use rayon::prelude::*;

/// Runs a validated row op: operands of `dtype`, weights (and RowDots' output) of
/// `w_dtype` (`dtype` or float32); TopK's output is int64.
///
/// # Safety
/// `p` holds live contiguous arrays of the extents `d` and the dtypes given (host
/// memory); `out` is disjoint from the inputs.
pub(crate) unsafe fn run(d: &RowsDims, dtype: DType, w_dtype: DType, p: RowPtrs) {
    macro_rules! go {
        ($T:ty) => {
            match w_dtype {
                // SAFETY: forwarded contract.
                DType::F32 => unsafe { rows_typed::<$T, f32>(d, p) },
                // SAFETY: forwarded contract (weights of the operands' dtype).
                _ => unsafe { rows_typed::<$T, $T>(d, p) },
            }
        };
    }
    match dtype {
        DType::F16 => go!(f16),
        DType::BF16 => go!(bf16),
        DType::F32 => go!(f32),
        DType::F64 => go!(f64),
    }
}

/// # Safety
/// As [`run`].
unsafe fn rows_typed<T: Element, W: Element>(d: &RowsDims, p: RowPtrs) {
    let RowsDims {
        op,
        tokens,
        top_k,
        rows,
        cols,
    } = *d;
    // SAFETY (every slice below): contiguous arrays of these extents (validated).
    let slice = |ptr: usize, len: usize| -> &[T] {
        if len == 0 {
            &[]
        } else {
            unsafe { std::slice::from_raw_parts(ptr as *const T, len) }
        }
    };
    let inverse: &[i32] = if p.inverse == 0 || tokens * top_k == 0 {
        &[]
    } else {
        unsafe { std::slice::from_raw_parts(p.inverse as *const i32, tokens * top_k) }
    };
    let weights: Option<&[W]> = (p.weights != 0 && tokens * top_k > 0)
        .then(|| unsafe { std::slice::from_raw_parts(p.weights as *const W, tokens * top_k) });
    let w = |i: usize| weights.map_or(1.0, |w| w[i].to_f64());
    let row_of = |i: usize| usize::try_from(inverse[i]).ok().filter(|&r| r < rows);
    let out_len = match op {
        RowsOp::Swiglu => rows * cols,
        RowsOp::SwigluBackward => rows * 2 * cols,
        RowsOp::GatherSum => tokens * cols,
        RowsOp::ScatterRows => rows * cols,
        RowsOp::RowDots | RowsOp::TopK => 0,
    };
    if op == RowsOp::RowDots {
        if tokens * top_k == 0 {
            return;
        }
        let out = unsafe { std::slice::from_raw_parts_mut(p.out as *mut W, tokens * top_k) };
        let (g, y) = (slice(p.x, tokens * cols), slice(p.y, rows * cols));
        out.par_iter_mut().enumerate().for_each(|(i, o)| {
            let s = row_of(i).map_or(0.0, |r| {
                let (a, b) = (&g[(i / top_k) * cols..][..cols], &y[r * cols..][..cols]);
                a.iter().zip(b).map(|(u, v)| u.to_f64() * v.to_f64()).sum()
            });
            *o = W::from_f64(s);
        });
        return;
    }
    if op == RowsOp::TopK {
        if tokens * top_k == 0 {
            return;
        }
        let out = unsafe { std::slice::from_raw_parts_mut(p.out as *mut i64, tokens * top_k) };
        let scores = slice(p.x, tokens * cols);
        out.par_chunks_mut(top_k)
            .zip(scores.par_chunks(cols))
            .for_each_init(Vec::new, |order, (o, row)| top_k_row(row, order, o));
        return;
    }
    if out_len == 0 {
        return;
    }
    let out = unsafe { std::slice::from_raw_parts_mut(p.out as *mut T, out_len) };
    match op {
        RowsOp::Swiglu => {
            let pre = slice(p.x, rows * 2 * cols);
            out.par_chunks_mut(cols).enumerate().for_each(|(r, o)| {
                let (g, u) = pre[r * 2 * cols..][..2 * cols].split_at(cols);
                for c in 0..cols {
                    let gv = g[c].to_f64();
                    o[c] = T::from_f64(gv / (1.0 + (-gv).exp()) * u[c].to_f64());
                }
            });
        }
        RowsOp::SwigluBackward => {
            let (grad, pre) = (slice(p.x, rows * cols), slice(p.y, rows * 2 * cols));
            out.par_chunks_mut(2 * cols).enumerate().for_each(|(r, o)| {
                let (g, u) = pre[r * 2 * cols..][..2 * cols].split_at(cols);
                let dh = &grad[r * cols..][..cols];
                let (dg, du) = o.split_at_mut(cols);
                for c in 0..cols {
                    let (d, gv, uv) = (dh[c].to_f64(), g[c].to_f64(), u[c].to_f64());
                    let s = 1.0 / (1.0 + (-gv).exp());
                    dg[c] = T::from_f64(d * uv * s * (1.0 + gv * (1.0 - s)));
                    du[c] = T::from_f64(d * gv * s);
                }
            });
        }
        RowsOp::GatherSum => {
            let y = slice(p.x, rows * cols);
            out.par_chunks_mut(cols).enumerate().for_each(|(t, o)| {
                let mut acc = vec![0.0f64; cols];
                for j in 0..top_k {
                    if let Some(r) = row_of(t * top_k + j) {
                        let wj = w(t * top_k + j);
                        for (a, v) in acc.iter_mut().zip(&y[r * cols..][..cols]) {
                            *a += wj * v.to_f64();
                        }
                    }
                }
                for (o, a) in o.iter_mut().zip(acc) {
                    *o = T::from_f64(a);
                }
            });
        }
        RowsOp::ScatterRows => {
            // Row by row through the inverse permutation, as on the GPU.
            let grad = slice(p.x, tokens * cols);
            let mut assign = vec![usize::MAX; rows];
            for i in 0..tokens * top_k {
                if let Some(r) = row_of(i) {
                    assign[r] = i;
                }
            }
            out.par_chunks_mut(cols).zip(assign).for_each(|(o, a)| {
                if a == usize::MAX {
                    o.fill(T::zero());
                } else {
                    let wa = w(a);
                    for (o, g) in o.iter_mut().zip(&grad[(a / top_k) * cols..][..cols]) {
                        *o = T::from_f64(wa * g.to_f64());
                    }
                }
            });
        }
        RowsOp::RowDots | RowsOp::TopK => {}
    }
}

/// TopK on one row: `out` (`k = out.len()`, `1 <= k <= row.len()`) gets the columns of
/// the `k` best values of `row`, best first, in `shape::topk_before`'s order (a strict
/// total order, so the result does not depend on how the selection runs); `order` is
/// scratch, reused across rows.
fn top_k_row<T: Element>(row: &[T], order: &mut Vec<usize>, out: &mut [i64]) {
    let k = out.len();
    let rank = |a: &usize, b: &usize| {
        let (va, vb) = (row[*a].to_f64(), row[*b].to_f64());
        if topk_before(va, *a, vb, *b) {
            std::cmp::Ordering::Less
        } else if a == b {
            std::cmp::Ordering::Equal
        } else {
            std::cmp::Ordering::Greater
        }
    };
    order.clear();
    order.extend(0..row.len());
    if k < order.len() {
        order.select_nth_unstable_by(k - 1, rank);
    }
    order[..k].sort_unstable_by(rank);
    for (o, &c) in out.iter_mut().zip(order.iter()) {
        *o = c as i64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// The k best columns by brute force: repeatedly the best column not yet taken.
    fn reference(row: &[f64], k: usize) -> Vec<i64> {
        let mut taken = vec![false; row.len()];
        (0..k)
            .map(|_| {
                let mut best: Option<usize> = None;
                for c in (0..row.len()).filter(|&c| !taken[c]) {
                    if best.map_or(true, |b| topk_before(row[c], c, row[b], b)) {
                        best = Some(c);
                    }
                }
                let b = best.unwrap();
                taken[b] = true;
                b as i64
            })
            .collect()
    }

    fn top_k<T: Element>(row: &[T], k: usize) -> Vec<i64> {
        let mut out = vec![-1i64; k];
        top_k_row(row, &mut Vec::new(), &mut out);
        out
    }

    /// Every k of rows with ties, infinities, signed zeros and NaNs against the
    /// brute-force selection, in each dtype the values are exact in.
    #[test]
    fn top_k_row_against_brute_force() {
        let nan = f64::NAN;
        let mut rows: Vec<Vec<f64>> = vec![
            vec![0.5],
            vec![3.0, 1.0, 2.0, 5.0, 4.0],
            vec![1.0, 1.0, 1.0, 1.0],
            vec![2.0, 7.0, 7.0, -1.0, 7.0, 2.0],
            vec![f64::NEG_INFINITY, -1.0, f64::INFINITY, 0.0, f64::INFINITY],
            vec![-0.0, 0.0, -0.0, 0.25, 0.0],
            vec![1.0, nan, 2.0, nan, f64::INFINITY, -3.0],
            vec![nan, nan, nan],
            vec![f64::NEG_INFINITY; 3],
        ];
        let mut state = 12345u64;
        let mut random = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) % 9) as f64 - 4.0 // small integers: many ties, exact in bf16
        };
        for e in [7, 33, 64, 130] {
            rows.push((0..e).map(|_| random()).collect());
        }
        for row in &rows {
            for k in 1..=row.len() {
                let want = reference(row, k);
                assert_eq!(top_k(row, k), want, "f64 {row:?} k={k}");
                let r32: Vec<f32> = row.iter().map(|&v| v as f32).collect();
                assert_eq!(top_k(&r32, k), want, "f32 {row:?} k={k}");
                let r16: Vec<f16> = row.iter().map(|&v| f16::from_f64(v)).collect();
                assert_eq!(top_k(&r16, k), want, "f16 {row:?} k={k}");
                let rb: Vec<bf16> = row.iter().map(|&v| bf16::from_f64(v)).collect();
                assert_eq!(top_k(&rb, k), want, "bf16 {row:?} k={k}");
            }
        }
        assert_eq!(top_k(&[1.0f64, 1.0, 1.0, 1.0], 3), vec![0, 1, 2]);
        assert_eq!(
            top_k(&[1.0, nan, 2.0, nan, f64::INFINITY], 4),
            vec![1, 3, 4, 2]
        );
    }

    /// The whole op over rows in parallel: each row's ids in its own output row.
    #[test]
    fn top_k_over_rows() {
        let (tokens, cols, k) = (37, 9, 4);
        let scores: Vec<f32> = (0..tokens * cols)
            .map(|i| ((i * 7919) % 101) as f32 - 50.0)
            .collect();
        let mut out = vec![-1i64; tokens * k];
        let d = RowsDims {
            op: RowsOp::TopK,
            tokens,
            top_k: k,
            rows: tokens,
            cols,
        };
        let p = RowPtrs {
            x: scores.as_ptr() as usize,
            out: out.as_mut_ptr() as usize,
            ..Default::default()
        };
        unsafe { run(&d, DType::F32, DType::F32, p) };
        for t in 0..tokens {
            let row: Vec<f64> = scores[t * cols..][..cols]
                .iter()
                .map(|&v| v as f64)
                .collect();
            assert_eq!(&out[t * k..][..k], reference(&row, k).as_slice(), "row {t}");
        }
    }
}
