//! The rules: the one layer that decides whether a call is valid and what its output
//! looks like, and that words every message about a bad argument. See ARCHITECTURE.md
//! (its rule table lists each rule, its function here and its message).
//!
//! Every entry point (the ndarray API, numpy, torch on CPU and on CUDA) reaches these
//! rules through the engine (`crate::exec`), which describes operands by their [`Layout`]
//! (shape and strides in elements), dtype and device, and asks the rules once per call,
//! before anything is allocated or launched. The rules read descriptions only, never
//! memory (but [`check_offs`], on the values the engine read).
//!
//! By topic:
//! - this file: the wording shared by every rule ([`fmt_shape`], [`Item`]) and the rules
//!   every call shares: dtype and device agreement ([`check_like`],
//!   [`check_like_or_f32`]), `out=` ([`check_out`], [`check_out_dtype`],
//!   [`check_disjoint`]), `out_dtype=` ([`resolve_out_dtype`]), the upstream gradient
//!   ([`check_grad`]) and sequence lengths ([`check_len`]);
//! - `packed`: the packed forms ([`Form`], [`plan_packed`]) and the backward's operands
//!   ([`backward_layouts`]);
//! - `offs`: `offs`'s shape and values ([`offs_len`], [`check_offs`]) and the clamp rule
//!   the device follows instead ([`clamp_spans`]);
//! - `list`: the list form ([`plan_list`]);
//! - `rows`: the row ops of the MoE glue ([`RowsOp`], [`plan_swiglu`] ...);
//! - `product`: the products of the MoE layer as one rule ([`plan_product`]): a GroupedM
//!   product over routed rows, alone or with an [`Epilogue`] (the fused expert products),
//!   or a GroupedK product over them, each reading its rows in order or through `src`.

mod epilogue;
mod list;
mod offs;
mod packed;
mod product;
mod rows;

pub use epilogue::{
    Epilogue, EpilogueRule, EpilogueShapes, OperandKind, OperandRule, OutputRule, MAX_OPERANDS,
};
pub use list::{plan_list, GroupDims};
pub use offs::{check_offs, clamp_spans, index_error_pending, offs_error_pending, offs_len};
pub use packed::{backward_layouts, plan_packed, transposed_grads, Form, PackedDims};
pub use product::{
    check_f32, check_operands, epilogue as find_epilogue, operand_names, plan_product, Gathered,
    ProductDims, ProductShape, EPILOGUES, PARTIAL_COLS,
};
pub(crate) use rows::RowPtrs;
pub use rows::{
    check_indices, check_topk_cuda, plan_gather_sum, plan_row_dots, plan_scatter_rows, plan_swiglu,
    plan_swiglu_backward, plan_topk, topk_before, RowsDims, RowsOp, TOPK_CUDA_MAX_COLS,
};

use crate::dtype::DType;
use crate::error::{shape_err, Error, Result};
use crate::layout::Layout;
use std::fmt::Display;

/// Formats a shape the way PyTorch prints it: `[2, 3, 4]`.
pub fn fmt_shape(shape: &[usize]) -> String {
    let parts: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

/// `l` has one of the numbers of dimensions `allowed`.
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
    out_dtype_rule(input, found, shown, input.is_16bit())
}

/// `out_dtype=` of an op whose output may be float32 from any input (the router-weight
/// gradients of [`RowsOp::RowDots`]): the input dtype or float32.
pub fn resolve_out_dtype_or_f32(
    input: DType,
    found: Option<DType>,
    shown: impl Display,
) -> Result<DType> {
    out_dtype_rule(input, found, shown, true)
}

fn out_dtype_rule(
    input: DType,
    found: Option<DType>,
    shown: impl Display,
    f32_ok: bool,
) -> Result<DType> {
    match found {
        Some(d) if d == input || (d == DType::F32 && f32_ok) => Ok(d),
        _ => Err(Error::Dtype(format!(
            "out_dtype: expected None or the input dtype {}{}, found {shown}",
            input.torch_name(),
            if f32_ok && input != DType::F32 {
                " or torch.float32"
            } else {
                ""
            },
        ))),
    }
}

