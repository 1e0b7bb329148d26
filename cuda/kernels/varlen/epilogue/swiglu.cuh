// The SwiGLU epilogue (its Args block and meaning: swiglu.h): the routed expert block's up
// projection stores the pre-activation pre = [gate | up] and act = silu(gate) * up from the
// fp32 accumulators. A tile of BN columns is BN / 2 gate columns and the same BN / 2 up
// columns of the product: B is read as two halves (tma_b, tma_b2), of one tensor or of two
// (SwigluArgs::up: the gate's and the up projection's weights kept apart). Two configurations:
// ping-pong 128 x 128 (store) and cooperative 128 x 256 (store_coop: half the A bytes per
// FLOP, what a gathered A needs). Device code (nvcc only), and its maps.
#pragma once
#include "kernels/varlen/epilogue/common.cuh"
#include "kernels/varlen/epilogue/swiglu.h"

namespace gmm::varlen {

struct SwigluEpi : FusedEpilogue<SwigluArgs> {
  static constexpr bool fits(Mode mode, Schedule s, int bn) {
    return FusedEpilogue<SwigluArgs>::fits(mode, s, bn) ||
           (mode == Mode::M && s == Schedule::Cooperative && bn == 256);
  }

  // With tma_b B's gate half and tma_d, tma_d2 the two halves of pre (F columns each).
  struct Params {
    CUtensorMap tma_b2;   // B's up half
    CUtensorMap tma_d2;   // pre's up half
    CUtensorMap tma_act;  // act [m, F] (ragged, like tma_d)
  };

  // B's gate and up halves, F columns each, read 64 columns at a time; pre's halves, act.
  static constexpr bool kLoadsB = true;
  template <class C>
  static std::string tensor_maps(typename C::Params& p, const varlen::Args& x,
                                 CUtensorMapDataType dt) {
    constexpr uint64_t es = sizeof(typename C::T);
    const int64_t f = x.n / 2;
    const uint64_t sb[2] = {uint64_t(x.ldb) * es, uint64_t(x.ldb_batch) * es};
    const auto& e = Args::from(x.epi);
    const char* b = static_cast<const char*>(x.b);
    const char* up = e.up != nullptr ? static_cast<const char*>(e.up)
                                     : b + (C::kBKMajor ? f * x.ldb : f) * int64_t(es);
    std::string err;
    if constexpr (C::kBKMajor) {
      const uint64_t db[3] = {extent(x.k), extent(f), extent(x.groups)};
      const uint32_t bb[3] = {C::BK, 64, 1};
      err = encode(&p.tma_b, dt, 3, b, db, sb, bb, "B gate half [G, F, K] (K-major)");
      if (err.empty()) err = encode(&p.epi.tma_b2, dt, 3, up, db, sb, bb, "B up half (K-major)");
    } else {
      const uint64_t db[3] = {extent(f), extent(x.k), extent(x.groups)};
      const uint32_t bb[3] = {64, C::BK, 1};
      err = encode(&p.tma_b, dt, 3, b, db, sb, bb, "B gate half [G, K, F] (N-major)");
      if (err.empty()) err = encode(&p.epi.tma_b2, dt, 3, up, db, sb, bb, "B up half (N-major)");
    }
    if (err.empty()) {
      err =
          encode_halves(&p.tma_d, &p.epi.tma_d2, &p.epi.tma_act, dt, x.d, x.ldd, e.act, int(f), es);
    }
    return err;
  }

  // k-block kb's B tile: the tile's BN / 2 gate columns, then the same columns of the up
  // half, in 64 x BK boxes that land where a BN-column tile's would (either major).
  template <class C>
  __device__ __forceinline__ static void load_b(const typename C::Params& p, const Tile& tile,
                                                int kb, uint64_t* bar, typename C::T* sb) {
    const uint64_t hint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
    constexpr int kBoxes = C::BN / 128;  // per half
    const int j0 = tile.n0 / 2;
    CUTE_UNROLL
    for (int h = 0; h < kBoxes; ++h) {
      typename C::T* gate = sb + h * 64 * C::BK;
      typename C::T* up = sb + (kBoxes + h) * 64 * C::BK;
      if constexpr (C::kBKMajor) {
        SM90_TMA_LOAD_3D::copy(&p.tma_b, bar, hint, gate, kb * C::BK, j0 + 64 * h, tile.group);
        SM90_TMA_LOAD_3D::copy(&p.epi.tma_b2, bar, hint, up, kb * C::BK, j0 + 64 * h, tile.group);
      } else {
        SM90_TMA_LOAD_3D::copy(&p.tma_b, bar, hint, gate, j0 + 64 * h, kb * C::BK, tile.group);
        SM90_TMA_LOAD_3D::copy(&p.epi.tma_b2, bar, hint, up, j0 + 64 * h, kb * C::BK, tile.group);
      }
    }
  }

