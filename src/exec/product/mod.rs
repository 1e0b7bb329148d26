//! The products of the MoE layer through the engine, one ladder for all (rule and table:
//! [`shape::plan_product`](crate::shape::plan_product)): a GroupedM product over routed
//! rows (`gather_mm`), alone or with an epilogue that writes the glue around it (the fused
//! expert products, `product`, one rule entry each), or a GroupedK product over them
//! (`gather_k_mm`, the weight gradient), each reading its rows in order or through the
//! routed-row index `src`.
//!
//! validate (on every device) → `out` checked → an epilogue on the CPU: `None` (no
//! memory read, nothing allocated) → the operands normalised once (the index converted
//! to int32 once) → the outputs → one request with everything asked (`src` and the
//! epilogue, [`run`]) → where no kernel reads the rows through `src` (in-GEMM gathering is
//! off by default; the CPU), the rows gathered first ([`gather_rows`]) and the request
//! asked again without `src` → where no kernel runs the epilogue, `None`: the caller's to
//! compose from plain products and row ops (`groupmm.fused` in Python, where the
//! formulas live with the glue); a plain product always runs. No host sync on CUDA:
//! `offs` is read on the device only, and an earlier call's invalid `offs` or routed-row
//! index is raised as every packed call raises it; on the CPU a bad index is an error at
//! once (the row op's host rule,
//! [`shape::check_indices`](crate::shape::check_indices)).
//!
//! The request and its outputs: `request`; every check before anything is read:
//! `validate`; where `c` is written: `target`.

mod request;
mod target;
mod validate;

pub use request::{Outputs, ProductRequest};

use super::cuda;
use super::operands::{host_offs, Operands};
use super::packed::run;
use super::rows::gather_rows;
use super::vocab::{contiguous, contiguous_int32, Device, IntTensor, Runtime, Tensor};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Transposable;
use crate::shape::{Epilogue, Form, Gathered, OperandKind, PackedDims};
use std::borrow::Cow;
use target::Target;
use validate::{c_shape, validate};

/// The one output of a plain product, which always runs (`None` only where an epilogue
/// was asked).
pub fn plain<O>(o: Option<Outputs<O>>) -> Result<O> {
    o.map(|o| o.c)
        .ok_or_else(|| Error::Cuda("internal: a plain product did not run".into()))
}

