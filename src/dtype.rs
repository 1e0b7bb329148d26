//! Element types: float16, bfloat16, float32, float64.

use half::{bf16, f16};

/// A runtime dtype tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
}

impl DType {
    /// The PyTorch spelling (`torch.bfloat16`, ...), used in error messages.
    pub fn torch_name(self) -> &'static str {
        match self {
            DType::F16 => "torch.float16",
            DType::BF16 => "torch.bfloat16",
            DType::F32 => "torch.float32",
            DType::F64 => "torch.float64",
        }
    }

    /// The dtype `torch_name` spells as `name` (`"torch.bfloat16"`, ...), if any.
    pub fn from_torch_name(name: &str) -> Option<DType> {
        [DType::F16, DType::BF16, DType::F32, DType::F64]
            .into_iter()
            .find(|d| d.torch_name() == name)
    }

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
            DType::F64 => 8,
        }
    }

    /// True for float16 and bfloat16.
    pub fn is_16bit(self) -> bool {
        matches!(self, DType::F16 | DType::BF16)
    }
}

/// A float element type groupmm computes on.
///
/// Arithmetic happens in `f32` for the 16-bit types and `f32`, in `f64` for `f64`.
pub trait Element: Copy + Send + Sync + Default + PartialEq + std::fmt::Debug + 'static {
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// Widen to f64 (exact for every supported type).
    fn to_f64(self) -> f64;
    /// Round from f64.
    fn from_f64(v: f64) -> Self;
    /// Widen to f32 (exact for 16-bit types and f32).
    fn to_f32(self) -> f32;
    /// Round from f32.
    fn from_f32(v: f32) -> Self;
    /// Zero.
    fn zero() -> Self {
        Self::default()
    }
}

impl Element for f64 {
    const DTYPE: DType = DType::F64;
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(v: f64) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn from_f32(v: f32) -> Self {
        v as f64
    }
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

#[cfg(test)]
mod tests {
    use super::DType;

    #[test]
    fn torch_names_round_trip() {
        for d in [DType::F16, DType::BF16, DType::F32, DType::F64] {
            assert_eq!(DType::from_torch_name(d.torch_name()), Some(d));
        }
        assert_eq!(DType::from_torch_name("torch.int8"), None);
        assert_eq!(DType::from_torch_name("bfloat16"), None);
    }
}
