// The SwiGLU epilogue (its Args block and meaning: swiglu.h): the routed expert block's up
// projection stores the pre-activation pre = [gate | up] and act = silu(gate) * up from the
// fp32 accumulators. A ping-pong 128 x 128 tile is 64 gate columns and the same 64 up
// columns of the product: B is read as two halves (tma_b, tma_b2). Device code (nvcc only),
// and its maps.
#pragma once
#include "kernels/varlen/epilogue/common.cuh"
#include "kernels/varlen/epilogue/swiglu.h"

namespace gmm::varlen {

struct SwigluEpi : FusedEpilogue<SwigluArgs> {
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
    const char* b = static_cast<const char*>(x.b);
    const char* up = b + (C::kBKMajor ? f * x.ldb : f) * int64_t(es);
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
      const auto& e = std::get<Args>(x.epi);
      err =
          encode_halves(&p.tma_d, &p.epi.tma_d2, &p.epi.tma_act, dt, x.d, x.ldd, e.act, int(f), es);
    }
    return err;
  }

  // k-block kb's B tile: the tile's 64 gate columns, then the same 64 columns of the up
  // half; both 64 x BK boxes land where a 128-column tile's two halves would (either major).
  template <class C>
  __device__ __forceinline__ static void load_b(const typename C::Params& p, const Tile& tile,
                                                int kb, uint64_t* bar, typename C::T* sb) {
    const uint64_t hint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
    const int j0 = tile.n0 / 2;
    if constexpr (C::kBKMajor) {
      SM90_TMA_LOAD_3D::copy(&p.tma_b, bar, hint, sb, kb * C::BK, j0, tile.group);
      SM90_TMA_LOAD_3D::copy(&p.epi.tma_b2, bar, hint, sb + 64 * C::BK, kb * C::BK, j0, tile.group);
    } else {
      SM90_TMA_LOAD_3D::copy(&p.tma_b, bar, hint, sb, j0, kb * C::BK, tile.group);
      SM90_TMA_LOAD_3D::copy(&p.epi.tma_b2, bar, hint, sb + 64 * C::BK, j0, kb * C::BK, tile.group);
    }
  }

  // The tile's columns go to column j0 = n0 / 2 of each half. Stage 1 stores both halves of
  // the pre-activation, stage 2 act = silu(gate) * up from the fp32 values.
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
