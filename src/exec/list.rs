//! The list form through the engine: validate group by group, the operands normalised
//! once, the outputs (or the caller's, checked), and one list product; the backward as
//! two list products on transposed descriptions (no copies).

use super::operands::{check_out, writes_in_place, Operands};
use super::vocab::{Device, Grads, Output, Runtime, Tensor};
use super::{cpu, cuda};
use crate::dtype::DType;
use crate::error::Result;
use crate::shape::{self, GroupDims, Item};

/// The checks of a list product: shapes fit group by group, every operand has the
/// dtype and device of `As[0]`.
fn validate_list(a: &[Tensor], b: &[Tensor]) -> Result<Vec<GroupDims>> {
    let dims = shape::plan_list(a, b)?;
    if let Some(first) = a.first() {
        for (i, x) in a.iter().enumerate().skip(1) {
            shape::check_like(Item("As", i), x.like(), "As[0]", first.reference())?;
        }
        for (i, x) in b.iter().enumerate() {
            shape::check_like(Item("Bs", i), x.like(), "As[0]", first.reference())?;
        }
    }
    Ok(dims)
}

/// List product `out[i] = a[i] · b[i]` into `outs` (allocated when `None`).
///
/// # Safety
/// As [`super::packed`].
pub unsafe fn list<R: Runtime>(
    rt: &mut R,
    a: &[Tensor],
    b: &[Tensor],
    out_dtype: Option<DType>,
    outs: Option<Vec<Output<R::Out>>>,
) -> Result<Vec<R::Out>> {
    let dims = validate_list(a, b)?;
    let Some(first) = a.first() else {
        let outs = outs.unwrap_or_default();
        shape::check_len("out", 0, outs.len(), "outputs (one per group)")?;
        return Ok(Vec::new());
    };
    let dtype = out_dtype.unwrap_or(first.dtype);
    if let Some(o) = &outs {
        shape::check_len("out", dims.len(), o.len(), "outputs (one per group)")?;
        for (i, ((_, oi), d)) in o.iter().zip(&dims).enumerate() {
            let inputs = (a.iter().enumerate().map(|(j, x)| (Item("As", j), x)))
                .chain(b.iter().enumerate().map(|(j, x)| (Item("Bs", j), x)));
            check_out(
                Item("out", i),
                oi,
                &[d.m, d.n],
                dtype,
                ("As[0]", first),
                inputs,
            )?;
            let range = oi.byte_range();
            for (j, (_, oj)) in o[..i].iter().enumerate() {
                shape::check_disjoint(Item("out", i), range, Item("out", j), oj.byte_range())?;
            }
        }
    }
    let refs: Vec<&Tensor> = a.iter().chain(b).collect();
    let ops = Operands::prepare(rt, &refs, None)?;
    let (a, b) = ops.t.split_at(a.len());
    // SAFETY: forwarded contract.
    unsafe { run_list_into(rt, &dims, a, b, dtype, first.device, outs) }
}

/// Backward of the list product: `dA[i] = grads[i]·b[i]ᵀ`, `dB[i] = a[i]ᵀ·grads[i]`,
/// each list only when asked for.
///
/// # Safety
/// As [`super::packed`].
pub unsafe fn list_backward<R: Runtime>(
    rt: &mut R,
    grads: &[Tensor],
    a: &[Tensor],
    b: &[Tensor],
    need_a: bool,
    need_b: bool,
    out_dtype: Option<DType>,
) -> Result<Grads<Vec<R::Out>>> {
    let dims = validate_list(a, b)?;
    shape::check_len(
        "grads",
        dims.len(),
        grads.len(),
        "gradients (one per output)",
    )?;
    let Some(first) = a.first() else {
        return Ok((need_a.then(Vec::new), need_b.then(Vec::new)));
    };
    for (i, (g, d)) in grads.iter().zip(&dims).enumerate() {
        shape::check_like(Item("grads", i), g.like(), "As[0]", first.reference())?;
        shape::check_grad(Item("grads", i), &g.layout, &[d.m, d.n])?;
    }
    if !(need_a || need_b) {
        return Ok((None, None));
    }
    let dtype = out_dtype.unwrap_or(first.dtype);
    let g_len = grads.len();
    let refs: Vec<&Tensor> = grads.iter().chain(a).chain(b).collect();
    let ops = Operands::prepare(rt, &refs, None)?;
    let (grads, rest) = ops.t.split_at(g_len);
    let (a, b) = rest.split_at(g_len);
    let mut products: [(Vec<Tensor>, Vec<Tensor>); 2] = Default::default();
    for ((g, x), y) in grads.iter().zip(a).zip(b) {
        // list outputs are fresh per-group arrays: the gradients stay row-major
        let [(ga, gb), (ha, hb)] = shape::backward_layouts(g, x, y, [false; 2]);
        products[0].0.push(ga);
        products[0].1.push(gb);
        products[1].0.push(ha);
        products[1].1.push(hb);
    }
    let device = first.device;
    let product = |rt: &mut R, (x, y): &(Vec<Tensor>, Vec<Tensor>)| -> Result<Vec<R::Out>> {
        let dims = shape::plan_list(x, y)?;
        // SAFETY: forwarded contract.
        unsafe { run_list_into(rt, &dims, x, y, dtype, device, None) }
    };
    let da = if need_a {
        Some(product(rt, &products[0])?)
    } else {
        None
    };
    let db = if need_b {
        Some(product(rt, &products[1])?)
    } else {
        None
    };
    Ok((da, db))
}

/// Runs a validated list product into `outs` (checked) or fresh outputs.
///
/// # Safety
/// As [`super::packed`].
unsafe fn run_list_into<R: Runtime>(
    rt: &mut R,
    dims: &[GroupDims],
    a: &[Tensor],
    b: &[Tensor],
    dtype: DType,
    device: Device,
    outs: Option<Vec<Output<R::Out>>>,
) -> Result<Vec<R::Out>> {
    let outs: Vec<Output<R::Out>> = match outs {
        Some(o) => o,
        None => dims
            .iter()
            .map(|d| rt.alloc(&[d.m, d.n], dtype, device))
            .collect::<Result<_>>()?,
    };
    // Targets the kernels write: the outputs themselves, except (CUDA) outputs that are
    // not contiguous, which get a fresh target and a copy afterwards.
    let mut temps: Vec<Option<Output<R::Out>>> = Vec::with_capacity(outs.len());
    for ((_, o), d) in outs.iter().zip(dims) {
        temps.push(if writes_in_place(o) {
            None
        } else {
            Some(rt.alloc(&[d.m, d.n], dtype, device)?)
        });
    }
    let targets: Vec<&Tensor> = outs
        .iter()
        .zip(&temps)
        .map(|((_, o), t)| t.as_ref().map_or(o, |(_, t)| t))
        .collect();
    match device {
        // SAFETY: forwarded contract.
        Device::Cuda(_) => unsafe { cuda::list(rt, a, b, &targets)? },
        // SAFETY: forwarded contract; the targets are fresh, or `outs` checked disjoint.
        Device::Cpu => unsafe { cpu::list(rt, dims, a, b, &targets, dtype) },
    }
    outs.into_iter()
        .zip(temps)
        .map(|((o, _), t)| {
            if let Some((t, _)) = t {
                rt.copy_into(&o, &t)?;
            }
            Ok(o)
        })
        .collect()
}
