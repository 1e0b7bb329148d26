//! CPU kernels: the per-group GEMMs of a grouped product, run in parallel over groups
//! and tiles with rayon on `matrixmultiply`'s strided sgemm/dgemm, the decomposition of
//! a validated product into those GEMMs (`problems`: [`packed_problems`],
//! [`list_problems`]), and the row ops of the MoE glue (`rows`).
//!
//! float64 runs dgemm, float32 sgemm, both reading the operands in place through their
//! strides. float16 and bfloat16 tiles are widened to f32, multiplied with f32
//! accumulation and rounded once on the way out.

mod problems;
pub(crate) mod rows;

pub use problems::{list_problems, packed_problems, MatRef, Problem, TAIL};

use crate::dtype::{DType, Element};
use rayon::prelude::*;

/// One GEMM on raw pointers: `C[m, n] = A[m, k] · B[k, n]` (`k == 0` writes zeros).
///
/// Strides are in elements and may be zero or any sign for `A` and `B`; `C` must not
/// overlap itself or any other `C` of the same call.
#[derive(Debug, Clone, Copy)]
pub struct Gemm<TI, TO> {
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// Reduction length.
    pub k: usize,
    /// `A[0, 0]`.
    pub a: *const TI,
    /// Row and column strides of A.
    pub a_s: (isize, isize),
    /// `B[0, 0]`.
    pub b: *const TI,
    /// Row and column strides of B.
    pub b_s: (isize, isize),
    /// `C[0, 0]`.
    pub c: *mut TO,
    /// Row and column strides of C.
    pub c_s: (isize, isize),
}

// SAFETY: a `Gemm` is a description of memory the caller guarantees to be valid for the
// duration of `run`; the kernels only read through `a`/`b` and each task writes a
// disjoint part of one `c` (see `run`'s contract), so sharing it across threads is sound.
unsafe impl<TI, TO> Send for Gemm<TI, TO> {}
// SAFETY: as above.
unsafe impl<TI, TO> Sync for Gemm<TI, TO> {}

impl<TI, TO> Gemm<TI, TO> {
    /// Builds the GEMM of `p` on the operand bases `a`, `b` and output base `c`.
    ///
    /// # Safety
    /// Every element `p` addresses relative to the bases must lie inside the
    /// corresponding allocation (guaranteed for problems from [`packed_problems`] or
    /// [`list_problems`] built on the same layouts).
    pub unsafe fn from_problem(p: &Problem, a: *const TI, b: *const TI, c: *mut TO) -> Self {
        // SAFETY: offsets stay inside the allocations by the caller's contract; when
        // k == 0 the a/b pointers are never dereferenced, so wrapping_offset keeps even a
        // dangling base harmless.
        Gemm {
            m: p.m,
            n: p.n,
            k: p.k,
            a: a.wrapping_offset(p.a.off),
            a_s: (p.a.rs, p.a.cs),
            b: b.wrapping_offset(p.b.off),
            b_s: (p.b.rs, p.b.cs),
            c: c.offset(p.c.off),
            c_s: (p.c.rs, p.c.cs),
        }
    }

    fn sub(&self, r0: usize, r1: usize, c0: usize, c1: usize) -> Self {
        Gemm {
            m: r1 - r0,
            n: c1 - c0,
            k: self.k,
            a: self.a.wrapping_offset(r0 as isize * self.a_s.0),
            a_s: self.a_s,
            b: self.b.wrapping_offset(c0 as isize * self.b_s.1),
            b_s: self.b_s,
            c: self
                .c
                .wrapping_offset(r0 as isize * self.c_s.0 + c0 as isize * self.c_s.1),
            c_s: self.c_s,
        }
    }
}

