// The tile scheduler of the varlen kernels and the offs check: every role of every CTA
// walks the groups from offs on the device (no argument builder, no host read).
// - A warp-parallel scan over 32 groups at a time: running max of offs clamped to
//   [0, extent] (exactly shape::clamp_spans), then a prefix sum of tile counts.
// - Tiles go group by group, and inside a group panel by panel (8 M-tiles wide, M
//   fastest), so the CTAs of one wave share a few A row blocks and weight tiles in L2.
// - varlen-M walks one more "group", the zero tail [offs[G-1], T); empty groups and the
//   tail become tiles with no k-blocks, which the consumers store as exact zeros.
// Device code (nvcc only).
#pragma once
#include "kernels/varlen/config.cuh"

namespace gmm::varlen {

struct Tile {
  int group;  // varlen-M: `groups` for the zero tail past offs[G-1]
  int start;  // first row (varlen-M) / first token (varlen-K) of the group
  int len;    // rows / tokens of the group
  int m0;     // varlen-M: first row of the tile (absolute); varlen-K: first output row
  int n0;     // first output column
  bool valid;
};

// Maps a linear tile index to its tile. Tiles are numbered group by group, so a persistent
// CTA that takes blockIdx.x, blockIdx.x + gridDim.x, ... only moves forward through the
// groups, and the scan resumes where it stopped. Every role calls it with the same indices
// and gets the same tiles. Must be called by all 32 lanes of a warp.
template <Mode kMode, int BM, int BN>
struct Scheduler {
  static constexpr int kPanel = 8;  // M-tiles per panel
  const int* offs;
  int groups, m, n, k;
  int n_tiles, m_tiles_fixed;
  int base = 0;          // the window of 32 groups [base, base + 32)
  int carry_end = 0;     // clamped end of group base - 1
  int tiles_before = 0;  // tiles of the groups before base
  int cur_group = -1, cur_start = 0, cur_len = 0, cur_first = 0, cur_count = 0;  // last found

  __device__ explicit Scheduler(const Params& p)
      : offs(p.offs), groups(p.groups), m(p.m), n(p.n), k(p.k) {
    n_tiles = (n + BN - 1) / BN;
    m_tiles_fixed = (m + BM - 1) / BM;
  }

  __device__ int m_tiles(int len) const {
    return kMode == Mode::M ? (len + BM - 1) / BM : m_tiles_fixed;
  }

  __device__ Tile get(int t) {
    const int lane = threadIdx.x % 32;
    if (!(cur_group >= 0 && t >= cur_first && t < cur_first + cur_count)) {
      // varlen-M walks one more group: the zero tail [offs[G-1], T).
      const int total = kMode == Mode::M ? groups + 1 : groups;
      const int ext = kMode == Mode::M ? m : k;
      bool found = false;
      while (!found && base < total) {
        const int g = base + lane;
        int v = 0;
        if (g < groups) {
          v = __ldg(offs + g);
          v = v < 0 ? 0 : (v > ext ? ext : v);
        } else if (g == groups && kMode == Mode::M) {
          v = ext;
        }
        int e = v;  // running max, the clamped end of group g
#pragma unroll
        for (int d = 1; d < 32; d *= 2) {
          const int o = __shfl_up_sync(0xffffffffu, e, d);
          if (lane >= d) e = e > o ? e : o;
        }
        e = e > carry_end ? e : carry_end;
        int s = __shfl_up_sync(0xffffffffu, e, 1);
        if (lane == 0) s = carry_end;
        const int len = g < total ? e - s : 0;
        const int cnt = g < total ? m_tiles(len) * n_tiles : 0;
        int incl = cnt;  // inclusive prefix sum of tile counts
#pragma unroll
        for (int d = 1; d < 32; d *= 2) {
          const int o = __shfl_up_sync(0xffffffffu, incl, d);
          if (lane >= d) incl += o;
        }
        const int window = __shfl_sync(0xffffffffu, incl, 31);
        if (tiles_before + window <= t) {
          tiles_before += window;
          carry_end = __shfl_sync(0xffffffffu, e, 31);
          base += 32;
          continue;
        }
        const int L = __popc(__ballot_sync(0xffffffffu, tiles_before + incl <= t));
        cur_group = base + L;
        cur_start = __shfl_sync(0xffffffffu, s, L);
        cur_len = __shfl_sync(0xffffffffu, len, L);
        cur_count = __shfl_sync(0xffffffffu, cnt, L);
        cur_first = tiles_before + __shfl_sync(0xffffffffu, incl, L) - cur_count;
        found = true;
      }
      if (!found) return Tile{0, 0, 0, 0, 0, false};
    }
    Tile tile;
    tile.group = cur_group;
    tile.start = cur_start;
    tile.len = cur_len;
    tile.valid = true;
    // Panel by panel: a panel is kPanel M-tiles wide and spans all N-tiles, M fastest.
    const int local = t - cur_first;
    const int panel = local / (kPanel * n_tiles);
    const int rem = local - panel * kPanel * n_tiles;
    const int left = m_tiles(cur_len) - panel * kPanel;
    const int pm = left < kPanel ? left : kPanel;
    const int nt = rem / pm, mt = panel * kPanel + (rem - nt * pm);
    tile.n0 = nt * BN;
    tile.m0 = (kMode == Mode::M ? cur_start : 0) + mt * BM;
    return tile;
  }
};

// One warp: raises the deferred error flag when offs is negative, decreasing or past the
// extent (the rule of shape::check_offs; the kernels compute clamped groups anyway).
__device__ inline void check_offs(const int* offs, int groups, int ext, int* flag) {
  if (flag == nullptr) return;
  const int lane = threadIdx.x % 32;
  int prev_last = 0;
  bool bad = false;
  for (int base = 0; base < groups; base += 32) {
    const int g = base + lane;
    const int v = g < groups ? __ldg(offs + g) : ext;
    int prev = __shfl_up_sync(0xffffffffu, v, 1);
    if (lane == 0) prev = prev_last;
    if (g < groups && (v < 0 || v > ext || v < prev)) bad = true;
    prev_last = __shfl_sync(0xffffffffu, v, 31);
  }
  if (__any_sync(0xffffffffu, bad) && lane == 0) *reinterpret_cast<volatile int*>(flag) = kErrOffs;
}

}  // namespace gmm::varlen
