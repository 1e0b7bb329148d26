// The C++ API of groupmm's CUDA part: what the cxx bridge of src/exec/ffi.rs binds (through
// host/bridge.h) and what the C++ harness (tests/cuda_harness) calls. The request and
// result structs are the bridge's shared structs, defined in the cxx-generated header
// groupmm/src/exec/ffi.rs.h. Every function throws std::runtime_error on failure, its
// message naming the failed call; none syncs with the device.
#pragma once
#include "host/plan.h"

#include <cstddef>
#include <cstdint>

namespace gmm {

struct PackedRequest;
struct PackedSubmit;
struct ListRequest;
struct ListGroup;
struct ListPlanned;
struct RowsRequest;

// Reads and clears the device's deferred error flag (OffsPending: nothing launched), plans
// the launch once, and launches it at once when `workspace` holds enough bytes and the
// stream is not capturing (Launched); otherwise returns the plan and the bytes it needs
// (NeedWorkspace; under capture `capturing` is set: the caller then gives fresh memory).
PackedSubmit submit_packed(const PackedRequest& r, uint64_t workspace, size_t workspace_bytes);

// Launches a plan that submit_packed returned, with `workspace` (256-byte aligned, at least
// the plan's bytes).
void launch_planned(const PackedPlan& plan, uint64_t workspace, size_t workspace_bytes);

// Reads and clears the deferred error flag (offs_pending: nothing planned), and plans a list
// launch of `count` groups: the argument block's size and the workspace it needs.
ListPlanned plan_list(const ListRequest& r, const ListGroup* groups, size_t count);

// Writes the plan's argument block (args_bytes) into host memory.
void write_list_args(const ListPlan& plan, uint8_t* host, size_t bytes);

// Launches a planned list product; `device_args` (256-byte aligned) holds the block
// write_list_args wrote, copied there on the plan's stream.
void launch_list(const ListPlan& plan, uint64_t device_args, uint64_t workspace,
                 size_t workspace_bytes);

// Enqueues one row op of the MoE glue (device/rows.h) on the request's stream.
void launch_rows(const RowsRequest& r);

// Whether products of `dtype` on `device` read routed rows through an index inside the GEMM
// (heuristics/choose.h, gathers_rows).
bool gathers_in_gemm(int32_t device, DType dtype);

// Reads and clears the deferred error flag of `device`.
bool take_deferred_error(int32_t device);

// The most SMs a launch of this process may occupy on any device (0: all of them): the
// persistent grids of the products and the row kernels' grids are sized to it, leaving
// the other SMs to kernels that run beside them (e.g. NCCL's exchanges on another
// stream). Process-wide; read at each launch's planning.
void set_sm_limit(int32_t sms);
int32_t sm_limit();

}  // namespace gmm
