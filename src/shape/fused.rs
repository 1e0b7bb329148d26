//! The fused expert products of a routed SwiGLU block: one GroupedM product whose
//! epilogue does the glue around it (the engine: `crate::exec::fused`; what each epilogue
//! computes, element by element: the bridge's `Fusion`, src/exec/ffi.rs). Their shapes
//! here; dtype and device agreement by [`super::check_like`] and [`check_f32`], which the
//! engine applies first.
//!
//! | [`Epilogue`] | operands | product (GroupedM) | outputs |
//! | --- | --- | --- | --- |
//! | `SwiGLU` (`swiglu_mm`) | `x [T, K]`, `w [G, K, 2F]`, `src [R]` (absent: `R = T`, row `r` is `x[r]`) | `p = x[src] · w[g]`, `[R, 2F]` | `pre [R, 2F]` (`= p`), `act [R, F]` |
//! | `DGated` (`dgated_mm`) | `dy [T, D]`, `w [G, F, D]` (the down projection's), `pre [R, 2F]`, `scale [R]`, `src [R]` (absent: `R = T`, row `r` is `dy[r]`) | `p = dy[src] · w[g]ᵀ`, `[R, F]` | `dpre [R, 2F]`, `act [R, F]`, `partial [⌈F/64⌉, R]` |
//!
//! `offs` (1-D, [`super::offs_len`]) holds the group ends over the `R` rows; rows past
//! its last entry are zeros in every output. `src` values are never an error (the
//! gathered product's rule, [`plan_gather`]).

use super::{fmt_shape, need_ndim, plan_gather, plan_packed, rows::gate_up_half, PackedDims};
use crate::dtype::DType;
use crate::error::{shape_err, Error, Result};
use crate::layout::Layout;
use std::fmt::Display;

/// The columns of `p` that one row of `DGated`'s `partial` output sums (its rows are
/// `⌈F / PARTIAL_COLS⌉` column chunks; the router weight's gradient of row `r` is the
/// sum of `partial[.., r]`).
pub const PARTIAL_COLS: usize = 64;

/// Which epilogue a fused expert product runs (the bridge's `Epilogue` beyond `Plain`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// The up projection and its activation: `pre = p`, `act = silu(gate) * up`.
    SwiGLU,
    /// The backward of the down projection through the router weight and the SwiGLU.
    DGated,
}

/// The extents of a validated fused expert product.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FusedDims {
    /// The epilogue.
    pub epilogue: Epilogue,
    /// The product: GroupedM over the `R` rows (`m = R`), `n = 2F` (SwiGLU) or `F`
    /// (DGated).
    pub product: PackedDims,
    /// `F`: the columns of `act` (half those of the pre-activation).
    pub f: usize,
}

impl FusedDims {
    /// The shapes of the outputs, in the order the op returns them: SwiGLU `pre`, `act`;
    /// DGated `dpre`, `act`, `partial`.
    pub fn out_shapes(&self) -> Vec<[usize; 2]> {
        let (r, f) = (self.product.m, self.f);
        match self.epilogue {
            Epilogue::SwiGLU => vec![[r, 2 * f], [r, f]],
            Epilogue::DGated => vec![[r, 2 * f], [r, f], [f.div_ceil(PARTIAL_COLS), r]],
        }
    }

    /// No output has an element (no routed rows, e.g. an expert-parallel rank that
    /// received none, or `F = 0`): nothing to compute, no kernel to ask.
    pub fn is_empty(&self) -> bool {
        self.product.m == 0 || self.f == 0
    }
}

/// `swiglu_mm(x, w, offs, src)`: the gathered product's rule ([`plan_gather`]; without
/// `src`, that of the rows of `x` in order), then `w`'s columns `[gate | up]` even.
pub fn plan_swiglu_mm(
    x: &Layout,
    w: &Layout,
    src: Option<&Layout>,
    offs_len: usize,
) -> Result<FusedDims> {
    let in_order = Layout::contiguous(&[x.shape.first().copied().unwrap_or(0)]);
    let product = plan_gather(x, w, src.unwrap_or(&in_order), offs_len)?;
    let f = gate_up_half("w", &w.shape)?;
    Ok(FusedDims {
        epilogue: Epilogue::SwiGLU,
        product,
        f,
    })
}

/// `dgated_mm(dy, w, offs, pre, scale, src)`: `dy [R, D]`, or with `src [R]` `dy [T, D]`
/// (the rows in token order, row `r` of the product is `dy[src[r]]`; `src` values: the
/// row ops' rule, not a shape rule), `w [G, F, D]` (`G = len(offs)`), `pre [R, 2F]`,
/// `scale [R]`; the product is `dy[src] · w[g]ᵀ` (GroupedM, `m = R`, `n = F`, `k = D`).
pub fn plan_dgated_mm(
    dy: &Layout,
    w: &Layout,
    pre: &Layout,
    scale: &Layout,
    src: Option<&Layout>,
    offs_len: usize,
) -> Result<FusedDims> {
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
    let r = match src {
        None => dy.shape[0],
        Some(s) if s.ndim() == 1 => s.shape[0],
        Some(s) => {
            return Err(shape_err(format!(
                "src: expected a 1-D tensor [R] (the row of dy of each routed row), found shape {}",
                fmt_shape(&s.shape)
            )))
        }
    };
    let d = dy.shape[1];
    if w.ndim() != 3 || w.shape[2] != d {
        return Err(shape_err(format!(
            "w: expected 3-D weights [G, F, D={d}] (the down projection's; D: the columns of dy), found shape {}",
            fmt_shape(&w.shape)
        )));
    }
    if w.shape[0] != offs_len {
        return Err(shape_err(format!(
            "w: expected shape [G={offs_len}, F, D={d}] (G = len(offs)), found {}",
            fmt_shape(&w.shape)
        )));
    }
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
    let product = plan_packed(&rows, &w.transposed(), Some(offs_len))?;
    Ok(FusedDims {
        epilogue: Epilogue::DGated,
        product,
        f,
    })
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

    #[test]
    fn swiglu_product_and_outputs() {
        // gathered: R = len(src) rows of x
        let d = plan_swiglu_mm(&c(&[10, 4]), &c(&[3, 4, 6]), Some(&c(&[24])), 3).unwrap();
        assert_eq!(d.epilogue, Epilogue::SwiGLU);
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
        assert_eq!(d.epilogue, Epilogue::DGated);
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
