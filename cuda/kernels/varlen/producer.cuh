// The producers of the varlen kernels: the loads of A and B tiles into the ring of
// shared-memory stages, by TMA (one thread), or A's rows gathered through an index by the
// whole producer warpgroup with cp.async. Device code (nvcc only).
//
// A varlen-M tile reads A rows tile.m0 .. tile.m0 + 127 through one 2-D map of the packed
// [T, K] activations (rows past the group's end feed output rows that are not stored) and
// the group's weights through a 3-D map at batch g. A varlen-K tile reads each group's
// token range through ragged maps (config.cuh's big()), so the TMA unit zero-fills every
// token past the group's end: a partial k-tile adds nothing, no masking in the mainloop.
#pragma once
#include "kernels/varlen/scheduler.cuh"

namespace gmm::varlen {

// k-blocks of a tile: varlen-M every group's K; varlen-K its own tokens; 0 for the zero
// tail and empty groups.
template <class C>
__device__ __forceinline__ int k_blocks(const Params& p, const Tile& tile) {
  if constexpr (C::kMode == Mode::M) return tile.group < p.groups ? (p.k + C::BK - 1) / C::BK : 0;
  return (tile.len + C::BK - 1) / C::BK;
}

// varlen-M: the B tile of k-block kb (the weights of the tile's group), by TMA. One thread.
template <class C>
__device__ __forceinline__ void load_b_m(const Params& p, const Tile& tile, int kb, uint64_t* bar,
                                         typename C::T* sb) {
  const uint64_t hint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
  if constexpr (C::kEpi == Epilogue::SwiGLU) {
    // The tile's 64 gate columns, then the same 64 columns of the up half: both 64 x BK
    // boxes land where a 128-column tile's two halves would (either major).
    const int j0 = tile.n0 / 2;
    if constexpr (C::kBKMajor) {
      SM90_TMA_LOAD_3D::copy(&p.tma_b, bar, hint, sb, kb * C::BK, j0, tile.group);
      SM90_TMA_LOAD_3D::copy(&p.tma_b2, bar, hint, sb + 64 * C::BK, kb * C::BK, j0, tile.group);
    } else {
      SM90_TMA_LOAD_3D::copy(&p.tma_b, bar, hint, sb, j0, kb * C::BK, tile.group);
      SM90_TMA_LOAD_3D::copy(&p.tma_b2, bar, hint, sb + 64 * C::BK, j0, kb * C::BK, tile.group);
    }
  } else if constexpr (C::kBKMajor) {
    SM90_TMA_LOAD_3D::copy(&p.tma_b, bar, hint, sb, kb * C::BK, tile.n0, tile.group);
  } else {
    CUTE_UNROLL
    for (int j = 0; j < C::BN / 64; ++j) {
      SM90_TMA_LOAD_3D::copy(&p.tma_b, bar, hint, sb + j * 64 * C::BK, tile.n0 + 64 * j, kb * C::BK,
                             tile.group);
    }
  }
}

// Gathered A (varlen-M): the whole producer warpgroup (thread pt of 128) loads the A tile
// row by row with cp.async into the layout the TMA would have written (128-byte rows, 16-byte
// units XOR-ed with row % 8): thread pt owns unit pt % 8 of rows pt / 8 + 16 i. Each thread's
// cp.async completions arrive on the stage's full barrier (noinc: the barrier counts 1 + 128
// arrivals); thread 0 adds the B tile by TMA. Rows past the group's end, rows whose index is
// out of [0, a_rows) and columns past K are zero-filled without reading memory; an index out
// of range also sets the deferred error flag to kErrIndex (reported at the next call).
template <class C, class Pipeline, class Sched>
__device__ __forceinline__ void produce_gathered(const Params& p, Pipeline& pipeline, Sched& sched,
                                                 typename C::Smem& smem, int pt) {
  using T = typename C::T;
  constexpr int BM = C::BM, BK = C::BK, kRows = BM / 16;
  static_assert(BK * int(sizeof(T)) == 128, "one 128-byte swizzle row per A row and k-block");
  const int unit = pt % 8, r0 = pt / 8;
  const uint32_t off = uint32_t(r0 * 128 + ((unit ^ (r0 % 8)) << 4));
  const char* abase = static_cast<const char*>(p.a);
  const int64_t row_bytes = p.lda * int64_t(sizeof(T));
  auto ws = cutlass::make_producer_start_state<Pipeline>();
  for (int t = blockIdx.x;; t += gridDim.x) {
    const Tile tile = sched.get(t);
    if (!tile.valid) break;
    if (tile.group >= p.groups) continue;  // the zero tail: no k-blocks
    const int end = tile.start + tile.len;
    int src[kRows];
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int row = tile.m0 + r0 + 16 * i;
      int v = -1;
      if (row < end) {
        v = __ldg(p.gather + row);
        if (v < 0 || v >= p.a_rows) {
          v = -1;
          if (p.err_flag != nullptr) *reinterpret_cast<volatile int*>(p.err_flag) = kErrIndex;
        }
      }
      src[i] = v;
    }
    const int kbs = (p.k + BK - 1) / BK;
    for (int kb = 0; kb < kbs; ++kb) {
      pipeline.producer_acquire(ws);
      uint64_t* bar = pipeline.producer_get_barrier(ws);
      const uint32_t sa = cast_smem_ptr_to_uint(smem.a + ws.index() * (BM * BK)) + off;
      const int col = kb * BK + unit * 8;
      int kb_bytes = (p.k - col) * int(sizeof(T));
      kb_bytes = kb_bytes < 0 ? 0 : (kb_bytes > 16 ? 16 : kb_bytes);
      CUTE_UNROLL
      for (int i = 0; i < kRows; ++i) {
        const int bytes = src[i] >= 0 ? kb_bytes : 0;
        const char* g = bytes > 0 ? abase + src[i] * row_bytes + col * int64_t(sizeof(T)) : abase;
        asm volatile(
            "cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa + uint32_t(i * 16 * 128)),
            "l"(g), "r"(bytes)
            : "memory");
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(bar);
      if (pt == 0) load_b_m<C>(p, tile, kb, bar, smem.b + ws.index() * (C::BN * BK));
      ++ws;
    }
  }
}

// The TMA producer (one warp; lane 0 issues): every k-block of every tile of this CTA into
// the ring, in the order the consumers read it.
template <class C, class Pipeline, class Sched>
__device__ __forceinline__ void produce_tma(const Params& p, Pipeline& pipeline, Sched& sched,
                                            typename C::Smem& smem, int lane) {
  using T = typename C::T;
  constexpr int BM = C::BM, BN = C::BN, BK = C::BK;
  auto ws = cutlass::make_producer_start_state<Pipeline>();
  const uint64_t hint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
  for (int t = blockIdx.x;; t += gridDim.x) {
    const Tile tile = sched.get(t);
    if (!tile.valid) break;
    const int kbs = k_blocks<C>(p, tile);
    for (int kb = 0; kb < kbs; ++kb) {
      pipeline.producer_acquire(ws);
      if (lane == 0) {
        uint64_t* bar = pipeline.producer_get_barrier(ws);
        T* sa = smem.a + ws.index() * (BM * BK);
        T* sb = smem.b + ws.index() * (BN * BK);
        if constexpr (C::kMode == Mode::M) {
          SM90_TMA_LOAD_2D::copy(&p.tma_a, bar, hint, sa, kb * BK, tile.m0);
          load_b_m<C>(p, tile, kb, bar, sb);
        } else {
          const int r = big() - tile.len + kb * BK, e = tile.start + tile.len;
          CUTE_UNROLL
          for (int j = 0; j < BM / 64; ++j) {
            SM90_TMA_LOAD_4D::copy(&p.tma_a, bar, hint, sa + j * 64 * BK, tile.m0 + 64 * j, r,
                                   big(), e);
          }
          CUTE_UNROLL
          for (int j = 0; j < BN / 64; ++j) {
            SM90_TMA_LOAD_4D::copy(&p.tma_b, bar, hint, sb + j * 64 * BK, tile.n0 + 64 * j, r,
                                   big(), e);
          }
        }
      }
      ++ws;
    }
  }
}

}  // namespace gmm::varlen
