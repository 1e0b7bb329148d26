//! # groupmm
//!
//! Grouped matrix multiply (grouped GEMM) for Mixture-of-Experts models: many
//! independent products `C_g = A_g · B_g` of per-group shapes in one call, forward and
//! backward, on CPU (this crate's Rust kernels) and on NVIDIA GPUs (CUTLASS kernels,
//! when built with CUDA).
//!
//! - [`shape`] owns every group-shape rule and the error messages.
//! - [`cpu`] runs the per-group GEMMs in parallel.
//! - [`api`] is the Rust API on `ndarray` views: forward and backward of each form.
//! - [`gradcheck`] checks analytic gradients against central finite differences.
//!
//! Python users reach the same code through the `groupmm` package (feature `python`).

#![warn(missing_docs)]

pub mod api;
pub mod cpu;
pub mod cuda;
pub mod dtype;
pub mod error;
pub mod gradcheck;
pub mod shape;

#[cfg(feature = "python")]
mod python;

pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use shape::{Form, Layout};

/// Version of this crate.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
