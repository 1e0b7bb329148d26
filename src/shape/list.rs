//! The list form: sequences `As`, `Bs` of 2-D operands, any shape per group.

use super::fmt_shape;
use crate::error::{shape_err, Result};
use crate::layout::Layout;

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
