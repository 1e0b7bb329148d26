// The epilogues of the varlen kernels: fp32 accumulators to the output, through a
// 128-byte-swizzled shared-memory staging tile and TMA stores that drain while the next
// mainloop runs. varlen-M rows past the group's end fall outside the ragged map's bound
// and are not written; columns past N and rows past M are outside the maps too. Device
// code (nvcc only).
//
// Conversions go through the CUDA pair intrinsics: cutlass' scalar conversion is inline
// asm that makes ptxas serialise every wgmma of the kernel (warning C7514). Shared-memory
// offsets are explicit and the base opaque: CuTe's swizzled indexing per element made
// ptxas keep every address live across the tile loop and spill. An activation, a per-row
// scale or a second output (the fused epilogues) goes where `pack` converts a pair.
#pragma once
#include "kernels/varlen/scheduler.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cutlass/arch/barrier.h"

namespace gmm::varlen {

// Named barriers (cutlass::arch::NamedBarrier ids, after CUTLASS's reserved ones): the
// consumer warpgroup cwg's own epilogue barrier is kEpilogueBar + cwg; ping-pong's mainloop
// turn of warpgroup cwg is kOrderBar + cwg.
constexpr int kEpilogueBar = 0;
constexpr int kOrderBar = 2;

template <class T>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// One TMA store of a 64 x 64 box: rows tile.m0 + row0 .. + 63 of the tile (relative to
// its first row) and columns tile.n0 + col0 .. + 63, from `src` (64 rows of 128 bytes).
template <Mode kMode>
__device__ __forceinline__ void store_box(const Params& p, const Tile& tile, const void* src,
                                          int row0, int col0) {
  if constexpr (kMode == Mode::M) {
    const int local = tile.m0 - tile.start + row0;
    SM90_TMA_STORE_4D::copy(&p.tma_d, src, tile.n0 + col0, big() - tile.len + local, big(),
                            tile.start + tile.len);
  } else {
    SM90_TMA_STORE_3D::copy(&p.tma_d, src, tile.n0 + col0, tile.m0 + row0, tile.group);
  }
}

// ---------------------------------------------------------------------------------------
// Cooperative: warpgroup cwg (thread ct in 0..255 of both) owns rows 64*cwg .. 64*cwg+63
// of the tile; the staging tile is BN/64 chunks of BM rows x 128 bytes.

// Before the warpgroup rewrites its rows of the staging tile, its previous TMA stores must
// have read them.
__device__ __forceinline__ void coop_wait(int cwg, int ct) {
  if (ct % 128 == 0) tma_store_wait<0>();
  cutlass::arch::NamedBarrier::sync(128, kEpilogueBar + cwg);
}

// Element i of this thread's fragment is at row (warp%4)*16 + lane/4 + 8*v1 of the
// warpgroup's rows and column 8*j + 2*(lane%4) + v0, with i = v0 + 2*v1 + 4*j (the wgmma C
// layout). 16-byte units of a 128-byte row are XOR-ed with row % 8 (== lane/4 here).
template <class T, int BM, class Acc>
__device__ __forceinline__ void coop_stage(const Acc& acc, uint32_t smem_tile, int cwg, int ct) {
  const int lane = ct % 32, wq = (ct % 128) / 32, sw = lane / 4;
  uint32_t base = smem_tile + uint32_t((64 * cwg + wq * 16 + sw) * 128 + (lane % 4) * 4);
  asm volatile("" : "+r"(base));
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const int v1 = (i / 2) % 2, j = i / 4;
    const uint32_t off =
        uint32_t((j / 8) * BM * 128 + 8 * v1 * 128) + uint32_t(((j % 8) ^ sw) << 4);
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + off), "r"(pack<T>(acc(i), acc(i + 1)))
                 : "memory");
  }
}

