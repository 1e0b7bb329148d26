// The DGated epilogue (its Args block and meaning: dgated.h): the backward of the routed
// expert block's down projection. The tile's columns are p = dY . W^T for columns n0 .. of
// F; with the pre-activation (gate g, up u) and the row scale s of each row it stores dpre =
// [dgate | dup] (p itself is never stored), act = s silu(g) u and the per-64-column row sums
// of p silu(g) u. Two configurations: ping-pong 128 x 128 (store: the epilogue runs under the
// other warpgroup's mainloop) and, on rows gathered through src, cooperative 128 x 256
// (store_coop: half the gathered A bytes per FLOP). Device code (nvcc only), and its maps.
#pragma once
#include "kernels/varlen/epilogue/common.cuh"
#include "kernels/varlen/epilogue/dgated.h"

namespace gmm::varlen {

template <class T>
__device__ __forceinline__ float2 unpack(uint32_t v) {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
  } else {
    return __half22float2(*reinterpret_cast<__half2*>(&v));
  }
}

// Every row (mb, v1) of a thread's fragment.
template <class F>
__device__ __forceinline__ void each_row(F&& f) {
  CUTE_UNROLL
  for (int mb = 0; mb < 2; ++mb) {
    CUTE_UNROLL
    for (int v1 = 0; v1 < 2; ++v1) f(mb, v1);
  }
}

struct DgatedEpi : FusedEpilogue<DgatedArgs> {
  static constexpr bool fits(Mode mode, Schedule s, int bn) {
    return FusedEpilogue<DgatedArgs>::fits(mode, s, bn) ||
           (mode == Mode::M && s == Schedule::Cooperative && bn == 256);
  }

  // With tma_d dpre's gate half (F columns).
  struct Params {
    CUtensorMap tma_d2;             // dpre's up half
    CUtensorMap tma_act;            // act [m, F] (ragged, like tma_d)
    CUtensorMap tma_pre, tma_pre2;  // pre's gate and up halves (ragged, F columns)
    const float* scale;             // [m]
    float* partial;                 // [ceil(F / 64), m]
    int f;                          // F
  };

  // Per consumer warpgroup, the barrier its TMA loads of pre's chunks arrive on.
  struct Smem {
    alignas(8) uint64_t bar[2];
  };
  template <class C>
  __device__ __forceinline__ static void init(Smem& s) {
    if (threadIdx.x == 0) {
      cutlass::arch::ClusterBarrier::init(&s.bar[0], 1);
      cutlass::arch::ClusterBarrier::init(&s.bar[1], 1);
    }
    cutlass::arch::fence_barrier_init();
  }

  // dpre's halves, act, pre's halves.
  template <class C>
  static std::string tensor_maps(typename C::Params& p, const varlen::Args& x,
                                 CUtensorMapDataType dt) {
    constexpr uint64_t es = sizeof(typename C::T);
    const auto& e = Args::from(x.epi);
    const int f = x.n;
    p.epi.f = f;
    p.epi.scale = e.scale;
    p.epi.partial = e.partial;
    std::string err =
        encode_halves(&p.tma_d, &p.epi.tma_d2, &p.epi.tma_act, dt, x.d, x.ldd, e.act, f, es);
    const char* pre = static_cast<const char*>(e.pre);
    if (err.empty()) err = encode_ragged(&p.epi.tma_pre, dt, pre, f, 2 * f, 64, 64, "pre gate");
    if (err.empty())
      err = encode_ragged(&p.epi.tma_pre2, dt, pre + f * es, f, 2 * f, 64, 64, "pre up");
    return err;
  }

  // ---------------------------------------------------------------------------------------
  // Cooperative 128 x 256: a staging tile of two 64-column chunk buffers (gate, up; the ring
  // keeps 4 stages of 48 KB). Warpgroup cwg owns rows 64 cwg .. + 63 of each buffer and walks
  // the tile's 64-column chunks on its own: thread 0 loads the chunk's g and u rows there by
  // TMA (chunk 0 before the tile's mainloop, prefetch_coop), every thread reads its
  // fragment's pairs and writes dgate and dup in their place, both are stored, then act
  // through the gate buffer once those stores have read it, and the next chunk loads once
  // act's store has. Fragment element i = 4 j + 2 v1 + v0 of the warpgroup's 64 x 256 tile
  // is at row 16 wq + lane / 4 + 8 v1 and column 8 j + 2 (lane % 4) + v0.
  static constexpr int coop_chunks(int) { return 2; }

  struct CoopState {
    int phase;   // this warpgroup's waits on its barrier so far (parity: the phase)
    float s[2];  // the scales of the thread's two rows of the current tile
  };

