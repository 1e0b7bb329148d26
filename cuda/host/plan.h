// Planned launches: everything a launch needs, derived on the host from its request alone
// (no device reads), so that a launch plans once. The Rust bridge holds them as opaque
// types (PackedPlan behind submit_packed/launch_planned, ListPlan behind plan_list).
#pragma once
#include "device/args.h"
#include "heuristics/choose.h"
#include "host/device.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gmm {

struct Operand;

// The builder's view of an operand that Rust normalised (src/exec/cuda.rs `operand`):
// element strides derived from its major and leading dimension (cuda/host/packed.cc).
OpDesc op_desc(const Operand& o);

struct PackedPlan {
  // Set when the call runs on groupmm's own varlen kernels (kernels/varlen/): then the
  // rest of the plan is unused: no argument builder, no sets, no workspace.
  const KernelEntry* varlen = nullptr;
  varlen::Args va;
  // The request's fusion is one no kernel here does: nothing else is planned.
  bool unsupported = false;
  PackedDesc d;  // what the argument builder reads (its sets are placed at launch)
  Kernels k;
  int combo = 0;
  bool need_fallback = true;  // false: alignment proven on the host for every group
  size_t args_bytes = 0;      // the primary and fallback sets
  size_t cutlass_bytes = 0;   // the primary kernel's workspace
  int64_t max_zero = 0;       // most output elements the builder may zero
  DevInfo dev;
  int device = 0;
  cudaStream_t stream = nullptr;

  // Workspace bytes of the launch (sets, then the kernel's workspace, 256-byte aligned).
  size_t workspace_bytes() const {
    return varlen != nullptr ? 0 : args_bytes + round_up(cutlass_bytes, 256);
  }
};

// One set of the list form's argument block: the groups of one kernel and layout
// combination, or (kernel null) the groups to zero.
struct ListSet {
  const KernelEntry* kernel = nullptr;
  int combo = 0;
  int64_t count = 0;
  size_t offset = 0;  // in the argument block
};

struct ListPlan {
  DType out = DType::F32;
  int device = 0;
  cudaStream_t stream = nullptr;
  DevInfo dev;
  std::vector<int64_t> dims;  // (m, n, k) per group
  std::vector<OpDesc> a, b, c;
  // route[i]: index into sets, -1: nothing to run (empty output), -2: the zero set
  std::vector<int> route;
  std::vector<ListSet> sets;
  int64_t zero_count = 0;
  size_t zero_offset = 0;
  int64_t zero_max_elems = 0;
  size_t bytes = 0;          // of the argument block
  size_t cutlass_bytes = 0;  // workspace
};

}  // namespace gmm
