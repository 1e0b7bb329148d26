// CUTLASS 3.x ptr-array grouped GEMM for sm_90a: TMA loads, warp-specialized
// cooperative schedule, per-group problem shapes / pointers / strides read from device
// arrays (a GemmSet; no host copy of the shapes). 16-bit in, same dtype out, fp32
// accumulation, output row-major.
//
// Every problem in the set must be TMA-legal: 16-byte aligned base addresses, leading
// dimensions that are multiples of 8 elements, and contiguous extents that are multiples
// of 8 (the argument builders send any other group to the 2.x fallback). Problems with
// m = 0 or n = 0 get no tiles in PersistentTileSchedulerSm90Group (ceil-div tile counts
// of 0), and no problem with k = 0 and m, n > 0 is ever passed (the builders zero those
// outputs themselves; CUTLASS 4.2 grouped kernels do not handle k = 0).
#pragma once
#include "device/gemm_set.h"
#include "kernels/registry.h"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include <atomic>
#include <string>

namespace gmm {

// Tile configurations, one family per kernels/sm90_<dtype>_grouped_<config>.cu file (they
// compile in parallel); the choice lives in cuda/heuristics/choose.cc. The group tile
// scheduler rounds each group's M tiles up to the cluster's M extent, so a 2x1x1 cluster
// wastes a whole CTA on a group with a single M tile: the small-expert configurations use
// 1x1x1 clusters. A new configuration may define its Cfg in its own file.
using CoopSched = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using CoopEpi = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using PingSched = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
using PingEpi = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;

// Large experts: the cooperative 128x256x64 tile, cluster 2x1x1 (B multicast).
struct Sm90Cfg128x256 {
  using Tile = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using Schedule = CoopSched;
  using EpiSchedule = CoopEpi;
  static constexpr const char* name = "128x256x64 cluster 2x1x1 cooperative";
};
// Medium experts / short N: cooperative 128x128x64, cluster 1x1x1 (no cluster round-up).
struct Sm90Cfg128x128 {
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Schedule = CoopSched;
  using EpiSchedule = CoopEpi;
  static constexpr const char* name = "128x128x64 cluster 1x1x1 cooperative";
};
// Small experts and short reductions (dW): ping-pong, each consumer warp group owns a
// 64x128 tile with a 128-deep k step, so one group's epilogue overlaps the other's
// mainloop; cluster 1x1x1.
struct Sm90CfgPing64x128 {
  using Tile = cute::Shape<cute::_64, cute::_128, cute::_128>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Schedule = PingSched;
  using EpiSchedule = PingEpi;
  static constexpr const char* name = "64x128x128 cluster 1x1x1 ping-pong";
};

// Pointer-to-pointer casts of the untyped GemmSet arrays.
template <class To, class From>
inline To as(From* p) {
  return reinterpret_cast<To>(reinterpret_cast<uintptr_t>(p));
}

template <class T, class LA, class LB, class Cfg>
struct Sm90Grouped {
  using Problem = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using LC = cutlass::layout::RowMajor;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<T>::value;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::Tile,
      typename Cfg::Cluster, cutlass::epilogue::collective::EpilogueTileAuto, float, float, T, LC*,
      kAlign, T, LC*, kAlign, typename Cfg::EpiSchedule,
      cutlass::epilogue::fusion::LinearCombination<T, float, T, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, LA*, kAlign, T, LB*, kAlign, float,
      typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Cfg::Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Problem, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  // Each stride has exactly one dynamic (int64) mode: the leading dimension. That lets
  // the builders write one int64 per group, as for the 2.x kernels.
  static_assert(sizeof(StrideA) == 8 && sizeof(StrideB) == 8 && sizeof(StrideC) == 8 &&
                    sizeof(StrideD) == 8,
                "packed strides must hold exactly one int64");
  static_assert(sizeof(typename Problem::UnderlyingProblemShape) == 12, "(m, n, k) as 3 ints");

  static typename Gemm::Arguments arguments(const GemmSet& s, const RunCtx& ctx) {
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape =
        Problem{int(s.count), as<typename Problem::UnderlyingProblemShape*>(s.prob), nullptr};
    args.mainloop.ptr_A = as<const T**>(s.a);
    args.mainloop.dA = as<StrideA*>(s.lda);
    args.mainloop.ptr_B = as<const T**>(s.b);
    args.mainloop.dB = as<StrideB*>(s.ldb);
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 1.0f;
    fusion.beta = 0.0f;  // C is never read (is_source_needed() is false for beta == 0)
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.alpha_ptr_array = nullptr;
    fusion.beta_ptr_array = nullptr;
    args.epilogue.ptr_C = as<const T**>(s.c);
    args.epilogue.dC = as<StrideC*>(s.ldc);
    args.epilogue.ptr_D = as<T**>(s.c);
    args.epilogue.dD = as<StrideD*>(s.ldc);
    args.hw_info.device_id = ctx.device;
    args.hw_info.sm_count = ctx.sm_count;
    return args;
  }

  // Devices (bit i: device i) on which this kernel's shared memory attribute is set.
  static std::atomic<uint64_t>& attr_set() {
    static std::atomic<uint64_t> mask{0};
    return mask;
  }

