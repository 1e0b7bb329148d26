// The producers of the varlen kernels: the loads of A and B tiles into the ring of
// shared-memory stages, by TMA (one thread), or one operand's rows gathered through an
// index by the whole producer warpgroup with cp.async. Device code (nvcc only).
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
// An epilogue that reads B its own way (kLoadsB: SwiGLU's halves) loads it itself.
template <class C>
__device__ __forceinline__ void load_b_m(const typename C::Params& p, const Tile& tile, int kb,
                                         uint64_t* bar, typename C::T* sb) {
  if constexpr (C::Epi::kLoadsB) {
    C::Epi::template load_b<C>(p, tile, kb, bar, sb);
  } else {
    const uint64_t hint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
    if constexpr (C::kBKMajor) {
      SM90_TMA_LOAD_3D::copy(&p.tma_b, bar, hint, sb, kb * C::BK, tile.n0, tile.group);
    } else {
      CUTE_UNROLL
      for (int j = 0; j < C::BN / 64; ++j) {
        SM90_TMA_LOAD_3D::copy(&p.tma_b, bar, hint, sb + j * 64 * C::BK, tile.n0 + 64 * j,
                               kb * C::BK, tile.group);
      }
    }
  }
}

// One 16-byte cp.async into shared address `dst` from `src`, or 16 zero bytes without
// reading `src` when `skip` (the ignore-src operand). A gathered operand's width is a whole
// number of 16-byte units (can_read), so a unit is either copied whole or not at all. No
// "memory" clobber: the producer makes no other shared-memory access the compiler could
// reorder, and without it the address arithmetic of all of a stage's copies is scheduled
// together (with it, every copy reloaded the kernel parameters and waited for its own
// address: the producer's instruction latency bounded the kernel).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool skip) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n"
      " cp.async.cg.shared.global [%0], [%1], 16, p;\n}\n" ::"r"(dst),
      "l"(src), "r"(int(skip)));
}

// Gathered A (varlen-M): the whole producer warpgroup (thread pt of 128) loads the A tile
// row by row with cp.async into the layout the TMA would have written (128-byte rows, 16-byte
// units XOR-ed with row % 8): thread pt owns unit pt % 8 of rows pt / 8 + 16 i. Each thread's
// cp.async completions arrive on the stage's full barrier (noinc: the barrier counts 1 + 128
// arrivals); thread 0 adds the B tile by TMA. Rows past the group's end, rows whose index is
// out of [0, gathered_rows) and columns past K are zero-filled without reading memory; an index out
// of range also sets the deferred error flag to kErrIndex (reported at the next call). The
// indices are loaded a tile ahead of their use (at the start of a tile, waiting for them left
// the ring to drain); each row's source address is computed once per tile and a k-block adds
// its column offset.
template <class C, class Pipeline, class Sched>
__device__ __forceinline__ void produce_gathered(const typename C::Params& p, Pipeline& pipeline,
                                                 Sched& sched, typename C::Smem& smem, int pt) {
  using T = typename C::T;
  constexpr int BM = C::BM, BK = C::BK, kRows = BM / 16;
  static_assert(BK * int(sizeof(T)) == 128, "one 128-byte swizzle row per A row and k-block");
  const int unit = pt % 8, r0 = pt / 8;
  const uint32_t off = uint32_t(r0 * 128 + ((unit ^ (r0 % 8)) << 4));
  const char* const abase = static_cast<const char*>(p.gathered);
  const int64_t row_bytes = p.gathered_ld * int64_t(sizeof(T));
  const int* const src = p.src;
  const int k = p.k, gathered_rows = p.gathered_rows;
  const uint32_t ring = cast_smem_ptr_to_uint(smem.a);
  auto ws = cutlass::make_producer_start_state<Pipeline>();
  // The source rows of the thread's rows of a tile (anything past the group's end or for
  // the zero tail, which has no k-blocks), loaded a tile ahead of their use.
  auto indices = [&](const Tile& tl, int (&v)[kRows]) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int r = tl.m0 + r0 + 16 * i;
      const bool in = tl.valid && tl.group < p.groups && r < tl.start + tl.len;
      v[i] = in ? __ldg(src + r) : 0;
    }
  };
  int t = blockIdx.x;
  Tile tile = sched.get(t);
  int cur[kRows];
  indices(tile, cur);
  while (tile.valid) {
    t += gridDim.x;
    const Tile next = sched.get(t);
    const int end = tile.start + tile.len;
    // the source of unit `unit` of each of the thread's rows at column 0 (row 0's for a row
    // that reads zeros: never read)
    const char* row[kRows];
    bool ok[kRows];
    bool bad = false;
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const bool in = tile.m0 + r0 + 16 * i < end;
      ok[i] = in && cur[i] >= 0 && cur[i] < gathered_rows;
      bad |= in && !ok[i];
      row[i] = abase + (ok[i] ? cur[i] : 0) * row_bytes + unit * 16;
    }
    if (bad && p.err_flag != nullptr) *reinterpret_cast<volatile int*>(p.err_flag) = kErrIndex;
    int nxt[kRows];
    indices(next, nxt);
    const int kbs = tile.group < p.groups ? (k + BK - 1) / BK : 0;  // the zero tail: none
    for (int kb = 0; kb < kbs; ++kb) {
      pipeline.producer_acquire(ws);
      uint64_t* bar = pipeline.producer_get_barrier(ws);
      const uint32_t sa = ring + uint32_t(ws.index() * (BM * BK * int(sizeof(T)))) + off;
      const bool past_k = kb * BK + unit * 8 >= k;  // the unit is past K: zeros
      CUTE_UNROLL
      for (int i = 0; i < kRows; ++i) {
        cp_async_16(sa + uint32_t(i * 16 * 128), row[i] + kb * 128, past_k || !ok[i]);
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(bar);
      if (pt == 0) load_b_m<C>(p, tile, kb, bar, smem.b + ws.index() * (C::BN * BK));
      ++ws;
    }
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) cur[i] = nxt[i];
    tile = next;
  }
}