  // Cooperative 128 x 256: a staging tile of two 64-column chunk buffers (the ring keeps a
  // fourth stage: Cfg), used in turn by the tile's six output chunks, pre's two gate and two
  // up chunks, then act's two. Warpgroup cwg holds rows 64 cwg .. + 63 of 128 gate columns
  // (fragment element i = 4 j + 2 v1 + v0, column 8 j + 2 (lane % 4) + v0) and of the same
  // 128 up columns (element i + 64), and writes its rows of each chunk once the store of
  // two chunks before has read the buffer.
  static constexpr int coop_chunks(int) { return 2; }

  template <class C, bool kZeros, class Acc>
  __device__ __forceinline__ static void store_coop(const typename C::Params& p, const Tile& tile,
                                                    const Acc& acc, typename C::Smem& smem, int cwg,
                                                    int ct, CoopState&) {
    using T = typename C::T;
    static_assert(C::BN == 256 && !C::kPingPong, "store_coop: cooperative 128 x 256");
    constexpr int kChunk = C::BM * 128;  // bytes of a chunk buffer (BM rows of 128 bytes)
    unsigned char* bufs = reinterpret_cast<unsigned char*>(smem.d);
    const int lane = ct % 32, wq = (ct % 128) / 32, sw = lane / 4;
    uint32_t base =
        cast_smem_ptr_to_uint(smem.d) + uint32_t((64 * cwg + wq * 16 + sw) * 128 + (lane % 4) * 4);
    asm volatile("" : "+r"(base));
    const int j0 = tile.n0 / 2;
    CUTE_UNROLL
    for (int c = 0; c < 6; ++c) {
      const uint32_t buf = uint32_t((c % 2) * kChunk);
      if (ct % 128 == 0) tma_store_wait<1>();  // the store of two chunks ago has read it
      cutlass::arch::NamedBarrier::sync(128, kEpilogueBar + cwg);
      CUTE_UNROLL
      for (int jj = 0; jj < 8; ++jj) {
        CUTE_UNROLL
        for (int v1 = 0; v1 < 2; ++v1) {
          uint32_t v = 0u;
          if constexpr (!kZeros) {
            const int i = 4 * (8 * (c % 4) + jj) + 2 * v1;  // pre; act: gate i, up i + 64
            if (c < 4) {
              v = pack<T>(acc(i), acc(i + 1));
            } else {
              v = pack<T>(acc(i) * sigmoid(acc(i)) * acc(i + 64),
                          acc(i + 1) * sigmoid(acc(i + 1)) * acc(i + 65));
            }
          }
          const uint32_t off = buf + uint32_t(8 * v1 * 128) + uint32_t((jj ^ sw) << 4);
          asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + off), "r"(v) : "memory");
        }
      }
      cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> the TMA unit
      cutlass::arch::NamedBarrier::sync(128, kEpilogueBar + cwg);
      if (ct % 128 == 0) {
        const CUtensorMap* map = c < 2 ? &p.tma_d : c < 4 ? &p.epi.tma_d2 : &p.epi.tma_act;
        store_rows(map, tile, bufs + buf + 64 * cwg * 128, 64 * cwg, j0 + 64 * (c % 2));
        tma_store_arrive();
      }
    }
  }

  // Ping-pong 128 x 128: the tile's columns go to column j0 = n0 / 2 of each half. Stage 1 stores
  // both halves of the pre-activation, stage 2 act = silu(gate) * up from the fp32 values.
  template <class C, bool kZeros, class Acc>
  __device__ __forceinline__ static void store(const typename C::Params& p, const Tile& tile,
                                               const Acc& acc, typename C::Smem& smem, int cwg,
                                               int lt, int&) {
    using T = typename C::T;
    unsigned char* bufs = chunk_buffers<C>(smem, cwg);
    const int j0 = tile.n0 / 2;
    fused_stage(tile, bufs, cwg, lt, &p.tma_d, &p.epi.tma_d2, j0, [&](auto st) {
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
    fused_stage(tile, bufs, cwg, lt, &p.epi.tma_act, nullptr, j0, [&](auto st) {
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
};

}  // namespace gmm::varlen
