// C++ side of the cxx bridge in src/cuda.rs. Plain host C++: the functions below call the
// C launchers of launch.h and turn their error codes into std::runtime_error, which cxx
// hands to Rust as Err(cxx::Exception).
#pragma once
#include "rust/cxx.h"

#include <cstddef>
#include <cstdint>

namespace groupmm {

struct FfiOperand;
struct FfiPacked;
struct FfiList;

size_t packed_workspace_bytes(const FfiPacked& p);
void launch_packed(const FfiPacked& p, uint64_t workspace, size_t workspace_bytes);
size_t list_args_bytes(const FfiList& l, rust::Slice<const int64_t> dims,
                       rust::Slice<const FfiOperand> a, rust::Slice<const FfiOperand> b,
                       rust::Slice<const FfiOperand> c);
void write_list_args(const FfiList& l, rust::Slice<const int64_t> dims,
                     rust::Slice<const FfiOperand> a, rust::Slice<const FfiOperand> b,
                     rust::Slice<const FfiOperand> c, rust::Slice<uint8_t> host,
                     uint64_t device_addr);
size_t list_workspace_bytes(const FfiList& l, rust::Slice<const int64_t> dims,
                            rust::Slice<const FfiOperand> a, rust::Slice<const FfiOperand> b,
                            rust::Slice<const FfiOperand> c);
void launch_list(const FfiList& l, rust::Slice<const int64_t> dims,
                 rust::Slice<const FfiOperand> a, rust::Slice<const FfiOperand> b,
                 rust::Slice<const FfiOperand> c, uint64_t device_args, uint64_t workspace,
                 size_t workspace_bytes);
bool take_offs_error(int32_t device);
bool stream_capturing(uint64_t stream);
rust::String cutlass_version();

}  // namespace groupmm