// The ragged TMA boxes of a varlen-K operand's k-block kb (tokens kb * BK .. of the tile's
// group; the map cuts every token past the group's end): `chunks` 64-column boxes from
// column c0 into the stage's tile s.
template <class C>
__device__ __forceinline__ void load_k_boxes(const CUtensorMap* map, const Tile& tile, int kb,
                                             uint64_t* bar, typename C::T* s, int c0, int chunks) {
  const uint64_t hint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
  const int r = big() - tile.len + kb * C::BK, e = tile.start + tile.len;
  for (int j = 0; j < chunks; ++j) {
    SM90_TMA_LOAD_4D::copy(map, bar, hint, s + j * 64 * C::BK, c0 + 64 * j, r, big(), e);
  }
}

// Gathered varlen-K (the weight gradients of x[src] or dY[src]): the whole producer
// warpgroup loads the gathered operand's k-block token by token with cp.async into the
// layout its ragged TMA boxes would have written (per 64-column chunk, BK token rows of 128
// bytes, 16-byte units XOR-ed with token % 8): thread pt owns unit pt % 8 of tokens
// pt / 8 + 16 i of every chunk. Tokens past the group's end, indices out of [0, gathered_rows)
// and columns past the operand's width are zero-filled without reading memory (an index out
// of range also sets the deferred error flag). The indices are read a stage ahead of their
// use (a load per k-block waited for at once stalled the producer on its latency every
// stage: 0.36x the TMA kernel on pre-gathered rows, H200). Thread 0 loads the other operand
// by TMA.
template <class C, class Pipeline, class Sched>
__device__ __forceinline__ void produce_gathered_k(const Params& p, Pipeline& pipeline,
                                                   Sched& sched, typename C::Smem& smem, int pt) {
  using T = typename C::T;
  constexpr bool kA = C::kGatherOp == Gather::A;
  constexpr int BM = C::BM, BN = C::BN, BK = C::BK;
  constexpr int kChunks = (kA ? BM : BN) / 64, kTok = BK / 16;
  static_assert(64 * int(sizeof(T)) == 128, "one 128-byte swizzle row per token and chunk");
  const int unit = pt % 8, r0 = pt / 8;
  const uint32_t off = uint32_t(r0 * 128 + ((unit ^ (r0 % 8)) << 4));
  const char* const base = static_cast<const char*>(p.gathered);
  const int64_t row_bytes = p.gathered_ld * int64_t(sizeof(T));
  const int* const src = p.src;
  const int gathered_rows = p.gathered_rows;
  const int cols = kA ? p.m : p.n;  // the gathered operand's width
  const uint32_t ring = cast_smem_ptr_to_uint(kA ? smem.a : smem.b);
  constexpr uint32_t kStageBytes = uint32_t((kA ? BM : BN) * BK * int(sizeof(T)));
  auto ws = cutlass::make_producer_start_state<Pipeline>();
  bool bad = false;  // an index out of range was met
  for (int t = blockIdx.x;; t += gridDim.x) {
    const Tile tile = sched.get(t);
    if (!tile.valid) break;
    const int kbs = k_blocks<C>(p, tile);
    if (kbs == 0) continue;  // an empty group: the consumers store zeros
    const int c0 = (kA ? tile.m0 : tile.n0) + unit * 8;
    bool past[kChunks];  // the thread's unit of chunk j is past the operand's width: zeros
    CUTE_UNROLL
    for (int j = 0; j < kChunks; ++j) past[j] = c0 + 64 * j >= cols;
    const int64_t col_off = int64_t(c0) * int64_t(sizeof(T));
    // The index of token r0 + 16 i of k-block kb (-1 past the group's end).
    auto indices = [&](int kb, int (&v)[kTok]) {
      CUTE_UNROLL
      for (int i = 0; i < kTok; ++i) {
        const int tok = kb * BK + r0 + 16 * i;
        v[i] = tok < tile.len ? __ldg(src + tile.start + tok) : -1;
      }
    };
    // k-block kb from the indices `cur`, after starting the loads of k-block kb + 1's into
    // `nxt`: they are used (checked) only a stage later, so their latency is hidden. (A
    // register copy of a pending load would wait for it: two buffers in a loop unrolled by
    // two, no copies.)
    auto stage = [&](int kb, const int (&cur)[kTok], int (&nxt)[kTok]) {
      if (kb + 1 < kbs) indices(kb + 1, nxt);
      // the source of the thread's unit of each token (row 0's for a token that reads
      // zeros: never read)
      const char* row[kTok];
      bool ok[kTok];
      CUTE_UNROLL
      for (int i = 0; i < kTok; ++i) {
        const bool in = kb * BK + r0 + 16 * i < tile.len;
        ok[i] = cur[i] >= 0 && cur[i] < gathered_rows;
        bad |= in && !ok[i];
        row[i] = base + (ok[i] ? cur[i] : 0) * row_bytes + col_off;
      }
      pipeline.producer_acquire(ws);
      uint64_t* bar = pipeline.producer_get_barrier(ws);
      const uint32_t sg = ring + ws.index() * kStageBytes + off;
      CUTE_UNROLL
      for (int i = 0; i < kTok; ++i) {
        CUTE_UNROLL
        for (int j = 0; j < kChunks; ++j) {
          cp_async_16(sg + uint32_t(j * 64 * BK * int(sizeof(T)) + i * 16 * 128), row[i] + 128 * j,
                      past[j] || !ok[i]);
        }
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(bar);
      if (pt == 0) {
        T* sa = smem.a + ws.index() * (BM * BK);
        T* sb = smem.b + ws.index() * (BN * BK);
        if constexpr (kA) {
          load_k_boxes<C>(&p.tma_b, tile, kb, bar, sb, tile.n0, BN / 64);
        } else {
          load_k_boxes<C>(&p.tma_a, tile, kb, bar, sa, tile.m0, BM / 64);
        }
      }
      ++ws;
    };
    int ia[kTok], ib[kTok];
    indices(0, ia);
    for (int kb = 0; kb < kbs; kb += 2) {
      stage(kb, ia, ib);
      if (kb + 1 < kbs) stage(kb + 1, ib, ia);
    }
  }
  if (bad && p.err_flag != nullptr) *reinterpret_cast<volatile int*>(p.err_flag) = kErrIndex;
}

// The TMA producer (one warp; lane 0 issues): every k-block of every tile of this CTA into
// the ring, in the order the consumers read it.
template <class C, class Pipeline, class Sched>
__device__ __forceinline__ void produce_tma(const typename C::Params& p, Pipeline& pipeline,
                                            Sched& sched, typename C::Smem& smem, int lane) {
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
          load_k_boxes<C>(&p.tma_a, tile, kb, bar, sa, tile.m0, BM / 64);
          load_k_boxes<C>(&p.tma_b, tile, kb, bar, sb, tile.n0, BN / 64);
        }
      }
      ++ws;
    }
  }
}

}  // namespace gmm::varlen
