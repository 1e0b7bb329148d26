// The RowScale epilogue (its Args block and meaning: rowscale.h): each row of the product
// times its scale, from the fp32 accumulators, stored as the plain product is (D [T, N],
// ragged), 64 columns per stage through the warpgroup's chunk buffers. Rows past the
// group's end are another tile's (not written) and read no scale. Device code (nvcc only),
// and its map.
#pragma once
#include "kernels/varlen/epilogue/common.cuh"
#include "kernels/varlen/epilogue/rowscale.h"

namespace gmm::varlen {

struct RowScaleEpi : FusedEpilogue<RowScaleArgs> {
  struct Params {
    const float* scale;  // [m]
  };

  // D [T, N] (ragged), as the plain epilogue's; the scale pointer.
  template <class C>
  static std::string tensor_maps(typename C::Params& p, const varlen::Args& x,
                                 CUtensorMapDataType dt) {
    p.epi.scale = Args::from(x.epi).scale;
    return encode_ragged(&p.tma_d, dt, x.d, x.n, x.ldd, 64, 64, "D [T, N] (ragged)");
  }

  // The tile's two 64-column chunks, each row's values times its scale (loaded once).
  template <class C, bool kZeros, class Acc>
  __device__ __forceinline__ static void store(const typename C::Params& p, const Tile& tile,
                                               const Acc& acc, typename C::Smem& smem, int cwg,
                                               int lt, int&) {
    using T = typename C::T;
    unsigned char* bufs = chunk_buffers<C>(smem, cwg);
    const int lane = lt % 32, wq = lt / 32, end = tile.start + tile.len;
    float s[2][2];
    CUTE_UNROLL
    for (int mb = 0; mb < 2; ++mb) {
      CUTE_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        const int r = tile.m0 + 64 * mb + 16 * wq + lane / 4 + 8 * v1;
        s[mb][v1] = (!kZeros && r < end) ? __ldg(p.epi.scale + r) : 0.f;
      }
    }
    CUTE_UNROLL
    for (int j = 0; j < 2; ++j) {
      const int col = tile.n0 + 64 * j;
      if (col >= p.n) break;  // the whole chunk is past N (the map would drop it anyway)
      fused_stage(tile, bufs, cwg, lt, &p.tma_d, nullptr, col, [&](auto st) {
        each_pair([&](int mb, int jj, int v1) {
          if constexpr (kZeros) {
            st(0, mb, jj, v1, 0u);
          } else {
            const int i = 64 * mb + 4 * (8 * j + jj) + 2 * v1;
            const float sc = s[mb][v1];
            st(0, mb, jj, v1, pack<T>(sc * acc(i), sc * acc(i + 1)));
          }
        });
      });
    }
  }
};

}  // namespace gmm::varlen
