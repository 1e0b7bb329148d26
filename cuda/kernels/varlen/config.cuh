// A varlen kernel's compile-time configuration: element type, form, B's major, tile width,
// consumer schedule, gathered rows; the shared-memory layout that follows from it; and the
// kernel's parameters. Device code (nvcc only).
#pragma once
#include "kernels/varlen/args.h"

#include <cuda.h>

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

template <class T_, Mode kMode_, bool kBKMajor_, int BN_,
          Schedule kSchedule_ = Schedule::Cooperative, Gather kGather_ = Gather::None,
          Epilogue kEpi_ = Epilogue::Plain>
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
  // The fused epilogues (args.h): a ping-pong warpgroup's 128 x 128 tile is 64 gate and 64
  // up columns (SwiGLU, B read as two 64-column halves) or 128 columns of p (DGated).
  static constexpr Epilogue kEpi = kEpi_;
  static_assert(kEpi == Epilogue::Plain ||
                    (kMode == Mode::M && kSchedule == Schedule::PingPong && BN == 128),
                "fused epilogues: varlen-M, ping-pong 128 x 128");
  static constexpr Config kConfig{kMode, kSchedule, BN, kGatherOp, kEpi};
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

  // The epilogue's staging tile: cooperative, the whole BM x BN tile (64-column chunks of
  // BM rows); ping-pong, per warpgroup two BM x 64 chunk buffers used in turn.
  static constexpr int kDElems = kPingPong ? 2 * 2 * BM * 64 : BM * BN;
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
    // DGated: per consumer warpgroup, the barrier its TMA loads of pre's chunks arrive on.
    alignas(8) uint64_t epi_bar[2];
  };
  static constexpr int kSmemBytes = int(sizeof(Smem));
  static_assert(kSmemBytes <= kSmemLimit, "shared memory");
};

struct Params {
  CUtensorMap tma_a;  // varlen-M: 2-D [T, K]; varlen-K: ragged 4-D over x [T, M]
  CUtensorMap tma_b;  // varlen-M: 3-D [G, K, N] (either major); varlen-K: ragged 4-D over dY
  CUtensorMap tma_d;  // varlen-M: ragged 4-D over D [T, N]; varlen-K: 3-D [G, M, N]
  const int* offs;
  int groups;
  int m, n, k;
  int* err_flag;
  // The fused epilogues (args.h). SwiGLU: tma_b is B's gate half and tma_b2 its up half
  // (F columns each), tma_d and tma_d2 the two halves of pre; DGated: tma_d and tma_d2 the
  // two halves of dpre. tma_act: act [m, F] (ragged, like tma_d).
  CUtensorMap tma_b2, tma_d2, tma_act;
  CUtensorMap tma_pre, tma_pre2;  // DGated: pre's gate and up halves (ragged, F columns)
  const void* pre;                // DGated: [m, 2F]
  const float* scale;
  float* partial;
  int f;  // F
  // Gathered rows (Cfg::kGather): the gathered operand's tensor [gathered_rows, cols] with
  // row stride gathered_ld (varlen-M: the activations, cols = K; varlen-K: x (cols = M) or dY
  // (cols = N)), and src, the routed-row index: the int32 source row of each routed row (m of
  // them varlen-M, k varlen-K).
  const void* gathered;
  const int* src;
  int64_t gathered_ld;
  int gathered_rows;
};

__host__ __device__ constexpr int big() { return 1 << 30; }  // the ragged maps' bound

}  // namespace gmm::varlen
