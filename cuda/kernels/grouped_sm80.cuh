// CUTLASS 2.x grouped GEMM (GemmGrouped kernel, device-only group schedule): problem
// sizes, pointers and leading dimensions come from device arrays (a GemmSet), so the
// host never reads them. Used for Ampere-class GPUs, for misaligned groups on Hopper,
// for float32 output from 16-bit inputs, and for float32 / float64.
//
// We launch our own __global__ wrapper rather than cutlass::gemm::device::GemmGrouped:
// it lets one file skip device code that an architecture never runs, and keeps every
// CUDA call (and its error) in our hands.
#pragma once
#include "device/gemm_set.h"
#include "kernels/registry.h"

#include "cutlass/cutlass.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/gemm.h"
#include "cutlass/gemm/kernel/default_gemm_grouped.h"
#include "cutlass/gemm/kernel/gemm_grouped.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"
#include "cutlass/layout/matrix.h"
#include "cutlass/numeric_types.h"

#include <mutex>
#include <string>
#include <type_traits>

namespace gmm {

template <int M, int N, int K>
using Shape2x = cutlass::gemm::GemmShape<M, N, K>;

// One 2.x grouped kernel configuration.
//   TIn/TOut: element types; Acc: accumulator; LA/LB: layouts of A and B;
//   Tb/Warp/Inst: tile shapes; Stages: pipeline depth (2 = register-staged loads, any
//   alignment); AlignAB/AlignC: vector widths in elements; MathOp: arch::OpMultiplyAdd...
//   SkipSm90: device code is left empty when compiled for sm_90+ (Hopper runs the
//   sm_90a kernel for this case instead).
template <class TIn, class TOut, class Acc, class LA, class LB, class OpClass, class Tb, class Warp,
          class Inst, int Stages, int AlignAB, int AlignC, class MathOp, bool SkipSm90 = false>
struct Grouped2x {
  using Epilogue = cutlass::epilogue::thread::LinearCombination<
      TOut, AlignC, Acc, Acc, cutlass::epilogue::thread::ScaleType::OnlyAlphaScaling>;
  using Kernel = typename cutlass::gemm::kernel::DefaultGemmGrouped<
      TIn, LA, cutlass::ComplexTransform::kNone, AlignAB, TIn, LB, cutlass::ComplexTransform::kNone,
      AlignAB, TOut, cutlass::layout::RowMajor, Acc, OpClass, cutlass::arch::Sm80, Tb, Warp, Inst,
      Epilogue, cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, Stages,
      cutlass::gemm::kernel::GroupScheduleMode::kDeviceOnly, MathOp>::GemmKernel;
  static constexpr bool kSkipSm90 = SkipSm90;
};

template <class Cfg>
__global__ void __launch_bounds__(Cfg::Kernel::kThreadCount)
    grouped2x_kernel(typename Cfg::Kernel::Params params) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 900
  if constexpr (Cfg::kSkipSm90) {
    return;
  } else
#endif
  {
    extern __shared__ __align__(16) unsigned char smem2x[];
    typename Cfg::Kernel op;
    op(params, *reinterpret_cast<typename Cfg::Kernel::SharedStorage*>(smem2x));
  }
#endif
}

// Runs the problems of set `s` with configuration Cfg on ctx.stream. Problems with
// m = 0 or n = 0 get no tiles (the device-only problem visitor counts
// ceil(m/TbM) * ceil(n/TbN) tiles); callers never pass k = 0 problems with m, n > 0.
template <class Cfg>
std::string run_grouped2x(const GemmSet& s, const RunCtx& ctx, const char* name) {
  using K = typename Cfg::Kernel;
  if (s.count == 0) return "";
  if (s.count > INT32_MAX) return std::string(name) + ": too many groups";
  int smem = int(sizeof(typename K::SharedStorage));
  // Per-device occupancy, computed once (host-only queries, no sync).
  static std::once_flag once[64];
  static int blocks_per_sm[64];
  static cudaError_t init_err[64];
  int dev = ctx.device;
  if (dev < 0 || dev >= 64) return std::string(name) + ": device index out of range";
  std::call_once(once[dev], [&] {
    cudaError_t e = cudaSuccess;
    if (smem >= (48 << 10)) {
      e = cudaFuncSetAttribute(grouped2x_kernel<Cfg>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               smem);
    }
    int n = 0;
    if (e == cudaSuccess) {
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, grouped2x_kernel<Cfg>, K::kThreadCount,
                                                        smem);
    }
    blocks_per_sm[dev] = n;
    init_err[dev] = e;
  });
  if (init_err[dev] != cudaSuccess) {
    return std::string(name) + ": " +
           cuda_fail("cudaOccupancyMaxActiveBlocksPerMultiprocessor / cudaFuncSetAttribute",
                     init_err[dev]);
  }
  if (blocks_per_sm[dev] <= 0) {
    return std::string(name) + ": kernel cannot be resident (occupancy 0; shared memory " +
           std::to_string(smem) + " bytes)";
  }
  typename K::Arguments args(
      reinterpret_cast<cutlass::gemm::GemmCoord*>(s.prob), int(s.count),
      ctx.sm_count * blocks_per_sm[dev], typename K::EpilogueOutputOp::Params(1, 0),
      reinterpret_cast<typename K::ElementA**>(s.a), reinterpret_cast<typename K::ElementB**>(s.b),
      reinterpret_cast<typename K::ElementC**>(s.c), reinterpret_cast<typename K::ElementC**>(s.c),
      reinterpret_cast<typename K::LayoutA::Stride::LongIndex*>(s.lda),
      reinterpret_cast<typename K::LayoutB::Stride::LongIndex*>(s.ldb),
      reinterpret_cast<typename K::LayoutC::Stride::LongIndex*>(s.ldc),
      reinterpret_cast<typename K::LayoutC::Stride::LongIndex*>(s.ldc), nullptr);
  static_assert(sizeof(cutlass::gemm::GemmCoord) == 12, "GemmCoord must be 3 ints");
  static_assert(sizeof(typename K::LayoutA::Stride::LongIndex) == 8, "64-bit strides");
  typename K::Params params(args, nullptr, 0);
  dim3 grid(ctx.sm_count * blocks_per_sm[dev]);
  dim3 block(K::kThreadCount);
  grouped2x_kernel<Cfg><<<grid, block, smem, ctx.stream>>>(params);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return std::string(name) + ": " + cuda_fail("kernel launch", e);
  return "";
}

