//! The geometry every layer shares: an operand's shape and strides in elements
//! ([`Layout`]), and the view with its last two dimensions swapped ([`Transposable`]).
//!
//! Faces describe their arrays with it, the rules ([`crate::shape`]) read it, the engine
//! normalises operands by it and the CPU kernels ([`crate::cpu`]) address memory through
//! it. It decides nothing about what a call may do.

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

    /// Whether the last two dimensions are stored column by column (a transposed view,
    /// e.g. `w.transpose(-2, -1)` of `[E, N, K]` weights), both of them longer than 1.
    pub fn is_column_major(&self) -> bool {
        let n = self.shape.len();
        n >= 2
            && self.shape[n - 2] > 1
            && self.shape[n - 1] > 1
            && self.strides[n - 2] == 1
            && self.strides[n - 1] != 1
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_detection() {
        assert!(Layout::new(&[3, 4], &[4, 1]).is_non_overlapping());
        assert!(Layout::new(&[3, 4], &[1, 3]).is_non_overlapping());
        assert!(!Layout::new(&[3, 4], &[0, 1]).is_non_overlapping());
        assert!(!Layout::new(&[3, 4], &[2, 1]).is_non_overlapping());
        assert!(Layout::new(&[3, 4], &[8, 2]).is_non_overlapping());
    }

    #[test]
    fn column_major_needs_two_long_dimensions() {
        assert!(Layout::new(&[4, 6], &[1, 4]).is_column_major());
        assert!(Layout::new(&[3, 4, 6], &[24, 1, 4]).is_column_major());
        assert!(!Layout::new(&[4, 6], &[6, 1]).is_column_major());
        assert!(!Layout::new(&[1, 6], &[1, 1]).is_column_major());
        assert!(!Layout::new(&[4, 1], &[1, 4]).is_column_major());
        assert!(!Layout::new(&[6], &[1]).is_column_major());
    }
}