/// An operand that has the dtype of the call's reference operand `like`, or float32
/// (router weights: the kernels read either).
pub fn check_like_or_f32(
    arg: impl Display,
    found: DType,
    like: impl Display,
    like_dtype: DType,
) -> Result<()> {
    if found == like_dtype || found == DType::F32 {
        return Ok(());
    }
    Err(Error::Dtype(format!(
        "{arg}: expected dtype {} (the dtype of {like}){}, found {}",
        like_dtype.torch_name(),
        if like_dtype != DType::F32 {
            " or torch.float32"
        } else {
            ""
        },
        found.torch_name()
    )))
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

/// An output that may be the input `other` itself (same address and layout: an
/// operation that overwrites what it has read, element by element) but must not
/// otherwise share memory with it. `(address, layout, byte range)` of each.
pub fn check_same_or_disjoint(
    arg: impl Display,
    out: (usize, &Layout, (usize, usize)),
    other: impl Display,
    input: (usize, &Layout, (usize, usize)),
) -> Result<()> {
    if out.0 == input.0 && out.1 == input.1 {
        return Ok(());
    }
    if out.2 .0 < input.2 .1 && input.2 .0 < out.2 .1 {
        return Err(Error::Value(format!(
            "{arg}: must be {other} itself (same address, shape and strides) or not share memory with it"
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
    #[test]
    fn an_output_is_its_input_exactly_or_apart_from_it() {
        let l = Layout::contiguous(&[4, 8]);
        let other = Layout::contiguous(&[8, 4]);
        let at = |p: usize, l: &Layout| (p, l.clone(), (p, p + 4 * 8 * 2));
        let check = |o: &(usize, Layout, (usize, usize)), i: &(usize, Layout, (usize, usize))| {
            check_same_or_disjoint("out", (o.0, &o.1, o.2), "pre", (i.0, &i.1, i.2))
        };
        let pre = at(4096, &l);
        assert!(check(&at(4096, &l), &pre).is_ok(), "pre itself");
        assert!(check(&at(8192, &l), &pre).is_ok(), "apart");
        let msg = |r: Result<()>| r.unwrap_err().to_string();
        let want =
            "out: must be pre itself (same address, shape and strides) or not share memory with it";
        assert_eq!(msg(check(&at(4096 + 16, &l), &pre)), want, "shifted");
        assert_eq!(msg(check(&at(4096, &other), &pre)), want, "another layout");
    }

    use super::*;

    fn c(shape: &[usize]) -> Layout {
        Layout::contiguous(shape)
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
        assert!(matches!(
            resolve_out_dtype(DType::F64, Some(DType::F32), "torch.float32"),
            Err(Error::Dtype(m)) if m == "out_dtype: expected None or the input dtype torch.float64, found torch.float32"
        ));
        assert_eq!(
            resolve_out_dtype_or_f32(DType::F64, Some(DType::F32), "x").unwrap(),
            DType::F32
        );
        assert!(matches!(
            resolve_out_dtype_or_f32(DType::F64, Some(DType::F16), "torch.float16"),
            Err(Error::Dtype(m)) if m == "out_dtype: expected None or the input dtype torch.float64 or torch.float32, found torch.float16"
        ));
        assert!(check_like_or_f32("weights", DType::F32, "y", DType::BF16).is_ok());
        assert!(check_like_or_f32("weights", DType::BF16, "y", DType::BF16).is_ok());
        assert_eq!(
            msg(check_like_or_f32("weights", DType::F64, "y", DType::F32)),
            "weights: expected dtype torch.float32 (the dtype of y), found torch.float64"
        );
        assert_eq!(
            msg(check_like_or_f32("weights", DType::F16, "y", DType::BF16)),
            "weights: expected dtype torch.bfloat16 (the dtype of y) or torch.float32, found torch.float16"
        );
    }
}
