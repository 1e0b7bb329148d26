//! # groupmm
//!
//! Grouped matrix multiply (grouped GEMM) for Mixture-of-Experts models: many
//! independent products `C_g = A_g · B_g` of per-group shapes in one call, forward and
//! backward, on CPU (this crate's Rust kernels) and on NVIDIA GPUs (CUTLASS kernels,
//! when built with CUDA).
//!
//! - [`api`] is the Rust API on `ndarray` views: forward and backward of each form. It
//!   is a face of the engine, as the Python module is (feature `python`).
//! - The engine (`exec`, private) runs every call: validate, plan, dispatch to the CPU
//!   kernels or the CUDA launchers (through one `cxx` bridge), compose the backward.
//! - [`shape`] owns every rule about arguments and the wording of its error.
//! - [`layout`] is the geometry every layer shares (shape and strides of an operand).
//! - [`cpu`] holds the CPU kernels: the per-group GEMMs, run in parallel, and the row
//!   ops of the MoE glue.
//! - [`gradcheck`] checks analytic gradients against central finite differences.
//!
//! ARCHITECTURE.md at the repository root is the map.

#![warn(missing_docs)]

pub mod api;
pub mod cpu;
pub mod dtype;
pub mod error;
pub(crate) mod exec;
pub mod gradcheck;
pub mod layout;
pub mod shape;

#[cfg(feature = "python")]
mod python;

pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use layout::Layout;
pub use shape::Form;

/// Version of this crate.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
