//! The one error type of groupmm.
//!
//! Every entry point (Rust API, numpy, torch CPU, torch CUDA) reports bad input through
//! [`Error`]. The Python bindings map each variant to the exception a PyTorch user
//! expects: shape and value problems become `ValueError`, dtype and type problems
//! `TypeError`, device, CUDA and build problems `RuntimeError`.

/// What went wrong, with a message that names the argument, the group and what was
/// expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A shape does not fit the rules of the form (→ `ValueError`).
    #[error("{0}")]
    Shape(String),
    /// A value is out of range, e.g. decreasing `offs` (→ `ValueError`).
    #[error("{0}")]
    Value(String),
    /// Unsupported or mismatched dtypes (→ `TypeError`).
    #[error("{0}")]
    Dtype(String),
    /// An argument of the wrong kind, e.g. not a tensor (→ `TypeError`).
    #[error("{0}")]
    Type(String),
    /// Tensors on different or unsupported devices (→ `RuntimeError`).
    #[error("{0}")]
    Device(String),
    /// A CUDA or CUTLASS call failed, or this build has no CUDA (→ `RuntimeError`).
    #[error("{0}")]
    Cuda(String),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Shorthand constructors used across the crate.
pub(crate) fn shape_err(msg: impl Into<String>) -> Error {
    Error::Shape(msg.into())
}
