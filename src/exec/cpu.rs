//! The engine's CPU side: a validated packed or list product handed to the kernels of
//! [`crate::cpu`] with the element types of its runtime dtypes ([`with_types!`]), run
//! through the face ([`Runtime::run_cpu`]: the torch face releases the GIL). The row ops'
//! CPU loops are dispatched by `super::rows`.

use super::vocab::{Runtime, Tensor};
use crate::dtype::DType;
use crate::shape::{GroupDims, PackedDims};
use half::{bf16, f16};

/// Runs `$body` with `$TI`, `$TO` bound to the element types of the runtime dtypes
/// `$ti`, `$to` (every pair: the ndarray face chooses its output type freely).
macro_rules! with_types {
    ($ti:expr, $to:expr, |$TI:ident, $TO:ident| $body:block) => {
        with_types!(@in $ti, $to, $TI, $TO, $body,
            [F16 f16] [BF16 bf16] [F32 f32] [F64 f64])
    };
    (@in $ti:expr, $to:expr, $TI:ident, $TO:ident, $body:block, $([$v:ident $t:ty])*) => {
        match $ti {
            $(DType::$v => {
                #[allow(dead_code)]
                type $TI = $t;
                with_types!(@out $to, $TO, $body, [F16 f16] [BF16 bf16] [F32 f32] [F64 f64])
            })*
        }
    };
    (@out $to:expr, $TO:ident, $body:block, $([$v:ident $t:ty])*) => {
        match $to {
            $(DType::$v => {
                #[allow(dead_code)]
                type $TO = $t;
                $body
            })*
        }
    };
}

/// Runs a validated packed product on host operands into the target `c` (shape
/// `plan.out_shape`).
///
/// # Safety
/// The descriptions are of live host memory for the call; `offs_vals` passed
/// [`crate::shape::check_offs`]; `c` does not overlap itself or an input.
pub(super) unsafe fn packed<R: Runtime>(
    rt: &mut R,
    plan: &PackedDims,
    a: &Tensor,
    b: &Tensor,
    offs_vals: Option<&[i32]>,
    c: &Tensor,
) {
    let problems = crate::cpu::packed_problems(plan, &a.layout, &b.layout, &c.layout, offs_vals);
    let (pa, pb, pc) = (a.ptr, b.ptr, c.ptr);
    with_types!(a.dtype, c.dtype, |TI, TO| {
        rt.run_cpu(&mut || {
            // SAFETY: problems from packed_problems on the layouts of the live arrays
            // behind the pointers (offs checked), `c` non-overlapping and disjoint from
            // the inputs (fresh, or checked by check_out).
            unsafe {
                crate::cpu::run_packed::<TI, TO>(
                    &problems,
                    pa as *const TI,
                    pb as *const TI,
                    pc as *mut TO,
                )
            }
        });
    });
}

/// Runs a validated list product on host operands: group `i` reads `a[i]`, `b[i]` and
/// writes `c[i]`, of dtype `dtype`.
///
/// # Safety
/// As [`packed`]; the targets are pairwise disjoint.
pub(super) unsafe fn list<R: Runtime>(
    rt: &mut R,
    dims: &[GroupDims],
    a: &[Tensor],
    b: &[Tensor],
    c: &[&Tensor],
    dtype: DType,
) {
    let problems = crate::cpu::list_problems(dims, a, b, c);
    let pa: Vec<usize> = a.iter().map(|x| x.ptr).collect();
    let pb: Vec<usize> = b.iter().map(|x| x.ptr).collect();
    let pc: Vec<usize> = c.iter().map(|x| x.ptr).collect();
    let ti = a.first().map_or(dtype, |x| x.dtype);
    with_types!(ti, dtype, |TI, TO| {
        rt.run_cpu(&mut || {
            let pa: Vec<*const TI> = pa.iter().map(|&p| p as *const TI).collect();
            let pb: Vec<*const TI> = pb.iter().map(|&p| p as *const TI).collect();
            let pc: Vec<*mut TO> = pc.iter().map(|&p| p as *mut TO).collect();
            // SAFETY: problems from list_problems on the layouts of the live arrays
            // behind the pointers; outputs fresh, or checked non-overlapping with each
            // other and with the inputs.
            unsafe { crate::cpu::run_list::<TI, TO>(&problems, &pa, &pb, &pc) }
        });
    });
}