  static size_t workspace_bytes(int64_t count, int sm_count) {
    GemmSet s;
    s.count = count;
    // Host-only size computation; the pointers are never dereferenced here.
    uintptr_t fake = 256;
    s.prob = reinterpret_cast<int*>(fake);
    s.a = s.b = s.c = reinterpret_cast<void**>(fake);
    s.lda = s.ldb = s.ldc = reinterpret_cast<int64_t*>(fake);
    RunCtx ctx;
    ctx.sm_count = sm_count;
    return Gemm::get_workspace_size(arguments(s, ctx));
  }

  static std::string run(const GemmSet& s, const RunCtx& ctx, const char* name) {
    if (s.count == 0) return "";
    if (s.count > INT32_MAX) return std::string(name) + ": too many groups";
    auto args = arguments(s, ctx);
    Gemm gemm;
    cutlass::Status st = gemm.can_implement(args);
    if (st != cutlass::Status::kSuccess) {
      return std::string(name) + ": CUTLASS can_implement failed: " + cutlassGetStatusString(st);
    }
    size_t need = Gemm::get_workspace_size(args);
    if (need > ctx.workspace_bytes) {
      return std::string(name) + ": workspace too small (" + std::to_string(ctx.workspace_bytes) +
             " bytes given, " + std::to_string(need) + " needed)";
    }
    // initialize() also raises the kernel's dynamic shared memory limit
    // (cudaFuncSetAttribute), which holds per device for the process: only the first
    // launch on a device pays for it; later ones only rebuild the params (update(); the
    // workspace initialisation of these ptr-array kernels is a no-op in CUTLASS 4.2).
    const uint64_t bit = uint64_t(1) << (ctx.device & 63);
    const bool first = (attr_set().load(std::memory_order_acquire) & bit) == 0 || ctx.device > 63;
    st =
        first ? gemm.initialize(args, ctx.workspace, ctx.stream) : gemm.update(args, ctx.workspace);
    if (st == cutlass::Status::kSuccess && first)
      attr_set().fetch_or(bit, std::memory_order_release);
    if (st != cutlass::Status::kSuccess) {
      cudaError_t e = cudaGetLastError();
      return std::string(name) + ": CUTLASS initialize failed: " + cutlassGetStatusString(st) +
             " (" + cudaGetErrorString(e) + ")";
    }
    st = gemm.run(ctx.stream);
    cudaError_t e = cudaGetLastError();
    if (st != cutlass::Status::kSuccess || e != cudaSuccess) {
      return std::string(name) + ": CUTLASS run failed: " + cutlassGetStatusString(st) + " (" +
             cudaGetErrorString(e) + ")";
    }
    return "";
  }
};

template <class T, class Cfg>
struct Sm90Family {
  using R = cutlass::layout::RowMajor;
  using C = cutlass::layout::ColumnMajor;
  static size_t workspace_bytes(int combo, int64_t count, int sm_count) {
    switch (combo) {
      case 0: return Sm90Grouped<T, R, R, Cfg>::workspace_bytes(count, sm_count);
      case 1: return Sm90Grouped<T, R, C, Cfg>::workspace_bytes(count, sm_count);
      case 2: return Sm90Grouped<T, C, R, Cfg>::workspace_bytes(count, sm_count);
      default: return Sm90Grouped<T, C, C, Cfg>::workspace_bytes(count, sm_count);
    }
  }
  static std::string run(int combo, const GemmSet& s, const RunCtx& ctx, const char* name) {
    switch (combo) {
      case 0: return Sm90Grouped<T, R, R, Cfg>::run(s, ctx, name);
      case 1: return Sm90Grouped<T, R, C, Cfg>::run(s, ctx, name);
      case 2: return Sm90Grouped<T, C, R, Cfg>::run(s, ctx, name);
      case 3: return Sm90Grouped<T, C, C, Cfg>::run(s, ctx, name);
      default: return std::string(name) + ": bad layout combination";
    }
  }
};

// The registry entry of one (dtype, configuration) family.
template <class T, class Cfg>
struct Sm90Entry {
  static const char* label;
  static size_t workspace_bytes(int combo, int64_t count, int sm_count) {
    return Sm90Family<T, Cfg>::workspace_bytes(combo, count, sm_count);
  }
  static std::string run(int combo, const GemmSet& s, const RunCtx& ctx) {
    return Sm90Family<T, Cfg>::run(combo, s, ctx, label);
  }
};

// Defines the KernelList of kernels/<stem>.cu (stem = sm90_<dtype>_grouped_<config>):
// element type T (DType DT in and out), tile configuration Cfg (Sm90Tile TILE), LABEL for
// messages.
#define GMM_SM90_KERNEL(stem, T, DT, TILE, Cfg, LABEL)                                        \
  template <>                                                                                 \
  const char* Sm90Entry<T, Cfg>::label = LABEL;                                               \
  GMM_KERNEL_LIST(stem, {Engine::kSm90Tma, DT, DT, TILE, &Sm90Entry<T, Cfg>::workspace_bytes, \
                         &Sm90Entry<T, Cfg>::run})

}  // namespace gmm
