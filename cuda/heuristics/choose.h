// The choice of kernels for a call: which engine, and for Hopper which kernel family and
// configuration (varlen or ptr-array, tile, schedule, in-GEMM gather). One function per call
// form, reading host-known values only (no device reads, no sync), so a launch plans once.
// In a development build (GROUPMM_DEV_KNOBS=1, build/main.rs) GROUPMM_SM90_* environment
// variables force any part of it (env.h; read once per process); a product build has none:
//   GROUPMM_SM90_VARLEN         auto | 0 | 1   the varlen kernels never / whenever they can (auto:
//   1) GROUPMM_SM90_VARLEN_CONFIG  auto | pp128 | pp192 | co128 | co192   varlen configuration
//                               (where the build has it for the call's mode; else auto)
//   GROUPMM_SM90_CONFIG         auto | 128x256 | 128x128 | ping64x128  ptr-array tile
//   GROUPMM_SM90_GATHER         auto | 0 | 1   read routed rows through the index inside the
//                               GEMM (auto: yes), every gathered product; 0: gather first
//   GROUPMM_SM90_GATHER_K       auto | co256 | co192 | pp128   gathered varlen-K configuration
//   GROUPMM_SM90_SWIGLU         auto | co256 | pp128   SwiGLU epilogue configuration
//   GROUPMM_SM90_DGATED         auto | co256 | pp128   DGated epilogue on gathered rows
// The configurations only these reach are compiled in development builds only
// (kernels/sm90_*_varlen_dev.cu).
// Host only.
#pragma once
#include "device/types.h"
#include "host/device.h"
#include "kernels/registry.h"

#include <cstdint>

namespace gmm {

// The kernels a call routes its groups to: `primary` (may be null) takes the groups that
// meet the 16-byte rule (device/align.h), `fallback` every other group.
struct Kernels {
  const KernelEntry* primary = nullptr;
  const KernelEntry* fallback = nullptr;
};

// A packed call as the choice sees it: the plan's form and sizes (GroupedM m = T rows,
// GroupedK k = T tokens, GroupedN n = total columns).
struct PackedCall {
  Form form = Form::GroupedM;
  DType in = DType::BF16, out = DType::BF16;
  bool allow_tf32 = false;
  int64_t groups = 0, m = 0, n = 0, k = 0;
  // The request's fusion asks for one operand's rows through a routed-row index (GroupedM:
  // A; GroupedK: A = x^T or B = dY).
  varlen::Gather gather = varlen::Gather::None;
  // The request's fusion asks for a fused epilogue, by name (GroupedM; empty: none).
  Epilogue epi = {};
  // The call as the varlen kernels would read it, or null when its layouts are not theirs
  // (GroupedM with row-major A; GroupedK with x^T and row-major dY).
  const varlen::Args* varlen = nullptr;
};

struct PackedChoice {
  const KernelEntry* varlen = nullptr;  // set: one varlen launch does the whole call
  Kernels kernels;                      // otherwise: the ptr-array / 2.x kernels
  // The call asks for a fusion that no kernel here does (or that an override turned
  // off): nothing is chosen, the caller composes it from plain calls.
  bool unsupported = false;
};

// Throws std::runtime_error for an unsupported dtype pair or device, or a chosen kernel
// this build lacks.
PackedChoice choose_packed(const PackedCall& c, const DevInfo& dev);

// A list call: `groups` non-empty groups of `avg_m` rows on average, `max_n`, `max_k` the
// largest extents.
struct ListCall {
  DType in = DType::BF16, out = DType::BF16;
  bool allow_tf32 = false;
  int64_t groups = 0, avg_m = 0, max_n = 0, max_k = 0;
};
Kernels choose_list(const ListCall& c, const DevInfo& dev);

// True when calls of this dtype pair have a primary kernel for 16-byte-aligned groups
// (the list form routes each group by it before the choice).
bool has_aligned_engine(DType in, DType out);

// True unless in-GEMM gathering is turned off (GROUPMM_SM90_GATHER=0; choose.cc has the
// measurements): lets submit_packed answer "unsupported" before any device work then.
bool gather_in_gemm();
// True when products of dtype `dt` on `dev` read routed rows through an index inside the
// GEMM (the sm_90 varlen kernels, 16-bit, gathering on); where a call's operands are not
// readable by them (varlen::can_read) the engine still gathers that call's rows first.
bool gathers_rows(DType dt, const DevInfo& dev);

}  // namespace gmm