/// Runs the problems of a packed product whose operands start at `a`, `b` and whose
/// output starts at `c`.
///
/// # Safety
/// The problems must come from [`packed_problems`] on the layouts of the
/// allocations behind `a`, `b` and `c` (so every addressed element is in bounds), `c`
/// must be non-overlapping and must not alias `a` or `b`.
pub unsafe fn run_packed<TI: Element, TO: Element>(
    problems: &[Problem],
    a: *const TI,
    b: *const TI,
    c: *mut TO,
) {
    // SAFETY: forwarded contract.
    let gemms: Vec<_> = problems
        .iter()
        .map(|p| unsafe { Gemm::from_problem(p, a, b, c) })
        .collect();
    // SAFETY: forwarded contract.
    unsafe { run(&gemms) }
}

/// Runs the problems of a list product; problem `p` reads `a[p.group]`, `b[p.group]`
/// and writes `c[p.group]`.
///
/// # Safety
/// As [`run_packed`], per group, with problems from [`list_problems`];
/// no two outputs may overlap.
pub unsafe fn run_list<TI: Element, TO: Element>(
    problems: &[Problem],
    a: &[*const TI],
    b: &[*const TI],
    c: &[*mut TO],
) {
    // SAFETY: forwarded contract.
    let gemms: Vec<_> = problems
        .iter()
        .map(|p| unsafe { Gemm::from_problem(p, a[p.group], b[p.group], c[p.group]) })
        .collect();
    // SAFETY: forwarded contract.
    unsafe { run(&gemms) }
}

/// Work per task, in multiply-adds, below which a tile is not split further.
const MIN_TASK_MACS: usize = 1 << 17;

/// Splits the GEMMs into tiles so that rayon has several tasks per thread even when a
/// product has one large group or many tiny ones.
fn tiles<TI, TO>(gemms: &[Gemm<TI, TO>]) -> Vec<Gemm<TI, TO>> {
    let threads = rayon::current_num_threads().max(1);
    let total: usize = gemms.iter().map(|g| g.m * g.n * g.k.max(1)).sum();
    let per_task = (total / (4 * threads)).max(MIN_TASK_MACS);
    let mut out = Vec::with_capacity(gemms.len());
    for g in gemms.iter().filter(|g| g.m > 0 && g.n > 0) {
        let macs = g.m * g.n * g.k.max(1);
        let pieces = macs.div_ceil(per_task).max(1);
        // rows first (keeps B shared), blocks of at least 16 rows and 64 columns
        let pr = pieces.min(g.m.div_ceil(16)).max(1);
        let pc = pieces.div_ceil(pr).min(g.n.div_ceil(64)).max(1);
        let (rstep, cstep) = (g.m.div_ceil(pr), g.n.div_ceil(pc));
        for r0 in (0..g.m).step_by(rstep) {
            for c0 in (0..g.n).step_by(cstep) {
                out.push(g.sub(r0, (r0 + rstep).min(g.m), c0, (c0 + cstep).min(g.n)));
            }
        }
    }
    out
}

/// Runs every GEMM, in parallel over groups and tiles, on the current rayon pool.
///
/// # Safety
/// For each GEMM, `a`, `b` must be valid for reads of every element addressed by
/// `(m, k)`/`(k, n)` and the strides, and `c` valid for writes of every element of
/// `(m, n)`; no two output elements (within or across GEMMs) may share memory, and no
/// output may overlap an input.
pub unsafe fn run<TI: Element, TO: Element>(gemms: &[Gemm<TI, TO>]) {
    let total: usize = gemms.iter().map(|g| g.m * g.n * g.k.max(1)).sum();
    if total < SERIAL_MACS {
        // Waking the pool costs more than this much arithmetic.
        for g in gemms.iter().filter(|g| g.m > 0 && g.n > 0) {
            // SAFETY: caller's contract.
            unsafe { run_tile(g) }
        }
        return;
    }
    let tasks = tiles(gemms);
    tasks.par_iter().for_each(|t| {
        // SAFETY: each tile is a disjoint sub-block of a valid GEMM (caller's contract).
        unsafe { run_tile(t) }
    });
}