// The warpgroup's 64 rows of the staging tile to global memory, one TMA store per
// 64-column chunk, left in flight.
template <Mode kMode, int BM, int BN>
__device__ __forceinline__ void coop_store(const Params& p, const Tile& tile, int cwg, int ct,
                                           const unsigned char* smem_tile) {
  cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> the TMA unit
  cutlass::arch::NamedBarrier::sync(128, kEpilogueBar + cwg);
  if (ct % 128 == 0) {
    const unsigned char* rows = smem_tile + 64 * cwg * 128;
    CUTE_UNROLL
    for (int j = 0; j < BN / 64; ++j)
      store_box<kMode>(p, tile, rows + j * BM * 128, 64 * cwg, 64 * j);
    tma_store_arrive();
  }
}

// A tile with no k-blocks (the zero tail, an empty group, K = 0): exact zeros, apart from
// the MMA path, so that only wgmma ever defines the accumulators.
template <Mode kMode, int BM, int BN>
__device__ __forceinline__ void coop_store_zeros(const Params& p, const Tile& tile, int cwg, int ct,
                                                 unsigned char* smem_tile) {
  coop_wait(cwg, ct);
  uint4* z = reinterpret_cast<uint4*>(smem_tile) + 64 * cwg * 8;
  CUTE_UNROLL
  for (int j = 0; j < BN / 64; ++j) {
    CUTE_UNROLL
    for (int i = 0; i < 64 * 8 / 128; ++i)
      z[j * BM * 8 + i * 128 + ct % 128] = make_uint4(0, 0, 0, 0);
  }
  coop_store<kMode, BM, BN>(p, tile, cwg, ct, smem_tile);
}

// ---------------------------------------------------------------------------------------
// Ping-pong: warpgroup cwg (thread lt in 0..127) owns the whole 128 x BN tile and stores it
// in 64-column chunks through its own two chunk buffers (BM rows x 128 bytes each), used in
// turn across tiles: `chunk` counts the warpgroup's chunks, so a buffer is rewritten only
// after the store that read it two chunks ago has completed. The warpgroups never share
// staging memory, so their epilogues need no order between them.

template <class C, bool kZeros, class Acc>
__device__ __forceinline__ void pp_epilogue(const Params& p, const Tile& tile, const Acc& acc,
                                            unsigned char* smem_d, int cwg, int lt, int& chunk) {
  using T = typename C::T;
  constexpr int BM = C::BM, BN = C::BN, kBuf = BM * 128;  // bytes per chunk buffer
  constexpr int kV = BN / 2;                              // fragment elements per 64-row block
  const int lane = lt % 32, wq = lt / 32, sw = lane / 4;
  unsigned char* bufs = smem_d + cwg * 2 * kBuf;
  CUTE_UNROLL
  for (int j = 0; j < BN / 64; ++j, ++chunk) {
    unsigned char* buf = bufs + (chunk & 1) * kBuf;
    if (lt == 0) tma_store_wait<1>();  // the store of two chunks ago has read `buf`
    cutlass::arch::NamedBarrier::sync(128, kEpilogueBar + cwg);
    if constexpr (kZeros) {
      uint4* z = reinterpret_cast<uint4*>(buf);
      CUTE_UNROLL
      for (int i = 0; i < kBuf / 16 / 128; ++i) z[i * 128 + lt] = make_uint4(0, 0, 0, 0);
    } else {
      uint32_t base = cast_smem_ptr_to_uint(buf) + uint32_t((wq * 16 + sw) * 128 + (lane % 4) * 4);
      asm volatile("" : "+r"(base));
      CUTE_UNROLL
      for (int mb = 0; mb < 2; ++mb) {
        CUTE_UNROLL
        for (int jj = 0; jj < 8; ++jj) {
          CUTE_UNROLL
          for (int v1 = 0; v1 < 2; ++v1) {
            const int i = kV * mb + 4 * (8 * j + jj) + 2 * v1;
            const uint32_t off = uint32_t((64 * mb + 8 * v1) * 128) + uint32_t((jj ^ sw) << 4);
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + off),
                         "r"(pack<T>(acc(i), acc(i + 1)))
                         : "memory");
          }
        }
      }
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> the TMA unit
    cutlass::arch::NamedBarrier::sync(128, kEpilogueBar + cwg);
    if (lt == 0) {
      store_box<C::kMode>(p, tile, buf, 0, 64 * j);
      store_box<C::kMode>(p, tile, buf + 64 * 128, 64, 64 * j);
      tma_store_arrive();
    }
  }
}

