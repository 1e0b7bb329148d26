// Which sm_90a tile configuration runs a call: the choice of kernel for Hopper, apart from
// the launchers (it reads only host-known values: no device reads, no sync).
#pragma once
#include "device/types.h"

#include <cstdint>

namespace gmm {

// What the choice reads. Packed forms: the form, G and the plan's m, n, k (GroupedM
// m = T total rows, GroupedK k = T total reduction, GroupedN n = total columns). The list
// form (`list`): m = average rows of the non-empty groups, n and k their maxima.
struct Sm90Shape {
  bool list = false;
  Form form = Form::GroupedM;
  int64_t groups = 0, m = 0, n = 0, k = 0;
  int sm_count = 0;
};

// The name of the configuration to run, the <config> of a kernel file
// kernels/sm90_<dtype>_grouped_<config>.cu. GROUPMM_SM90_CONFIG=<config> forces one
// (read once per process; "auto" or unset: the rule below).
const char* sm90_pick_config(const Sm90Shape& s);

// True when a packed call that groupmm's own varlen kernels can read (kernels/varlen.h:
// GroupedM or GroupedK, 16-bit, the layouts and alignment they need) should run on them
// rather than on the CUTLASS ptr-array kernels. GROUPMM_SM90_VARLEN=0 (never) or 1
// (whenever they can) overrides the rule (read once per process).
bool sm90_use_varlen(const Sm90Shape& s);

// True when a GroupedM call with gathered A rows (PackedRequest::a_index) should read them
// inside the GEMM (the varlen_m_gather kernels) rather than have the caller gather them
// into an [R, K] copy first. Off unless GROUPMM_SM90_GATHER=1 (read once per process):
// measured slower than gather-then-GEMM on every MoE shape tried (benches/NOTES-gpu.md,
// run 10), it saves only the copy's memory.
bool sm90_gather_in_gemm();

}  // namespace gmm