/// Runs one product of the MoE layer: its outputs, or `None` where no kernel runs the
/// epilogue asked (on the CPU always, before anything is read or allocated; on CUDA
/// after the bridge answered `Unsupported`, nothing ran and `out` is as it was). A
/// plain product always runs ([`plain`]).
///
/// # Safety
/// Every description is of live memory on its device for the whole call (inputs
/// readable, `out` writable), as [`Runtime`] promises for what it lends.
pub unsafe fn product<R: Runtime>(
    rt: &mut R,
    req: ProductRequest<'_, R::Out>,
) -> Result<Option<Outputs<R::Out>>> {
    let (plan, shapes) = validate(&req)?;
    let ProductRequest {
        form,
        a,
        b,
        offs,
        src,
        epilogue,
        transposed,
        out_dtype,
        out,
    } = req;
    let (device, dtype) = (a.device, out_dtype.unwrap_or(a.dtype));
    if device == Device::Cpu && plan.epilogue.is_some() {
        return Ok(None);
    }
    // SAFETY: forwarded contract.
    let offs_vals = unsafe { host_offs(Some(offs), &plan.product)? };
    // The operands in the order the product reads them: swapped when GroupedK runs
    // transposed (and with them the one `src` gathers); `w` transposed where the
    // epilogue's rule reads `a · wᵀ` (DGated), read in place as the backward's dA reads b.
    let (first, second) = if transposed { (b, a) } else { (a, b) };
    let src_b = matches!(src, Some((_, Gathered::B))) != transposed;
    let wt;
    let second = match epilogue.rule {
        Some(e) if e.b_transposed => {
            wt = second.transposed();
            &wt
        }
        _ => second,
    };
    // An epilogue's second weight (e.g. SwiGLU's `up`) is read in place as `b` is, never
    // made contiguous: prepared with `b`, at `ops.t[2]`.
    let weight = epilogue
        .listed()
        .find(|(r, _)| r.kind == OperandKind::Weight)
        .map(|(_, t)| *t);
    let ops = Operands::prepare(
        rt,
        &[&[first, second][..], weight.as_slice()].concat(),
        Some(offs),
    )?;
    if weight.is_some() && !same_strides(&ops.t[1], &ops.t[2]) {
        // the kernels read both weights with `b`'s strides: the caller composes
        return Ok(None);
    }
    let src = src.map(|(s, _)| contiguous_int32(rt, s)).transpose()?;
    // the rest made contiguous, by position
    let mut prepared = Epilogue {
        rule: epilogue.rule,
        ..Epilogue::default()
    };
    let listed = epilogue.rule.map_or(&[][..], |e| e.operands);
    for ((slot, o), r) in prepared
        .operands
        .iter_mut()
        .zip(epilogue.operands)
        .zip(listed)
    {
        *slot = match o {
            None => None,
            Some(_) if r.kind == OperandKind::Weight => Some(ops.t[2].clone()),
            Some(t) => Some(contiguous(rt, t)?),
        };
    }
    let epilogue = prepared;
    // GroupedK on CUDA reads its first operand (transposed, as the backward's dB = aᵀ·grad
    // reads it) and the gathered one row-major (the bridge's `Fusion`); rows gathered
    // below are read from the same tensors (no second copy).
    let (x, y) = (&ops.t[0], &ops.t[1]);
    let (x, y) = match (form, device) {
        (Form::GroupedK, Device::Cuda(_)) => (
            Cow::Owned(cuda::row_major(rt, x)?),
            match src_b {
                true => Cow::Owned(cuda::row_major(rt, y)?),
                false => Cow::Borrowed(y),
            },
        ),
        _ => (Cow::Borrowed(x), Cow::Borrowed(y)),
    };
    let shape = c_shape(&plan, &shapes);
    let (target, c) = Target::new(rt, out, (form, transposed), shape, (dtype, device))?;
    let outputs = plan.epilogue.map_or(&[][..], |e| e.outputs);
    let rest = (outputs.iter().zip(&shapes).skip(1))
        .map(|(o, s)| rt.alloc(s, if o.f32 { DType::F32 } else { dtype }, device))
        .collect::<Result<Vec<_>>>()?;
    if plan.is_empty() {
        return Ok(Some(Outputs::new(target.unwritten(), rest)));
    }
    let rest_t: Vec<&Tensor> = rest.iter().map(|(_, t)| t).collect();
    let fusion = |src, retry| cuda::Fusion {
        src,
        retry,
        src_b,
        epilogue: epilogue.as_ref(),
        outputs: &rest_t,
    };
    let (p, offs) = (&plan.product, (ops.offs.as_ref(), offs_vals.as_deref()));
    // SAFETY: forwarded contract; the operands live (or copies the face keeps for the
    // call), the epilogue's contiguous, the outputs fresh and contiguous or `out`, which
    // is disjoint from every input or an operand its rule lets it be (checked above).
    let mut ran = unsafe { submit(rt, p, &x, &y, offs, &fusion(src.as_ref(), false), &c)? };
    if let (false, Some(src)) = (ran, &src) {
        // No kernel reads the rows through `src` here: gather them first and ask again
        // without it.
        // SAFETY: forwarded contract; `src` contiguous int32.
        let (_keep, rows) = unsafe { gather_rows(rt, if src_b { &y } else { &x }, src)? };
        let (x, y) = if src_b { (&*x, &rows) } else { (&rows, &*y) };
        // SAFETY: as above; `rows` lives until `_keep` drops, after the call.
        ran = unsafe { submit(rt, p, x, y, offs, &fusion(None, true), &c)? };
    }
    if !ran {
        return Ok(None);
    }
    let c = target.finish(rt, transposed)?;
    Ok(Some(Outputs::new(c, rest)))
}

/// [`run`] of the product over `x` and `y`: GroupedK `Σ x_rᵀ · y_r` (`x` read
/// transposed), GroupedM `x · y`.
///
/// # Safety
/// As [`run`].
unsafe fn submit<R: Runtime>(
    rt: &mut R,
    plan: &PackedDims,
    x: &Tensor,
    y: &Tensor,
    (offs, offs_vals): (Option<&IntTensor>, Option<&[i32]>),
    fusion: &cuda::Fusion<'_>,
    c: &Tensor,
) -> Result<bool> {
    let xt;
    let x = match plan.form {
        Form::GroupedK => {
            xt = x.transposed();
            &xt
        }
        _ => x,
    };
    // SAFETY: forwarded contract.
    unsafe { run(rt, plan, x, y, offs, offs_vals, fusion, c) }
}

/// True when `b` and an epilogue's second weight (e.g. SwiGLU's `up`) have the same
/// strides, so that the kernels read both through `b`'s.
fn same_strides(b: &Tensor, up: &Tensor) -> bool {
    b.layout.strides == up.layout.strides && b.layout.shape == up.layout.shape
}

#[cfg(test)]
mod tests;
