//! The operands of a call as the kernels read them: contiguous copies made once through
//! the face where a kernel cannot read an operand in place ([`Operands`], over
//! `vocab::contiguous`), `offs` values on the host ([`host_offs`]), and the output target
//! ([`into_target`], [`check_out`]).

use super::cuda;
use super::vocab::{Device, IntTensor, Output, Runtime, Tensor};
use crate::dtype::DType;
use crate::error::Result;
use crate::shape::{self, PackedDims};
use std::fmt;

/// `offs` values on the host (CPU calls), checked; CUDA calls never read them.
///
/// # Safety
/// `offs` describes live host memory when its device is the CPU.
pub(super) unsafe fn host_offs(
    offs: Option<&IntTensor>,
    plan: &PackedDims,
) -> Result<Option<Vec<i32>>> {
    let Some(o) = offs.filter(|o| o.device == Device::Cpu) else {
        return Ok(None);
    };
    let (n, s) = (o.layout.shape[0], o.layout.strides[0]);
    let vals: Vec<i32> = (0..n)
        // SAFETY: a live 1-D int32 host array of n elements with stride s (contract).
        .map(|i| unsafe { *((o.ptr as *const i32).offset(i as isize * s)) })
        .collect();
    shape::check_offs(&vals, plan)?;
    Ok(Some(vals))
}

/// True when the kernels write `out` as it is: any layout on the CPU, contiguous
/// row-major on CUDA.
pub(super) fn writes_in_place(out: &Tensor) -> bool {
    out.device == Device::Cpu || out.layout.is_contiguous()
}

/// Runs `run` on the output target: `out` itself when the kernels can write it in
/// place, else a fresh output copied into `out` afterwards; a fresh output when `out`
/// is `None`.
pub(super) fn into_target<R: Runtime>(
    rt: &mut R,
    out: Option<Output<R::Out>>,
    shape: &[usize],
    dtype: DType,
    device: Device,
    run: impl FnOnce(&mut R, &Tensor) -> Result<()>,
) -> Result<R::Out> {
    match out {
        Some((o, t)) if writes_in_place(&t) => {
            run(rt, &t)?;
            Ok(o)
        }
        Some((o, _)) => {
            let (tmp, t) = rt.alloc(shape, dtype, device)?;
            run(rt, &t)?;
            rt.copy_into(&o, &tmp)?;
            Ok(o)
        }
        None => {
            let (o, t) = rt.alloc(shape, dtype, device)?;
            run(rt, &t)?;
            Ok(o)
        }
    }
}

/// The inputs of a call as the kernels will read them: on the CPU the descriptions as
/// given; on CUDA a contiguous copy (through the face) of each operand no kernel can
/// read in place, made once per call even when an operand feeds two products.
pub(super) struct Operands {
    pub(super) t: Vec<Tensor>,
    pub(super) offs: Option<IntTensor>,
}

impl Operands {
    pub(super) fn prepare<R: Runtime>(
        rt: &mut R,
        t: &[&Tensor],
        offs: Option<&IntTensor>,
    ) -> Result<Self> {
        match t.first().map(|x| x.device) {
            Some(Device::Cuda(_)) => {
                cuda::check_compiled()?;
                Ok(Operands {
                    t: t.iter()
                        .map(|x| cuda::readable(rt, x))
                        .collect::<Result<_>>()?,
                    offs: offs.map(|o| cuda::readable_offs(rt, o)).transpose()?,
                })
            }
            _ => Ok(Operands {
                t: t.iter().map(|&x| x.clone()).collect(),
                offs: offs.cloned(),
            }),
        }
    }
}

/// Checks a user-supplied output against the call: device, dtype, shape, no
/// self-overlap, no memory shared with an input (`inputs`: names and descriptions).
pub(super) fn check_out<'t, N: fmt::Display>(
    name: impl fmt::Display + Copy,
    out: &Tensor,
    shape: &[usize],
    dtype: DType,
    like: (&str, &Tensor),
    inputs: impl IntoIterator<Item = (N, &'t Tensor)>,
) -> Result<()> {
    shape::check_like(name, (None, out.device), like.0, like.1.reference())?;
    shape::check_out_dtype(name, out.dtype, dtype)?;
    shape::check_out(name, &out.layout, shape)?;
    let range = out.byte_range();
    for (input, t) in inputs {
        shape::check_disjoint(
            name,
            range,
            format_args!("the input {input}"),
            t.byte_range(),
        )?;
    }
    Ok(())
}