// ---------------------------------------------------------------------------------------
// The fused epilogues of ping-pong 128 x 128 tiles (args.h: SwiGLU, DGated). Each writes up
// to two 64-column output chunks per stage through the warpgroup's two chunk buffers: a
// stage first waits for all of the warpgroup's earlier stores to have read them (the
// epilogue runs under the other warpgroup's mainloop, which a 128 x 128 x K tile keeps
// busy for several microseconds, so the wait costs the tensor cores nothing). Fragment
// element i = 64 mb + 4 (8 j + jj) + 2 v1 + v0 is at row 64 mb + 16 wq + lane/4 + 8 v1 and
// column 64 j + 8 jj + 2 (lane % 4) + v0 of the tile.

template <class T>
__device__ __forceinline__ float2 unpack(uint32_t v) {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
  } else {
    return __half22float2(*reinterpret_cast<__half2*>(&v));
  }
}

__device__ __forceinline__ float sigmoid(float x) { return __frcp_rn(1.f + __expf(-x)); }

// Every fragment pair (mb, jj, v1) of a 64-column chunk, and every row (mb, v1) of a thread.
template <class F>
__device__ __forceinline__ void each_pair(F&& f) {
  CUTE_UNROLL
  for (int mb = 0; mb < 2; ++mb) {
    CUTE_UNROLL
    for (int jj = 0; jj < 8; ++jj) {
      CUTE_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) f(mb, jj, v1);
    }
  }
}

template <class F>
__device__ __forceinline__ void each_row(F&& f) {
  CUTE_UNROLL
  for (int mb = 0; mb < 2; ++mb) {
    CUTE_UNROLL
    for (int v1 = 0; v1 < 2; ++v1) f(mb, v1);
  }
}

// The tile's 128 rows of one 64-column chunk buffer to `map` (ragged over [m, F]) at `col`.
__device__ __forceinline__ void store_chunk(const CUtensorMap* map, const Tile& tile,
                                            const unsigned char* buf, int col) {
  const int r = big() - tile.len + (tile.m0 - tile.start);
  SM90_TMA_STORE_4D::copy(map, buf, col, r, big(), tile.start + tile.len);
  SM90_TMA_STORE_4D::copy(map, buf + 64 * 128, col, r + 64, big(), tile.start + tile.len);
}

// One stage: `fill(offset_of, slot)` writes the chunk values with st_pair(buffer, mb, jj, v1,
// value); then buffer 0 goes to (map0, col) and, when map1 is set, buffer 1 to (map1, col).
template <class Fill>
__device__ __forceinline__ void fused_stage(const Tile& tile, unsigned char* bufs, int cwg, int lt,
                                            const CUtensorMap* map0, const CUtensorMap* map1,
                                            int col, Fill&& fill) {
  constexpr int kBuf = 128 * 128;
  if (lt == 0) tma_store_wait<0>();
  cutlass::arch::NamedBarrier::sync(128, kEpilogueBar + cwg);
  const int lane = lt % 32, wq = lt / 32, sw = lane / 4;
  uint32_t base = cast_smem_ptr_to_uint(bufs) + uint32_t((wq * 16 + sw) * 128 + (lane % 4) * 4);
  asm volatile("" : "+r"(base));
  auto st = [&](int b, int mb, int jj, int v1, uint32_t v) {
    const uint32_t off = uint32_t(b * kBuf + (64 * mb + 8 * v1) * 128) + uint32_t((jj ^ sw) << 4);
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + off), "r"(v) : "memory");
  };
  fill(st);
  cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> the TMA unit
  cutlass::arch::NamedBarrier::sync(128, kEpilogueBar + cwg);
  if (lt == 0) {
    store_chunk(map0, tile, bufs, col);
    if (map1 != nullptr) store_chunk(map1, tile, bufs + kBuf, col);
    tma_store_arrive();
  }
}

