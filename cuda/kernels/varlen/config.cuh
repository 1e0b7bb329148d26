// A varlen kernel's compile-time configuration: element type, form, B's major, tile width,
// consumer schedule, gathered rows, epilogue policy (epilogue/); the shared-memory layout
// that follows from it; the kernel's parameters and the host's encoders of their tensor
// maps. Device code (nvcc only).
//
// The ragged maps (the trick of Triton's tools/ragged_tma.py and quack): a 2-D [rows, C]
// tensor with row stride s is described as 4-D (C, 2^30, 2^31-1, 2^31-1) with strides
// (s, 2^34 - s, s) elements. Coordinates (c, 2^30 - len + r, 2^30, start + len) address
// row start + r (the 2^30 * 2^34 term wraps to 0 modulo 2^64) and the bound 2^30 of the
// second one cuts every row r >= len: loads read zeros there and stores skip it.
#pragma once
#include "kernels/varlen/args.h"

#include <cuda.h>

#include <string>
#include <type_traits>

#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cute/atom/mma_traits_sm90_gmma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

namespace gmm::varlen {

using namespace cute;

struct PlainEpi;  // epilogue/plain.cuh

// The kernel's parameters that every role reads, whatever the epilogue.
struct Params {
  CUtensorMap tma_a;  // varlen-M: 2-D [T, K]; varlen-K: ragged 4-D over x [T, M]
  CUtensorMap tma_b;  // varlen-M: 3-D [G, K, N] (either major); varlen-K: ragged 4-D over dY
  CUtensorMap tma_d;  // varlen-M: ragged 4-D over D [T, N]; varlen-K: 3-D [G, M, N]
                      // (an epilogue may use tma_b and tma_d its own way: epilogue/)
  const int* offs;
  int groups;
  int m, n, k;
  int* err_flag;
  // Gathered rows (Cfg::kGather): the gathered operand's tensor [gathered_rows, cols] with
  // row stride gathered_ld (varlen-M: the activations, cols = K; varlen-K: x (cols = M) or dY
  // (cols = N)), and src, the routed-row index: the int32 source row of each routed row (m of
  // them varlen-M, k varlen-K).
  const void* gathered;
  const int* src;
  int64_t gathered_ld;
  int gathered_rows;
};

// The parameters of a kernel with epilogue policy E: the common ones and the epilogue's own.
template <class E>
struct KernelParams : Params {
  typename E::Params epi;
};

template <class T_, Mode kMode_, bool kBKMajor_, int BN_,
          Schedule kSchedule_ = Schedule::Cooperative, Gather kGather_ = Gather::None,
          class Epi_ = PlainEpi>
struct Cfg {
  using T = T_;
  static constexpr Mode kMode = kMode_;
  static constexpr bool kBKMajor = kBKMajor_;  // varlen-M only; varlen-K's B is N-major
  static constexpr Schedule kSchedule = kSchedule_;
  static constexpr bool kPingPong = kSchedule == Schedule::PingPong;
  // The operand whose token rows are read through src[] (args.h), loaded by the producer
  // warpgroup with cp.async (TMA cannot gather rows on sm_90); the other one by TMA.
  static constexpr Gather kGatherOp = kGather_;
  static constexpr bool kGather = kGatherOp != Gather::None;
  static_assert(kGatherOp != Gather::B || kMode == Mode::K, "gathered B: varlen-K only");
  static constexpr int BM = 128, BN = BN_, BK = 64;
  // The epilogue policy (epilogue/common.cuh says what one holds) and its kernel parameters.
  using Epi = Epi_;
  using Params = KernelParams<Epi>;
  static_assert(Epi::fits(kMode, kSchedule, BN), "the epilogue does not run in this configuration");
  static constexpr Config kConfig{kMode, kSchedule, BN, kGatherOp, Epi::kEpi};
  static constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
  static constexpr bool kAKMajor = kMode == Mode::M;
  static constexpr GMMA::Major kMajA = kAKMajor ? GMMA::Major::K : GMMA::Major::MN;
  static constexpr GMMA::Major kMajB =
      (kMode == Mode::M && kBKMajor) ? GMMA::Major::K : GMMA::Major::MN;
  static_assert(BN % 64 == 0, "BN: whole 64-column chunks");
  // Ping-pong: one warpgroup holds a whole 128 x BN fp32 tile (BN registers per thread).
  static_assert(!kPingPong || BN <= 192, "ping-pong: at most 192 columns per warpgroup");

