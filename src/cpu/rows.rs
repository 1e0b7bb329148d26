//! The CPU loops of the MoE glue's row ops (what each computes: [`crate::shape::RowsOp`];
//! the CUDA kernels are `cuda/device/rows.cu`): one parallel pass over the output rows
//! with rayon, arithmetic in f64 and one rounding per output element, a fixed summation
//! order (deterministic), and an index outside `[0, R)` read and written nowhere (the
//! engine rejects one before the loops run: `shape::check_indices`).

use crate::dtype::{DType, Element};
use crate::shape::{RowPtrs, RowsDims, RowsOp};
use half::{bf16, f16};
use rayon::prelude::*;

/// Runs a validated row op: operands of `dtype`, weights (and RowDots' output) of
/// `w_dtype` (`dtype` or float32).
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
        RowsOp::RowDots => 0,
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
        RowsOp::RowDots => {}
    }
}
