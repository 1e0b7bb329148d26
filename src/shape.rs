//! The rules: the one module that decides whether a grouped product is valid, what its
//! output looks like and how it splits into per-group GEMMs, and that words every
//! message about a bad argument (shapes, `offs`, counts of outputs and gradients, the
//! gradient's shape, `out=`, dtype and device agreement). See ARCHITECTURE.md.
//!
//! Every entry point (the ndarray API, numpy, torch on CPU and on CUDA) reaches these
//! rules through the engine (`crate::exec`), which describes operands as [`Layout`]s
//! (shape and strides in elements) and calls [`plan_list`] or [`plan_packed`] once per
//! product. CPU runs then turn a plan into per-group problems with [`list_problems`] /
//! [`packed_problems`]; the CUDA argument builder makes the same per-group problems on
//! the device from `offs` (`cuda/device/args.cu`), following the rules written here.
//!
//! # Forms
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
//! # Backward
//!
//! For every form, `dA = grouped_mm(dC, bᵀ, offs)` and `dB = grouped_mm(aᵀ, dC, offs)`,
//! where `ᵀ` swaps the last two dimensions (a stride swap, no copy). The form of each
//! product follows from the dimensions, so [`backward_layouts`] is all the backward
//! needs. A column-major operand (a transposed view) gets its gradient in its own
//! layout, computed as `dAᵀ = grouped_mm(b, dCᵀ)` / `dBᵀ = grouped_mm(dCᵀ, a)`.

use crate::dtype::DType;
use crate::error::{shape_err, Error, Result};
use std::fmt::Display;

/// Shape and strides (in elements) of a 1-, 2- or 3-D operand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Extent of each dimension.
    pub shape: Vec<usize>,
    /// Distance in elements between neighbours along each dimension.
    pub strides: Vec<isize>,
}

impl AsRef<Layout> for Layout {
    fn as_ref(&self) -> &Layout {
        self
    }
}

impl Layout {
    /// A layout from shape and strides.
    pub fn new(shape: &[usize], strides: &[isize]) -> Self {
        debug_assert_eq!(shape.len(), strides.len());
        Layout {
            shape: shape.to_vec(),
            strides: strides.to_vec(),
        }
    }

    /// The row-major contiguous layout of `shape`.
    pub fn contiguous(shape: &[usize]) -> Self {
        let mut strides = vec![0isize; shape.len()];
        let mut s = 1isize;
        for i in (0..shape.len()).rev() {
            strides[i] = s;
            s *= shape[i].max(1) as isize;
        }
        Layout {
            shape: shape.to_vec(),
            strides,
        }
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The same memory with its last two dimensions swapped.
    pub fn transposed(&self) -> Self {
        let mut t = self.clone();
        let n = t.shape.len();
        if n >= 2 {
            t.shape.swap(n - 2, n - 1);
            t.strides.swap(n - 2, n - 1);
        }
        t
    }

    /// True when the layout is row-major contiguous (dimensions of extent 1 may have
    /// any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1isize;
        for i in (0..self.shape.len()).rev() {
            if self.shape[i] != 1 && self.strides[i] != expected {
                return false;
            }
            expected *= self.shape[i] as isize;
        }
        true
    }

    /// True when no two in-range indices address the same element (required of
    /// outputs). Empty layouts never overlap.
    pub fn is_non_overlapping(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let mut dims: Vec<(usize, usize)> = self
            .shape
            .iter()
            .zip(&self.strides)
            .filter(|(&n, _)| n > 1)
            .map(|(&n, &s)| (n, s.unsigned_abs()))
            .collect();
        dims.sort_by_key(|&(_, s)| s);
        let mut span = 1usize; // elements covered by the inner dimensions
        for (n, s) in dims {
            if s < span {
                return false;
            }
            span += s * (n - 1);
        }
        true
    }

    /// Smallest and largest element offset reached (0, 0 for empty layouts).
    pub fn offset_range(&self) -> (isize, isize) {
        if self.numel() == 0 {
            return (0, 0);
        }
        let (mut lo, mut hi) = (0isize, 0isize);
        for (&n, &s) in self.shape.iter().zip(&self.strides) {
            let reach = s * (n as isize - 1);
            if reach < 0 {
                lo += reach;
            } else {
                hi += reach;
            }
        }
        (lo, hi)
    }
}