  // Thread 0 of warpgroup cwg: the previous stores from its rows of the buffers have read
  // them; chunk c's g and u rows of the warpgroup go there.
  template <class C>
  __device__ __forceinline__ static void coop_load(const typename C::Params& p, const Tile& tile,
                                                   typename C::Smem& smem, int cwg, int c) {
    constexpr int kChunk = C::BM * 128;
    unsigned char* bufs = reinterpret_cast<unsigned char*>(smem.d) + 64 * cwg * 128;
    uint64_t* bar = &smem.epi.bar[cwg];
    tma_store_wait<0>();
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, 2 * 64 * 128);
    const uint64_t hint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_FIRST);
    const int r = big() - tile.len + (tile.m0 - tile.start) + 64 * cwg;
    const int col = tile.n0 + 64 * c, end = tile.start + tile.len;
    SM90_TMA_LOAD_4D::copy(&p.epi.tma_pre, bar, hint, bufs, col, r, big(), end);
    SM90_TMA_LOAD_4D::copy(&p.epi.tma_pre2, bar, hint, bufs + kChunk, col, r, big(), end);
  }

  template <class C, class S>
  __device__ __forceinline__ static void prefetch_coop(const typename C::Params& p,
                                                       const Tile& tile, typename C::Smem& smem,
                                                       int cwg, int ct, S& st) {
    if (ct % 128 == 0) coop_load<C>(p, tile, smem, cwg, 0);
    const int lane = ct % 32, wq = (ct % 128) / 32, end = tile.start + tile.len;
    CUTE_UNROLL
    for (int v1 = 0; v1 < 2; ++v1) {
      const int r = tile.m0 + 64 * cwg + 16 * wq + lane / 4 + 8 * v1;
      st.s[v1] = r < end ? __ldg(p.epi.scale + r) : 0.f;
    }
  }

  template <class C, bool kZeros, class Acc, class S>
  __device__ __forceinline__ static void store_coop(const typename C::Params& p, const Tile& tile,
                                                    const Acc& acc, typename C::Smem& smem, int cwg,
                                                    int ct, S& st) {
    using T = typename C::T;
    static_assert(C::BN == 256 && !C::kPingPong, "store_coop: cooperative 128 x 256");
    constexpr int kChunk = C::BM * 128;
    unsigned char* bufs = reinterpret_cast<unsigned char*>(smem.d);
    const int lane = ct % 32, wq = (ct % 128) / 32, sw = lane / 4;
    const int end = tile.start + tile.len, f = p.epi.f;
    uint32_t base =
        cast_smem_ptr_to_uint(smem.d) + uint32_t((64 * cwg + wq * 16 + sw) * 128 + (lane % 4) * 4);
    asm volatile("" : "+r"(base));
    int rows[2];
    CUTE_UNROLL
    for (int v1 = 0; v1 < 2; ++v1) {
      const int r = tile.m0 + 64 * cwg + 16 * wq + lane / 4 + 8 * v1;
      rows[v1] = r < end ? r : -1;
    }
    const int left = (f - tile.n0 + 63) / 64, n = left < 4 ? left : 4;
    CUTE_UNROLL
    for (int c = 0; c < 4; ++c) {
      if (c >= n) break;
      const int col = tile.n0 + 64 * c;
      uint32_t act[8][2];
      float sum[2] = {0.f, 0.f};
      if constexpr (kZeros) {
        if (ct % 128 == 0) tma_store_wait<0>();  // the previous chunk's stores have read
        cutlass::arch::NamedBarrier::sync(128, kEpilogueBar + cwg);
      } else {
        cutlass::arch::ClusterBarrier::wait(&smem.epi.bar[cwg], uint32_t(st.phase & 1));
        ++st.phase;
      }
      CUTE_UNROLL
      for (int jj = 0; jj < 8; ++jj) {
        CUTE_UNROLL
        for (int v1 = 0; v1 < 2; ++v1) {
          const uint32_t off = uint32_t(8 * v1 * 128) + uint32_t((jj ^ sw) << 4);
          uint32_t dg = 0u, du = 0u, av = 0u;
          if constexpr (!kZeros) {
            uint32_t graw, uraw;
            asm volatile("ld.shared.b32 %0, [%1];" : "=r"(graw) : "r"(base + off) : "memory");
            asm volatile("ld.shared.b32 %0, [%1];"
                         : "=r"(uraw)
                         : "r"(base + kChunk + off)
                         : "memory");
            const int i = 4 * (8 * c + jj) + 2 * v1;
            const float2 g = unpack<T>(graw), u = unpack<T>(uraw);
            const float sg0 = sigmoid(g.x), sg1 = sigmoid(g.y);
            const float si0 = g.x * sg0, si1 = g.y * sg1;
            const float sc = st.s[v1], sp0 = sc * acc(i), sp1 = sc * acc(i + 1);
            sum[v1] += acc(i) * si0 * u.x + acc(i + 1) * si1 * u.y;
            dg = pack<T>(sp0 * u.x * sg0 * (1.f + g.x * (1.f - sg0)),
                         sp1 * u.y * sg1 * (1.f + g.y * (1.f - sg1)));
            du = pack<T>(sp0 * si0, sp1 * si1);
            av = pack<T>(sc * si0 * u.x, sc * si1 * u.y);
          }
          act[jj][v1] = av;
          asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + off), "r"(dg) : "memory");
          asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + kChunk + off), "r"(du) : "memory");
        }
      }
      cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> the TMA unit
      cutlass::arch::NamedBarrier::sync(128, kEpilogueBar + cwg);
      if (ct % 128 == 0) {
        store_rows(&p.tma_d, tile, bufs + 64 * cwg * 128, 64 * cwg, col);
        store_rows(&p.epi.tma_d2, tile, bufs + kChunk + 64 * cwg * 128, 64 * cwg, col);
        tma_store_arrive();
      }
      // the row sums: the four lanes of a row, then one plain store per (row, chunk)
      CUTE_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        float v = sum[v1];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (lane % 4 == 0 && rows[v1] >= 0) p.epi.partial[int64_t(col / 64) * p.m + rows[v1]] = v;
      }
      // act through the gate buffer, once dgate's store has read it
      if (ct % 128 == 0) tma_store_wait<0>();
      cutlass::arch::NamedBarrier::sync(128, kEpilogueBar + cwg);
      CUTE_UNROLL
      for (int jj = 0; jj < 8; ++jj) {
        CUTE_UNROLL
        for (int v1 = 0; v1 < 2; ++v1) {
          const uint32_t off = uint32_t(8 * v1 * 128) + uint32_t((jj ^ sw) << 4);
          asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + off), "r"(act[jj][v1]) : "memory");
        }
      }
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(128, kEpilogueBar + cwg);
      if (ct % 128 == 0) {
        store_rows(&p.epi.tma_act, tile, bufs + 64 * cwg * 128, 64 * cwg, col);
        tma_store_arrive();
        if (!kZeros && c + 1 < n) coop_load<C>(p, tile, smem, cwg, c + 1);
      }
    }
  }

  // Per 64-column chunk: one thread loads the chunk's g and u into the warpgroup's two
  // buffers by TMA (rows past the group's end read zeros); every thread reads its fragment's
  // pairs there, writes dgate = s p u sig (1 + g (1 - sig)) and dup = s p silu(g) in their
  // place (each thread rewrites only what it read), keeps act = s silu(g) u in registers and
  // sums p silu(g) u per row into partial[chunk, row]; both halves of dpre are stored, then
  // act through buffer 0. (Loads by the threads themselves, between the ordered
  // shared-memory stores, made the epilogue 4x the mainloop.) Rows past the group's end are
  // another tile's: not written. `phase` counts the warpgroup's barrier uses (its parity is
  // the barrier's phase).
  template <class C, bool kZeros, class Acc>
  __device__ __forceinline__ static void store(const typename C::Params& p, const Tile& tile,
                                               const Acc& acc, typename C::Smem& smem, int cwg,
                                               int lt, int& phase) {
    using T = typename C::T;
    constexpr int kBuf = 128 * 128;
    unsigned char* bufs = chunk_buffers<C>(smem, cwg);
    uint64_t* bar = &smem.epi.bar[cwg];
    const int lane = lt % 32, wq = lt / 32, sw = lane / 4;
    const int end = tile.start + tile.len, f = p.epi.f;
    int rows[2][2];
    float s[2][2];
    each_row([&](int mb, int v1) {
      const int r = tile.m0 + 64 * mb + 16 * wq + lane / 4 + 8 * v1;
      rows[mb][v1] = r < end ? r : -1;
      s[mb][v1] = (!kZeros && r < end) ? __ldg(p.epi.scale + r) : 0.f;
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
          SM90_TMA_LOAD_4D::copy(&p.epi.tma_pre, bar, hint, bufs, col, r, big(), end);
          SM90_TMA_LOAD_4D::copy(&p.epi.tma_pre, bar, hint, bufs + 64 * 128, col, r + 64, big(),
                                 end);
          SM90_TMA_LOAD_4D::copy(&p.epi.tma_pre2, bar, hint, bufs + kBuf, col, r, big(), end);
          SM90_TMA_LOAD_4D::copy(&p.epi.tma_pre2, bar, hint, bufs + kBuf + 64 * 128, col, r + 64,
                                 big(), end);
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
        store_chunk(&p.epi.tma_d2, tile, bufs + kBuf, col);
        tma_store_arrive();
      }
      // the row sums: the four lanes of a row, then one plain store per (row, chunk)
      each_row([&](int mb, int v1) {
        float v = sum[mb][v1];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (lane % 4 == 0 && rows[mb][v1] >= 0)
          p.epi.partial[int64_t(col / 64) * p.m + rows[mb][v1]] = v;
      });
      fused_stage(tile, bufs, cwg, lt, &p.epi.tma_act, nullptr, col, [&](auto st) {
        each_pair([&](int mb, int jj, int v1) { st(0, mb, jj, v1, act[mb][jj][v1]); });
      });
    }
  }
};

}  // namespace gmm::varlen
