//! The engine: the one pipeline behind every face.
//!
//! request → validate (the rules of [`crate::shape`]) → plan → dispatch (the CPU kernels
//! of [`crate::cpu`] through [`cpu`], or the CUDA launchers of `cuda/` through [`cuda`])
//! → backward composition (`dA = dC·Bᵀ`, `dB = Aᵀ·dC` on transposed descriptions, no
//! copies), written once for the packed forms ([`packed`]) and the list form ([`list`]);
//! the products of the MoE layer ([`product`]: gathered rows, the fused expert products'
//! epilogues, their weight gradients) and the row ops of the MoE glue ([`rows`]) go the
//! same way. See ARCHITECTURE.md.
//!
//! The engine never sees a Python object or an ndarray type. A face ([`crate::api`] on
//! ndarray, `crate::python` on torch tensors and numpy arrays) describes each array as a
//! [`Tensor`] (address, dtype, [`Layout`](crate::layout::Layout), [`Device`]) or an
//! [`IntTensor`] (`offs`, an index), and lends what its runtime provides through
//! [`Runtime`]: fresh outputs, CUDA workspaces and argument blocks, normalised copies of
//! operands no kernel can read in place, the current CUDA stream, the TF32 flag, and a
//! way to run the CPU kernels (e.g. with the GIL released).
//!
//! Every check happens before anything is allocated or written: on error the caller's
//! buffers are untouched.
//!
//! This file only names the parts: the vocabulary they all speak is [`vocab`], the
//! operand and output normalisation they share is [`operands`]; no module of `exec/`
//! imports from this one.

// The ndarray face runs on the CPU only: without the Python face, or in a build without
// CUDA, the CUDA half of the engine (devices, workspaces, the launchers) has no caller.
#![cfg_attr(any(not(feature = "python"), not(groupmm_cuda)), allow(dead_code))]

mod cpu;
pub(crate) mod cuda;
pub(crate) mod ffi;
mod list;
mod operands;
mod packed;
mod product;
pub(crate) mod rows;
mod vocab;

pub use list::{list, list_backward};
pub use packed::{packed, packed_backward};
#[cfg(feature = "python")]
pub use product::{plain, product, Outputs, ProductRequest};
pub use vocab::{Device, IntTensor, Output, Runtime, Tensor};