/// Products smaller than this many multiply-adds run on the calling thread.
const SERIAL_MACS: usize = 1 << 16;

unsafe fn zero_fill<TO: Element>(g: &Gemm<impl Sized, TO>) {
    for i in 0..g.m {
        for j in 0..g.n {
            // SAFETY: (i, j) is inside C by the caller's contract.
            unsafe {
                *g.c.offset(i as isize * g.c_s.0 + j as isize * g.c_s.1) = TO::zero();
            }
        }
    }
}

unsafe fn run_tile<TI: Element, TO: Element>(g: &Gemm<TI, TO>) {
    if g.k == 0 {
        // SAFETY: forwarded contract.
        unsafe { zero_fill(g) };
        return;
    }
    match (TI::DTYPE, TO::DTYPE) {
        // SAFETY: the dtype tags prove TI == TO == f64 (resp. f32), so the casts are
        // identity casts; the pointers and strides come from the caller's contract.
        (DType::F64, DType::F64) => unsafe {
            matrixmultiply::dgemm(
                g.m,
                g.k,
                g.n,
                1.0,
                g.a as *const f64,
                g.a_s.0,
                g.a_s.1,
                g.b as *const f64,
                g.b_s.0,
                g.b_s.1,
                0.0,
                g.c as *mut f64,
                g.c_s.0,
                g.c_s.1,
            )
        },
        // SAFETY: as the f64 arm, for f32.
        (DType::F32, DType::F32) => unsafe {
            matrixmultiply::sgemm(
                g.m,
                g.k,
                g.n,
                1.0,
                g.a as *const f32,
                g.a_s.0,
                g.a_s.1,
                g.b as *const f32,
                g.b_s.0,
                g.b_s.1,
                0.0,
                g.c as *mut f32,
                g.c_s.0,
                g.c_s.1,
            )
        },
        // SAFETY: forwarded contract.
        _ => unsafe { run_tile_widened(g) },
    }
}

/// 16-bit inputs (or a 16-bit → f32 output): widen A and B to contiguous f32, sgemm,
/// round into C.
unsafe fn run_tile_widened<TI: Element, TO: Element>(g: &Gemm<TI, TO>) {
    let (m, n, k) = (g.m, g.n, g.k);
    let mut a = vec![0f32; m * k];
    let mut b = vec![0f32; k * n];
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for p in 0..k {
            // SAFETY: (i, p) is inside A by the caller's contract.
            a[i * k + p] =
                unsafe { *g.a.offset(i as isize * g.a_s.0 + p as isize * g.a_s.1) }.to_f32();
        }
    }
    for p in 0..k {
        for j in 0..n {
            // SAFETY: (p, j) is inside B by the caller's contract.
            b[p * n + j] =
                unsafe { *g.b.offset(p as isize * g.b_s.0 + j as isize * g.b_s.1) }.to_f32();
        }
    }
    // SAFETY: the three buffers are contiguous, sized m*k, k*n and m*n above.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            k as isize,
            1,
            b.as_ptr(),
            n as isize,
            1,
            0.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
    for i in 0..m {
        for j in 0..n {
            // SAFETY: (i, j) is inside C by the caller's contract.
            unsafe {
                *g.c.offset(i as isize * g.c_s.0 + j as isize * g.c_s.1) =
                    TO::from_f32(c[i * n + j]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cover_each_gemm() {
        let a = [0f32; 1];
        let mut c = [0f32; 1];
        let g = Gemm::<f32, f32> {
            m: 1000,
            n: 300,
            k: 512,
            a: a.as_ptr(),
            a_s: (1, 1),
            b: a.as_ptr(),
            b_s: (1, 1),
            c: c.as_mut_ptr(),
            c_s: (300, 1),
        };
        let ts = tiles(&[g]);
        let area: usize = ts.iter().map(|t| t.m * t.n).sum();
        assert_eq!(area, 1000 * 300);
        assert!(!ts.is_empty());
    }
}
