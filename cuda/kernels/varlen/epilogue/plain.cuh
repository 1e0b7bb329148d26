// The plain epilogue (its Args block: plain.h): fp32 accumulators to D as they are, through
// a 128-byte-swizzled shared-memory staging tile and TMA stores that drain while the next
// mainloop runs, in both consumer schedules (the cooperative one is plain only). varlen-M
// rows past the group's end fall outside the ragged map's bound and are not written; columns
// past N and rows past M are outside the maps too. Device code (nvcc only), and its maps.
#pragma once
#include "kernels/varlen/epilogue/common.cuh"
#include "kernels/varlen/epilogue/plain.h"

namespace gmm::varlen {

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

// A tile with no k-blocks (the zero tail, an empty group, K = 0): exact zeros in the
// warpgroup's rows of the staging tile, apart from the MMA path, so that only wgmma ever
// defines the accumulators.
template <int BM, int BN>
__device__ __forceinline__ void coop_zero_rows(unsigned char* smem_tile, int cwg, int ct) {
  uint4* z = reinterpret_cast<uint4*>(smem_tile) + 64 * cwg * 8;
  CUTE_UNROLL
  for (int j = 0; j < BN / 64; ++j) {
    CUTE_UNROLL
    for (int i = 0; i < 64 * 8 / 128; ++i)
      z[j * BM * 8 + i * 128 + ct % 128] = make_uint4(0, 0, 0, 0);
  }
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

// The policy (common.cuh). varlen-K is plain only, its maps are launch.cuh's.
struct PlainEpi : EpilogueBase<PlainArgs> {
  // varlen-M: D [T, N] (ragged).
  template <class C>
  static std::string tensor_maps(typename C::Params& p, const varlen::Args& x,
                                 CUtensorMapDataType dt) {
    return encode_ragged(&p.tma_d, dt, x.d, x.n, x.ldd, 64, 64, "D [T, N] (ragged)");
  }

  // Cooperative (both forms): the warpgroup's 64 rows of the tile through the staging tile
  // (kZeros: a tile with no k-blocks, exact zeros); the previous tile's stores drained
  // while this tile's mainloop ran.
  template <class C, bool kZeros, class Acc>
  __device__ __forceinline__ static void store_coop(const typename C::Params& p, const Tile& tile,
                                                    const Acc& acc, typename C::Smem& smem, int cwg,
                                                    int ct, CoopState&) {
    unsigned char* tile_bytes = reinterpret_cast<unsigned char*>(smem.d);
    coop_wait(cwg, ct);
    if constexpr (kZeros) {
      coop_zero_rows<C::BM, C::BN>(tile_bytes, cwg, ct);
    } else {
      coop_stage<typename C::T, C::BM>(acc, cast_smem_ptr_to_uint(smem.d), cwg, ct);
    }
    coop_store<C::kMode, C::BM, C::BN>(p, tile, cwg, ct, tile_bytes);
  }

  // `chunk` counts the warpgroup's chunks (pp_epilogue).
  template <class C, bool kZeros, class Acc>
  __device__ __forceinline__ static void store(const typename C::Params& p, const Tile& tile,
                                               const Acc& acc, typename C::Smem& smem, int cwg,
                                               int lt, int& chunk) {
    pp_epilogue<C, kZeros>(p, tile, acc, reinterpret_cast<unsigned char*>(smem.d), cwg, lt, chunk);
  }
};

}  // namespace gmm::varlen