/// Formats a shape the way PyTorch prints it: `[2, 3, 4]`.
pub fn fmt_shape(shape: &[usize]) -> String {
    let parts: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

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

impl Form {
    /// Stable integer code shared with the CUDA launchers.
    pub fn code(self) -> i32 {
        match self {
            Form::GroupedM => 0,
            Form::GroupedK => 1,
            Form::GroupedN => 2,
            Form::Batched => 3,
        }
    }
}

/// A validated packed product.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedPlan {
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

fn need_ndim(arg: &str, l: &Layout, allowed: &[usize]) -> Result<()> {
    if allowed.contains(&l.ndim()) {
        Ok(())
    } else {
        Err(shape_err(format!(
            "{arg}: expected a {}-D tensor, found {}-D with shape {}",
            allowed
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join("- or "),
            l.ndim(),
            fmt_shape(&l.shape)
        )))
    }
}

/// Validates a packed product and returns its plan.
///
/// `offs_len` is `Some(len)` when `offs` was given. Names in messages are `a`, `b` and
/// `offs`, the arguments of `grouped_mm`.
pub fn plan_packed(a: &Layout, b: &Layout, offs_len: Option<usize>) -> Result<PackedPlan> {
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
            Ok(PackedPlan {
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
            Ok(PackedPlan {
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
            Ok(PackedPlan {
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
            Ok(PackedPlan {
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

/// Checks `offs` values read on the host: each in `0..=extent`, non-decreasing.
///
/// CUDA callers never read `offs` on the host; their kernels clamp instead (see
/// [`clamp_spans`]).
pub fn check_offs(offs: &[i32], plan: &PackedPlan) -> Result<()> {
    let what = match plan.form {
        Form::GroupedM => "a.shape[0] (T)",
        Form::GroupedK => "a.shape[1] (T)",
        Form::GroupedN => "b.shape[1] (N)",
        Form::Batched => return Ok(()),
    };
    if offs.len() != plan.groups {
        return Err(shape_err(format!(
            "offs: expected {} entries, found {}",
            plan.groups,
            offs.len()
        )));
    }
    let mut prev = 0i64;
    for (g, &o) in offs.iter().enumerate() {
        let o = o as i64;
        if o < 0 {
            return Err(Error::Value(format!(
                "offs: group {g} ends at {o}; offsets must be >= 0"
            )));
        }
        if o < prev {
            return Err(Error::Value(format!(
                "offs: group {g} ends at {o}, before group {} ends at {prev}; offsets must be non-decreasing",
                g - 1
            )));
        }
        if o as usize > plan.offs_extent {
            return Err(Error::Value(format!(
                "offs: group {g} ends at {o}, past {what} = {}",
                plan.offs_extent
            )));
        }
        prev = o;
    }
    Ok(())
}

/// What a call on CUDA raises when an earlier call's kernels met invalid `offs` (the
/// device never reads `offs` on the host: the argument builder clamps the spans exactly
/// as [`clamp_spans`] and raises a per-device flag that the next call reads).
pub fn offs_error_pending(device: impl Display) -> Error {
    Error::Value(format!(
        "offs: an earlier grouped_mm call on {device} received invalid offs (negative, \
         decreasing or past the end); its groups were clamped to the valid range. \
         CUDA reports this asynchronously, at the next call"
    ))
}

/// The spans `[start, end)` of every group, clamped so that any `offs` (decreasing,
/// negative, past the end) gives spans inside `0..=extent` that are ordered and
/// disjoint: `end_g` is the running maximum of `offs[0..=g]` clamped to `0..=extent`,
/// `start_g = end_{g-1}` (0 for the first group). Valid `offs` pass through unchanged.
/// The CUDA argument builder applies the same rule (a block-wide max-scan).
pub fn clamp_spans(offs: &[i32], extent: usize) -> Vec<(usize, usize)> {
    let mut end = 0usize;
    offs.iter()
        .map(|&v| {
            let start = end;
            end = end.max((v.max(0) as usize).min(extent));
            (start, end)
        })
        .collect()
}

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
/// `offs` should have passed [`check_offs`]; spans are clamped with [`clamp_spans`]
/// anyway, so no problem ever leaves its operands.
pub fn packed_problems(
    plan: &PackedPlan,
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

/// Per-group `(m, n, k)` of a validated list product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupDims {
    /// Rows of `As[i]` and of the output.
    pub m: usize,
    /// Columns of `Bs[i]` and of the output.
    pub n: usize,
    /// Columns of `As[i]`, rows of `Bs[i]`.
    pub k: usize,
}

/// Validates the list form: `As[i]` is `[M_i, K_i]`, `Bs[i]` is `[K_i, N_i]`.
pub fn plan_list<A: AsRef<Layout>, B: AsRef<Layout>>(a: &[A], b: &[B]) -> Result<Vec<GroupDims>> {
    if a.len() != b.len() {
        return Err(shape_err(format!(
            "As and Bs: expected sequences of the same length, found {} and {}",
            a.len(),
            b.len()
        )));
    }
    let mut dims = Vec::with_capacity(a.len());
    for (i, (la, lb)) in a.iter().zip(b).enumerate() {
        let (la, lb) = (la.as_ref(), lb.as_ref());
        if la.ndim() != 2 {
            return Err(shape_err(format!(
                "As[{i}]: expected a 2-D tensor [M, K], found {}-D with shape {}",
                la.ndim(),
                fmt_shape(&la.shape)
            )));
        }
        if lb.ndim() != 2 {
            return Err(shape_err(format!(
                "Bs[{i}]: expected a 2-D tensor [K, N], found {}-D with shape {}",
                lb.ndim(),
                fmt_shape(&lb.shape)
            )));
        }
        let (m, k) = (la.shape[0], la.shape[1]);
        if lb.shape[0] != k {
            return Err(shape_err(format!(
                "Bs[{i}]: expected shape [K={k}, N] (K = As[{i}].shape[1]), found {}",
                fmt_shape(&lb.shape)
            )));
        }
        dims.push(GroupDims {
            m,
            n: lb.shape[1],
            k,
        });
    }
    Ok(dims)
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

/// Something viewed with its last two dimensions swapped: a [`Layout`], or an operand
/// description that carries one.
pub trait Transposable: Clone {
    /// The same memory with its last two dimensions swapped.
    fn transposed(&self) -> Self;
}

impl Transposable for Layout {
    fn transposed(&self) -> Self {
        Layout::transposed(self)
    }
}

/// Whether the last two dimensions of `l` are stored column by column (a transposed
/// view, e.g. `w.transpose(-2, -1)` of `[E, N, K]` weights), both of them longer than 1.
pub fn column_major(l: &Layout) -> bool {
    let n = l.shape.len();
    n >= 2
        && l.shape[n - 2] > 1
        && l.shape[n - 1] > 1
        && l.strides[n - 2] == 1
        && l.strides[n - 1] != 1
}

/// Which gradients `(dA, dB)` to compute transposed so that each has its operand's own
/// layout: those of column-major operands (given as the caller received them, before
/// any contiguous copy). torch's grouped_mm backward does the same, and autograd then
/// keeps the gradient without copying it into the parameter's layout (for `[E, N, K]`
/// expert weights that copy was as long as the whole backward of a fine-grained MoE
/// block's GEMMs).
pub fn transposed_grads(a: &Layout, b: &Layout) -> [bool; 2] {
    [column_major(a), column_major(b)]
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

/// Checks that a user-supplied output has the expected shape and does not overlap
/// itself.
pub fn check_out(arg: impl Display, out: &Layout, expected: &[usize]) -> Result<()> {
    if out.shape != expected {
        return Err(shape_err(format!(
            "{arg}: expected shape {}, found {}",
            fmt_shape(expected),
            fmt_shape(&out.shape)
        )));
    }
    if !out.is_non_overlapping() {
        return Err(shape_err(format!(
            "{arg}: has overlapping memory (strides {:?}); an output must not alias itself",
            out.strides
        )));
    }
    Ok(())
}

/// The upstream gradient must have the forward output's shape (any strides, including
/// broadcast zero strides, are fine for an input).
pub fn check_grad(arg: impl Display, grad: &Layout, expected: &[usize]) -> Result<()> {
    if grad.shape != expected {
        return Err(shape_err(format!(
            "{arg}: expected shape {} (the output of the forward), found {}",
            fmt_shape(expected),
            fmt_shape(&grad.shape)
        )));
    }
    Ok(())
}

/// A sequence argument of the list form (`out=`, `grads`) holds one entry per group;
/// `each` says what an entry is, e.g. `"outputs (one per group)"`.
pub fn check_len(arg: &str, expected: usize, found: usize, each: &str) -> Result<()> {
    if expected != found {
        return Err(shape_err(format!(
            "{arg}: expected a sequence of {expected} {each}, found {found}"
        )));
    }
    Ok(())
}

/// `offs` is a 1-D tensor of group ends; returns its length.
pub fn offs_len(offs: &Layout) -> Result<usize> {
    if offs.ndim() != 1 {
        return Err(shape_err(format!(
            "offs: expected a 1-D tensor of group ends, found shape {}",
            fmt_shape(&offs.shape)
        )));
    }
    Ok(offs.shape[0])
}

/// Every operand of a call has the dtype and device of its reference operand (`a`, or
/// `As[0]` for the list form). `dtype` is `None` for `offs` (int32, checked when read).
pub fn check_like<D: PartialEq + Display>(
    arg: impl Display,
    (dtype, device): (Option<DType>, D),
    like: impl Display,
    (like_dtype, like_device): (DType, D),
) -> Result<()> {
    if let Some(d) = dtype.filter(|&d| d != like_dtype) {
        return Err(Error::Dtype(format!(
            "{arg}: expected dtype {} (the dtype of {like}), found {}",
            like_dtype.torch_name(),
            d.torch_name()
        )));
    }
    if device != like_device {
        return Err(Error::Device(format!(
            "{arg}: expected a tensor on {like_device} (the device of {like}), found one on {device}"
        )));
    }
    Ok(())
}

/// A user-supplied output has the output dtype of the call.
pub fn check_out_dtype(arg: impl Display, found: DType, expected: DType) -> Result<()> {
    if found != expected {
        return Err(Error::Dtype(format!(
            "{arg}: expected dtype {} (the output dtype), found {}",
            expected.torch_name(),
            found.torch_name()
        )));
    }
    Ok(())
}

/// `out_dtype=` of the Python API: `None` (the input dtype), the input dtype, or float32
/// from 16-bit inputs. `found` is the requested dtype when it is one groupmm knows,
/// `shown` how the caller wrote it. (The Rust API chooses its output type statically.)
pub fn resolve_out_dtype(input: DType, found: Option<DType>, shown: impl Display) -> Result<DType> {
    match found {
        Some(d) if d == input || (d == DType::F32 && input.is_16bit()) => Ok(d),
        _ => Err(Error::Dtype(format!(
            "out_dtype: expected None or the input dtype {}{}, found {shown}",
            input.torch_name(),
            if input.is_16bit() {
                " or torch.float32"
            } else {
                ""
            },
        ))),
    }
}

/// An output must not share memory with an input or with another output: `range` and
/// `other_range` are half-open byte ranges, `other` names the other operand (e.g.
/// `"the input a"`, `"out[0]"`).
pub fn check_disjoint(
    arg: impl Display,
    range: (usize, usize),
    other: impl Display,
    other_range: (usize, usize),
) -> Result<()> {
    if range.0 < other_range.1 && other_range.0 < range.1 {
        return Err(Error::Value(format!(
            "{arg}: must not share memory with {other}"
        )));
    }
    Ok(())
}

/// Names an element of a sequence argument in messages, e.g. `As[3]`, without
/// formatting anything unless a message is written.
#[derive(Debug, Clone, Copy)]
pub struct Item(pub &'static str, pub usize);

impl Display for Item {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}[{}]", self.0, self.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn offs_checks() {
        let p = plan_packed(&c(&[10, 4]), &c(&[3, 4, 5]), Some(3)).unwrap();
        assert!(check_offs(&[2, 2, 10], &p).is_ok());
        assert!(matches!(check_offs(&[3, 2, 10], &p), Err(Error::Value(_))));
        assert!(matches!(check_offs(&[-1, 2, 10], &p), Err(Error::Value(_))));
        assert!(matches!(check_offs(&[1, 2, 11], &p), Err(Error::Value(_))));
    }

    #[test]
    fn clamped_spans_are_in_range_ordered_and_disjoint() {
        for offs in [
            vec![5, -3, 100, 7],
            vec![2, 2, 7],
            vec![-1, -1],
            vec![9, 3, 4, 12],
        ] {
            let spans = clamp_spans(&offs, 10);
            let mut prev_end = 0;
            for &(s, e) in &spans {
                assert!(s == prev_end && s <= e && e <= 10, "{offs:?} -> {spans:?}");
                prev_end = e;
            }
        }
        assert_eq!(clamp_spans(&[2, 2, 7], 10), vec![(0, 2), (2, 2), (2, 7)]);
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

    #[test]
    fn overlap_detection() {
        assert!(Layout::new(&[3, 4], &[4, 1]).is_non_overlapping());
        assert!(Layout::new(&[3, 4], &[1, 3]).is_non_overlapping());
        assert!(!Layout::new(&[3, 4], &[0, 1]).is_non_overlapping());
        assert!(!Layout::new(&[3, 4], &[2, 1]).is_non_overlapping());
        assert!(Layout::new(&[3, 4], &[8, 2]).is_non_overlapping());
    }

    #[test]
    fn argument_rules_name_the_argument() {
        let msg = |r: Result<()>| r.unwrap_err().to_string();
        assert_eq!(
            msg(check_grad("grad", &c(&[4, 6]), &[4, 5])),
            "grad: expected shape [4, 5] (the output of the forward), found [4, 6]"
        );
        assert_eq!(
            msg(check_len("grads", 2, 3, "gradients (one per output)")),
            "grads: expected a sequence of 2 gradients (one per output), found 3"
        );
        assert!(check_len("out", 2, 2, "outputs (one per group)").is_ok());
        let e = check_like(
            Item("Bs", 1),
            (Some(DType::F64), 0),
            "As[0]",
            (DType::F32, 0),
        );
        assert!(
            matches!(&e, Err(Error::Dtype(m)) if m == "Bs[1]: expected dtype torch.float32 (the dtype of As[0]), found torch.float64"),
            "{e:?}"
        );
        let e = check_like("offs", (None, "cpu"), "a", (DType::F32, "cuda:0"));
        assert!(
            matches!(&e, Err(Error::Device(m)) if m == "offs: expected a tensor on cuda:0 (the device of a), found one on cpu"),
            "{e:?}"
        );
        assert!(check_like("b", (Some(DType::F32), 1), "a", (DType::F32, 1)).is_ok());
        assert!(matches!(
            check_disjoint("out", (0, 16), "the input a", (8, 24)),
            Err(Error::Value(m)) if m == "out: must not share memory with the input a"
        ));
        assert!(check_disjoint("out", (0, 16), "out[0]", (16, 24)).is_ok());
        assert_eq!(
            msg(check_out_dtype("out", DType::F16, DType::F32)),
            "out: expected dtype torch.float32 (the output dtype), found torch.float16"
        );
        assert_eq!(
            resolve_out_dtype(DType::BF16, Some(DType::F32), "x").unwrap(),
            DType::F32
        );
        assert!(matches!(
            resolve_out_dtype(DType::F32, Some(DType::F16), "torch.float16"),
            Err(Error::Dtype(m)) if m == "out_dtype: expected None or the input dtype torch.float32, found torch.float16"
        ));
        assert_eq!(
            offs_len(&c(&[1, 3])).unwrap_err().to_string(),
            "offs: expected a 1-D tensor of group ends, found shape [1, 3]"
        );
        assert_eq!(offs_len(&c(&[3])).unwrap(), 3);
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
