//! `offs`, the int32 cumulative end of each group: its shape, its values on the host
//! (CPU calls), the clamp rule the device follows instead (CUDA calls never read `offs`
//! on the host), and the error a later call raises when a kernel met invalid values.

use super::{fmt_shape, Form, PackedDims};
use crate::error::{shape_err, Error, Result};
use std::fmt::Display;

/// `offs` is a 1-D tensor of group ends; returns its length.
pub fn offs_len(offs: &crate::layout::Layout) -> Result<usize> {
    if offs.ndim() != 1 {
        return Err(shape_err(format!(
            "offs: expected a 1-D tensor of group ends, found shape {}",
            fmt_shape(&offs.shape)
        )));
    }
    Ok(offs.shape[0])
}

/// Checks `offs` values read on the host: each in `0..=extent`, non-decreasing.
///
/// CUDA callers never read `offs` on the host; their kernels clamp instead (see
/// [`clamp_spans`]).
pub fn check_offs(offs: &[i32], plan: &PackedDims) -> Result<()> {
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

/// What a call on CUDA raises when an earlier call's kernels met a routed-row index out of
/// range (a gathered product's `src`, a row op's `inverse`): the kernels never read out of
/// bounds (such a row reads as zeros or contributes nothing) and raise the per-device flag
/// that the next call reads, as for `offs` ([`offs_error_pending`]), without a host sync.
pub fn index_error_pending(device: impl Display) -> Error {
    Error::Value(format!(
        "src/inverse: an earlier groupmm call on {device} received a routing index out of \
         range (below 0 or not a row of the indexed tensor); those rows were read as zeros. \
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Layout;
    use crate::shape::plan_packed;

    fn c(shape: &[usize]) -> Layout {
        Layout::contiguous(shape)
    }

    #[test]
    fn offs_checks() {
        let p = plan_packed(&c(&[10, 4]), &c(&[3, 4, 5]), Some(3)).unwrap();
        assert!(check_offs(&[2, 2, 10], &p).is_ok());
        assert!(matches!(check_offs(&[3, 2, 10], &p), Err(Error::Value(_))));
        assert!(matches!(check_offs(&[-1, 2, 10], &p), Err(Error::Value(_))));
        assert!(matches!(check_offs(&[1, 2, 11], &p), Err(Error::Value(_))));
        assert_eq!(
            offs_len(&c(&[1, 3])).unwrap_err().to_string(),
            "offs: expected a 1-D tensor of group ends, found shape [1, 3]"
        );
        assert_eq!(offs_len(&c(&[3])).unwrap(), 3);
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
}