  using AtomA =
      conditional_t<kAKMajor, GMMA::Layout_K_SW128_Atom<T>, GMMA::Layout_MN_SW128_Atom<T>>;
  using AtomB = conditional_t<kMajB == GMMA::Major::K, GMMA::Layout_K_SW128_Atom<T>,
                              GMMA::Layout_MN_SW128_Atom<T>>;
  // MN-major tiles are laid out K-first, so that each 64-wide MN chunk (one TMA box of
  // 64 x BK elements) is contiguous.
  using OrderA = conditional_t<kAKMajor, Step<_1, _2, _3>, Step<_2, _1, _3>>;
  using OrderB = conditional_t<kMajB == GMMA::Major::K, Step<_1, _2, _3>, Step<_2, _1, _3>>;

  // The epilogue's staging tile: cooperative, the policy's number of 64-column chunks of BM
  // rows (the plain epilogue: the whole BM x BN tile); ping-pong, per warpgroup two BM x 64
  // chunk buffers used in turn.
  static constexpr int kDElems = kPingPong ? 2 * 2 * BM * 64 : Epi::coop_chunks(BN) * BM * 64;
  static constexpr int kStageBytes = (BM + BN) * BK * int(sizeof(T));
  // per stage, what the TMA unit loads (a gathered operand arrives by cp.async)
  static constexpr int kTmaBytes = (kGatherOp == Gather::A   ? BN
                                    : kGatherOp == Gather::B ? BM
                                                             : BM + BN) *
                                   BK * int(sizeof(T));
  static constexpr int kSmemLimit = 232448;  // sm_90 opt-in maximum per block
  static constexpr int kFit = (kSmemLimit - kDElems * int(sizeof(T)) - 1024) / kStageBytes;
  static constexpr int kStages = kFit > 8 ? 8 : kFit;
  static_assert(kStages >= 3, "tile too large for shared memory");

  using SmemLayoutA =
      decltype(tile_to_shape(AtomA{}, make_shape(Int<BM>{}, Int<BK>{}, Int<kStages>{}), OrderA{}));
  using SmemLayoutB =
      decltype(tile_to_shape(AtomB{}, make_shape(Int<BN>{}, Int<BK>{}, Int<kStages>{}), OrderB{}));

  using MmaAtom =
      decltype(GMMA::ss_op_selector<T, T, float, Shape<_64, Int<BN>, Int<BK>>, kMajA, kMajB>());
  // Cooperative: 2 warpgroups x 64 rows. Ping-pong: one warpgroup, two 64-row blocks.
  using TiledMma =
      decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<Int<kPingPong ? 1 : 2>, _1, _1>>{}));
  static constexpr int kConsumerThreads = kPingPong ? 128 : 256;  // per tile

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  struct alignas(1024) Smem {
    alignas(1024) T a[cosize_v<SmemLayoutA>];
    alignas(1024) T b[cosize_v<SmemLayoutB>];
    // 64-column chunks of BM rows, 128-byte rows with the TMA 128-byte swizzle: the layout
    // of the store boxes.
    alignas(1024) T d[kDElems];
    typename Pipeline::SharedStorage pipe;
    typename Epi::Smem epi;  // the epilogue's own
  };
  static constexpr int kSmemBytes = int(sizeof(Smem));
  static_assert(kSmemBytes <= kSmemLimit, "shared memory");
};

__host__ __device__ constexpr int big() { return 1 << 30; }  // the ragged maps' bound

// An extent of a tensor map: one where the call has none (never read, still legal).
inline uint64_t extent(int64_t v) { return uint64_t(v > 0 ? v : 1); }

inline std::string encode(CUtensorMap* map, CUtensorMapDataType dt, int rank, const void* base,
                          const uint64_t* dims, const uint64_t* strides_bytes, const uint32_t* box,
                          const char* what) {
  const cuuint32_t unit[5] = {1, 1, 1, 1, 1};
  const CUresult r = cuTensorMapEncodeTiled(
      map, dt, cuuint32_t(rank), const_cast<void*>(base), reinterpret_cast<const cuuint64_t*>(dims),
      reinterpret_cast<const cuuint64_t*>(strides_bytes), reinterpret_cast<const cuuint32_t*>(box),
      unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return std::string("cuTensorMapEncodeTiled (") + what + ") failed with CUresult " +
           std::to_string(int(r));
  }
  return "";
}

// A ragged 4-D map over a 2-D [rows, cols] operand with row stride s (elements).
inline std::string encode_ragged(CUtensorMap* map, CUtensorMapDataType dt, const void* base,
                                 int cols, int64_t s, uint32_t box_cols, uint32_t box_rows,
                                 const char* what) {
  const uint64_t es = 2, u = uint64_t(s);
  const uint64_t dims[4] = {uint64_t(cols > 0 ? cols : 1), uint64_t(big()), 0x7fffffffull,
                            0x7fffffffull};
  const uint64_t str[3] = {u * es, ((uint64_t(1) << 34) - u) * es, u * es};
  const uint32_t box[4] = {box_cols, box_rows, 1, 1};
  return encode(map, dt, 4, base, dims, str, box, what);
}

}  // namespace gmm::varlen
