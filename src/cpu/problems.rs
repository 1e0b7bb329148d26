//! The CPU path's decomposition of a validated product into per-group GEMMs
//! ([`Problem`]s on strided matrices), which [`super::run_packed`] and
//! [`super::run_list`] run. The CUDA argument builder makes the same per-group problems
//! on the device from `offs` (`cuda/device/args.cu`), following the same clamp rule
//! ([`crate::shape::clamp_spans`]).

use crate::layout::Layout;
use crate::shape::{clamp_spans, Form, GroupDims, PackedDims};

/// A strided matrix inside a buffer: element offset of `[0, 0]` and the row and
/// column strides, all in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatRef {
    /// Offset of element `[0, 0]` from the operand's base.
    pub off: isize,
    /// Row stride.
    pub rs: isize,
    /// Column stride.
    pub cs: isize,
}

/// One GEMM `C[m, n] = A[m, k] · B[k, n]` of a grouped product. `k == 0` means "write
/// zeros to C".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Problem {
    /// Group index this problem belongs to, or `usize::MAX` for a zero tail.
    pub group: usize,
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// Reduction length.
    pub k: usize,
    /// A inside `a`.
    pub a: MatRef,
    /// B inside `b`.
    pub b: MatRef,
    /// C inside the output.
    pub c: MatRef,
}

/// Group id used for zero-filled tails past the last offset.
pub const TAIL: usize = usize::MAX;

fn mat(l: &Layout, batch: Option<usize>, row0: usize, col0: usize) -> MatRef {
    let nd = l.ndim();
    let (rs, cs) = (l.strides[nd - 2], l.strides[nd - 1]);
    let mut off = row0 as isize * rs + col0 as isize * cs;
    if let Some(bi) = batch {
        off += bi as isize * l.strides[0];
    }
    MatRef { off, rs, cs }
}

/// Splits a validated packed product into per-group problems that exactly cover the
/// output `c` (shape `plan.out_shape`), including zero problems for tails.
///
/// `offs` should have passed [`crate::shape::check_offs`]; spans are clamped with
/// [`clamp_spans`] anyway, so no problem ever leaves its operands.
pub fn packed_problems(
    plan: &PackedDims,
    a: &Layout,
    b: &Layout,
    c: &Layout,
    offs: Option<&[i32]>,
) -> Vec<Problem> {
    let mut out = Vec::with_capacity(plan.groups + 1);
    let spans = clamp_spans(offs.unwrap_or(&[]), plan.offs_extent);
    let span = |g: usize| spans[g];
    let last_end = |g: usize| if g == 0 { 0 } else { spans[g - 1].1 };
    match plan.form {
        Form::GroupedM => {
            for g in 0..plan.groups {
                let (s, e) = span(g);
                out.push(Problem {
                    group: g,
                    m: e - s,
                    n: plan.n,
                    k: plan.k,
                    a: mat(a, None, s, 0),
                    b: mat(b, Some(g), 0, 0),
                    c: mat(c, None, s, 0),
                });
            }
            let end = last_end(plan.groups);
            out.push(Problem {
                group: TAIL,
                m: plan.m - end,
                n: plan.n,
                k: 0,
                a: mat(a, None, 0, 0),
                b: MatRef {
                    off: 0,
                    rs: 0,
                    cs: 0,
                },
                c: mat(c, None, end, 0),
            });
        }
        Form::GroupedK => {
            for g in 0..plan.groups {
                let (s, e) = span(g);
                out.push(Problem {
                    group: g,
                    m: plan.m,
                    n: plan.n,
                    k: e - s,
                    a: mat(a, None, 0, s),
                    b: mat(b, None, s, 0),
                    c: mat(c, Some(g), 0, 0),
                });
            }
        }
        Form::GroupedN => {
            for g in 0..plan.groups {
                let (s, e) = span(g);
                out.push(Problem {
                    group: g,
                    m: plan.m,
                    n: e - s,
                    k: plan.k,
                    a: mat(a, Some(g), 0, 0),
                    b: mat(b, None, 0, s),
                    c: mat(c, None, 0, s),
                });
            }
            let end = last_end(plan.groups);
            out.push(Problem {
                group: TAIL,
                m: plan.m,
                n: plan.n - end,
                k: 0,
                a: MatRef {
                    off: 0,
                    rs: 0,
                    cs: 0,
                },
                b: MatRef {
                    off: 0,
                    rs: 0,
                    cs: 0,
                },
                c: mat(c, None, 0, end),
            });
        }
        Form::Batched => {
            for g in 0..plan.groups {
                out.push(Problem {
                    group: g,
                    m: plan.m,
                    n: plan.n,
                    k: plan.k,
                    a: mat(a, Some(g), 0, 0),
                    b: mat(b, Some(g), 0, 0),
                    c: mat(c, Some(g), 0, 0),
                });
            }
        }
    }
    out.retain(|p| p.m > 0 && p.n > 0);
    out
}

/// Per-group problems of a list product: group `i` reads `As[i]`, `Bs[i]` and writes
/// `Cs[i]`, each at offset 0 of its own buffer.
pub fn list_problems<A: AsRef<Layout>, B: AsRef<Layout>, C: AsRef<Layout>>(
    dims: &[GroupDims],
    a: &[A],
    b: &[B],
    c: &[C],
) -> Vec<Problem> {
    dims.iter()
        .enumerate()
        .filter(|(_, d)| d.m > 0 && d.n > 0)
        .map(|(i, d)| Problem {
            group: i,
            m: d.m,
            n: d.n,
            k: d.k,
            a: mat(a[i].as_ref(), None, 0, 0),
            b: mat(b[i].as_ref(), None, 0, 0),
            c: mat(c[i].as_ref(), None, 0, 0),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::plan_packed;

    fn c(shape: &[usize]) -> Layout {
        Layout::contiguous(shape)
    }

    #[test]
    fn problems_cover_output_once() {
        let (a, b) = (c(&[10, 4]), c(&[3, 4, 5]));
        let p = plan_packed(&a, &b, Some(3)).unwrap();
        let out = c(&p.out_shape);
        let probs = packed_problems(&p, &a, &b, &out, Some(&[2, 2, 7]));
        let rows: usize = probs.iter().map(|q| q.m).sum();
        assert_eq!(rows, 10);
        assert_eq!(probs.last().unwrap().group, TAIL);
    }
}
