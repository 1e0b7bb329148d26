//! TEMPORARY stub of the CUDA seam (replaced by the CUDA build).
#![allow(missing_docs, dead_code)]
use crate::{DType, Error, Form, Result};
#[derive(Clone, Copy, Debug)]
pub struct Operand { pub ptr: u64, pub batch: i64, pub rows: i64, pub cols: i64, pub batch_stride: i64, pub row_stride: i64, pub col_stride: i64 }
#[derive(Clone, Debug)]
pub struct PackedLaunch { pub form: Form, pub dtype: DType, pub out_dtype: DType, pub groups: i64, pub m: i64, pub n: i64, pub k: i64, pub a: Operand, pub b: Operand, pub c: Operand, pub offs: u64, pub stream: u64, pub device: i32, pub allow_tf32: bool }
#[derive(Clone, Debug)]
pub struct ListLaunch { pub dtype: DType, pub out_dtype: DType, pub dims: Vec<(i64, i64, i64)>, pub a: Vec<Operand>, pub b: Vec<Operand>, pub c: Vec<Operand>, pub stream: u64, pub device: i32, pub allow_tf32: bool }
pub struct CudaBuildInfo { pub archs: Vec<String>, pub cuda_runtime: String, pub cutlass: String }
fn no() -> Error { Error::Cuda("built without CUDA".into()) }
pub fn packed_workspace_bytes(_l: &PackedLaunch) -> Result<usize> { Err(no()) }
pub fn launch_packed(_l: &PackedLaunch, _w: u64, _b: usize) -> Result<()> { Err(no()) }
pub fn list_host_args_bytes(_l: &ListLaunch) -> Result<usize> { Err(no()) }
pub fn write_list_args(_l: &ListLaunch, _h: &mut [u8], _d: u64) -> Result<()> { Err(no()) }
pub fn list_workspace_bytes(_l: &ListLaunch) -> Result<usize> { Err(no()) }
pub fn launch_list(_l: &ListLaunch, _d: u64, _w: u64, _b: usize) -> Result<()> { Err(no()) }
pub fn take_offs_error(_d: i32) -> Result<bool> { Ok(false) }
pub fn build_info() -> Option<CudaBuildInfo> { None }
pub fn compiled() -> bool { false }