// SwiGLU: the tile is 64 gate columns (j = 0) and the same 64 up columns (j = 1) of the
// product, at column j0 = n0 / 2 of each half. Stage 1 stores both halves of the
// pre-activation, stage 2 act = silu(gate) * up from the fp32 values.
template <class C, bool kZeros, class Acc>
__device__ __forceinline__ void pp_swiglu(const Params& p, const Tile& tile, const Acc& acc,
                                          unsigned char* bufs, int cwg, int lt) {
  using T = typename C::T;
  const int j0 = tile.n0 / 2;
  fused_stage(tile, bufs, cwg, lt, &p.tma_d, &p.tma_d2, j0, [&](auto st) {
    each_pair([&](int mb, int jj, int v1) {
      const int i = 64 * mb + 4 * jj + 2 * v1;
      if constexpr (kZeros) {
        st(0, mb, jj, v1, 0u);
        st(1, mb, jj, v1, 0u);
      } else {
        st(0, mb, jj, v1, pack<T>(acc(i), acc(i + 1)));
        st(1, mb, jj, v1, pack<T>(acc(i + 32), acc(i + 33)));
      }
    });
  });
  fused_stage(tile, bufs, cwg, lt, &p.tma_act, nullptr, j0, [&](auto st) {
    each_pair([&](int mb, int jj, int v1) {
      const int i = 64 * mb + 4 * jj + 2 * v1;
      if constexpr (kZeros) {
        st(0, mb, jj, v1, 0u);
      } else {
        const float a0 = acc(i) * sigmoid(acc(i)) * acc(i + 32);
        const float a1 = acc(i + 1) * sigmoid(acc(i + 1)) * acc(i + 33);
        st(0, mb, jj, v1, pack<T>(a0, a1));
      }
    });
  });
}