// The same configuration for the four A/B layout combinations.
template <template <class LA, class LB> class CfgOf>
std::string run_combo2x(int combo, const GemmSet& s, const RunCtx& ctx, const char* name) {
  using R = cutlass::layout::RowMajor;
  using C = cutlass::layout::ColumnMajor;
  switch (combo) {
    case 0: return run_grouped2x<CfgOf<R, R>>(s, ctx, name);
    case 1: return run_grouped2x<CfgOf<R, C>>(s, ctx, name);
    case 2: return run_grouped2x<CfgOf<C, R>>(s, ctx, name);
    case 3: return run_grouped2x<CfgOf<C, C>>(s, ctx, name);
    default: return std::string(name) + ": bad layout combination";
  }
}

}  // namespace gmm

namespace gmm {

#if defined(GROUPMM_SM90_TMA)
// Hopper runs the sm_90a TMA kernel for aligned same-dtype 16-bit groups: leave the
// sm_90 device code of the 2.x aligned kernel empty to save compile time.
constexpr bool kSkipAligned16OnSm90 = true;
#else
constexpr bool kSkipAligned16OnSm90 = false;
#endif

// 16-bit inputs (T = cutlass::half_t or cutlass::bfloat16_t), fp32 accumulation.
template <class T, class TOut, bool Skip>
struct Family16 {
  template <class LA, class LB>
  using Aligned =
      Grouped2x<T, TOut, float, LA, LB, cutlass::arch::OpClassTensorOp, Shape2x<128, 128, 32>,
                Shape2x<64, 64, 32>, Shape2x<16, 8, 16>, 4, 8,
                128 / cutlass::sizeof_bits<TOut>::value, cutlass::arch::OpMultiplyAdd, Skip>;
  template <class LA, class LB>
  using Any =
      Grouped2x<T, TOut, float, LA, LB, cutlass::arch::OpClassTensorOp, Shape2x<128, 128, 32>,
                Shape2x<64, 64, 32>, Shape2x<16, 8, 16>, 2, 1, 1, cutlass::arch::OpMultiplyAdd>;
};

// The run entry of a 16-bit family: inputs T, outputs TOut, the aligned (multistage,
// 16-byte vectors) or the any-alignment variant.
template <class T, class TOut, bool Aligned>
std::string run16(int combo, const GemmSet& s, const RunCtx& ctx) {
  constexpr bool same = std::is_same<T, TOut>::value;
  using F = Family16<T, TOut, same && kSkipAligned16OnSm90>;
  if constexpr (Aligned) {
    return run_combo2x<F::template Aligned>(
        combo, s, ctx,
        same ? "CUTLASS 2.x grouped (16-bit, aligned)"
             : "CUTLASS 2.x grouped (16-bit in, fp32 out, aligned)");
  } else {
    return run_combo2x<F::template Any>(
        combo, s, ctx,
        same ? "CUTLASS 2.x grouped (16-bit, any alignment)"
             : "CUTLASS 2.x grouped (16-bit in, fp32 out, any alignment)");
  }
}

// The four registry entries of a 16-bit family file: same-dtype and float32 outputs,
// aligned and any-alignment.
#define GMM_SM80_16BIT_KERNELS(stem, T, DT)                                                     \
  GMM_KERNEL_LIST(                                                                              \
      stem, {Engine::kSm80Aligned, DT, DT, Sm90Tile::kNone, nullptr, &run16<T, T, true>},       \
      {Engine::kSm80Any, DT, DT, Sm90Tile::kNone, nullptr, &run16<T, T, false>},                \
      {Engine::kSm80Aligned, DT, DType::F32, Sm90Tile::kNone, nullptr, &run16<T, float, true>}, \
      {Engine::kSm80Any, DT, DType::F32, Sm90Tile::kNone, nullptr, &run16<T, float, false>})

}  // namespace gmm