// DGated: the tile's 128 columns are p = dY . W^T for columns n0 .. n0 + 127 of F, read with
// the pre-activation (gate g, up u) and the row scale s of each row. Per 64-column chunk:
// one thread loads the chunk's g and u into the warpgroup's two buffers by TMA (rows past
// the group's end read zeros); every thread reads its fragment's pairs there, writes dgate =
// s p u sig (1 + g (1 - sig)) and dup = s p silu(g) in their place (each thread rewrites
// only what it read), keeps act = s silu(g) u in registers and sums p silu(g) u per row
// into partial[chunk, row]; both halves of dpre are stored, then act through buffer 0.
// (Loads by the threads themselves, between the ordered shared-memory stores, made the
// epilogue 4x the mainloop.) Rows past the group's end are another tile's: not written.
// `phase` counts the warpgroup's barrier uses (its parity is the barrier's phase).
template <class C, bool kZeros, class Acc>
__device__ __forceinline__ void pp_dgated(const Params& p, const Tile& tile, const Acc& acc,
                                          unsigned char* bufs, uint64_t* bar, int cwg, int lt,
                                          int& phase) {
  using T = typename C::T;
  constexpr int kBuf = 128 * 128;
  const int lane = lt % 32, wq = lt / 32, sw = lane / 4;
  const int end = tile.start + tile.len, f = p.f;
  int rows[2][2];
  float s[2][2];
  each_row([&](int mb, int v1) {
    const int r = tile.m0 + 64 * mb + 16 * wq + lane / 4 + 8 * v1;
    rows[mb][v1] = r < end ? r : -1;
    s[mb][v1] = (!kZeros && r < end) ? __ldg(p.scale + r) : 0.f;
  });
  uint32_t base = cast_smem_ptr_to_uint(bufs) + uint32_t((wq * 16 + sw) * 128 + (lane % 4) * 4);
  asm volatile("" : "+r"(base));
  CUTE_UNROLL
  for (int j = 0; j < 2; ++j) {
    const int col = tile.n0 + 64 * j;
    if (col >= f) break;  // the whole chunk is past F (the maps would drop it anyway)
    float sum[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
    uint32_t act[2][8][2];
    if (lt == 0) tma_store_wait<0>();  // the buffers' earlier stores have read them
    cutlass::arch::NamedBarrier::sync(128, kEpilogueBar + cwg);
    if constexpr (!kZeros) {
      if (lt == 0) {
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, 2 * kBuf);
        const uint64_t hint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_FIRST);
        const int r = big() - tile.len + (tile.m0 - tile.start);
        SM90_TMA_LOAD_4D::copy(&p.tma_pre, bar, hint, bufs, col, r, big(), end);
        SM90_TMA_LOAD_4D::copy(&p.tma_pre, bar, hint, bufs + 64 * 128, col, r + 64, big(), end);
        SM90_TMA_LOAD_4D::copy(&p.tma_pre2, bar, hint, bufs + kBuf, col, r, big(), end);
        SM90_TMA_LOAD_4D::copy(&p.tma_pre2, bar, hint, bufs + kBuf + 64 * 128, col, r + 64, big(),
                               end);
      }
      cutlass::arch::ClusterBarrier::wait(bar, uint32_t(phase & 1));
      ++phase;
    }
    each_pair([&](int mb, int jj, int v1) {
      const uint32_t off = uint32_t((64 * mb + 8 * v1) * 128) + uint32_t((jj ^ sw) << 4);
      uint32_t dg = 0u, du = 0u, av = 0u;
      if constexpr (!kZeros) {
        uint32_t graw, uraw;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(graw) : "r"(base + off) : "memory");
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(uraw) : "r"(base + kBuf + off) : "memory");
        const int i = 64 * mb + 4 * (8 * j + jj) + 2 * v1;
        const float2 g = unpack<T>(graw), u = unpack<T>(uraw);
        const float sg0 = sigmoid(g.x), sg1 = sigmoid(g.y);
        const float si0 = g.x * sg0, si1 = g.y * sg1;
        const float sc = s[mb][v1], sp0 = sc * acc(i), sp1 = sc * acc(i + 1);
        sum[mb][v1] += acc(i) * si0 * u.x + acc(i + 1) * si1 * u.y;
        dg = pack<T>(sp0 * u.x * sg0 * (1.f + g.x * (1.f - sg0)),
                     sp1 * u.y * sg1 * (1.f + g.y * (1.f - sg1)));
        du = pack<T>(sp0 * si0, sp1 * si1);
        av = pack<T>(sc * si0 * u.x, sc * si1 * u.y);
      }
      act[mb][jj][v1] = av;
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + off), "r"(dg) : "memory");
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + kBuf + off), "r"(du) : "memory");
    });
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> the TMA unit
    cutlass::arch::NamedBarrier::sync(128, kEpilogueBar + cwg);
    if (lt == 0) {
      store_chunk(&p.tma_d, tile, bufs, col);
      store_chunk(&p.tma_d2, tile, bufs + kBuf, col);
      tma_store_arrive();
    }
    // the row sums: the four lanes of a row, then one plain store per (row, chunk)
    each_row([&](int mb, int v1) {
      float v = sum[mb][v1];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      if (lane % 4 == 0 && rows[mb][v1] >= 0) p.partial[int64_t(col / 64) * p.m + rows[mb][v1]] = v;
    });
    fused_stage(tile, bufs, cwg, lt, &p.tma_act, nullptr, col, [&](auto st) {
      each_pair([&](int mb, int jj, int v1) { st(0, mb, jj, v1, act[mb][jj][v1]); });
    });
  }
}

// The epilogue of a ping-pong tile: the plain one or a fused one.
// `chunk` counts the plain epilogue's chunks, or DGated's barrier uses.
template <class C, bool kZeros, class Acc>
__device__ __forceinline__ void pp_store(const Params& p, const Tile& tile, const Acc& acc,
                                         typename C::Smem& smem, int cwg, int lt, int& chunk) {
  unsigned char* smem_d = reinterpret_cast<unsigned char*>(smem.d);
  unsigned char* bufs = smem_d + cwg * 2 * (C::BM * 128);
  if constexpr (C::kEpi == Epilogue::SwiGLU) {
    pp_swiglu<C, kZeros>(p, tile, acc, bufs, cwg, lt);
  } else if constexpr (C::kEpi == Epilogue::DGated) {
    pp_dgated<C, kZeros>(p, tile, acc, bufs, &smem.epi_bar[cwg], cwg, lt, chunk);
  } else {
    pp_epilogue<C, kZeros>(p, tile, acc, smem_d, cwg, lt, chunk);
  }
}

}  // namespace gmm::varlen
