// The varlen kernels (see varlen.h for the forms): groupmm's own persistent,
// warp-specialized sm_90a grouped GEMM for MoE-packed operands. nvcc only.
//
// What makes them MoE-native (unlike CUTLASS's ptr-array kernels, which rewrite and fence
// the A/B/D tensor maps whenever a CTA moves to another group):
// - ONE TMA descriptor per operand for the whole call, encoded on the host. A tile of group
//   g addresses its rows by coordinate: varlen-M reads the packed [T, K] activations at row
//   start_g + i and the [G, K, N] weights through a 3-D map at batch g.
// - Group ends: varlen-M may load rows past a group's end (they only feed output rows that
//   are not stored); its output goes through a "ragged" map (below) whose bound stops the
//   TMA store at the group's last row. varlen-K reads each group's token range through
//   ragged maps, so the TMA unit zero-fills every token past the group's end: a partial
//   k-tile adds nothing, no split-K, no masking in the mainloop.
// - offs is read by the GEMM itself: every role of every CTA walks the groups with a
//   warp-parallel scan (running max of offs clamped to [0, extent], exactly
//   shape::clamp_spans; prefix sum of tile counts). No argument-builder launch. Rows past
//   offs[G-1] (varlen-M) and empty groups (varlen-K) get exact zeros from the same kernel
//   (tiles with no k-blocks), and one warp validates offs into the deferred error flag.
// - Persistent CTAs (one per SM), warp-specialized: one producer warp issues the TMA loads
//   of a `kStages`-deep ring; two consumer warpgroups run wgmma on a 128 x BN tile (64 rows
//   each), write it to a 128-byte-swizzled shared-memory tile and issue TMA stores that
//   drain while the next tile's mainloop runs.
// - Tiles go group by group, and inside a group panel by panel (8 M-tiles wide, M
//   fastest), so the CTAs of one wave share a few A row blocks and weight tiles in L2.
//
// The ragged maps (the trick of Triton's tools/ragged_tma.py and quack): a 2-D [rows, C]
// tensor with row stride s is described as 4-D (C, 2^30, 2^31-1, 2^31-1) with strides
// (s, 2^34 - s, s) elements. Coordinates (c, 2^30 - len + r, 2^30, start + len) address
// row start + r (the 2^30 * 2^34 term wraps to 0 modulo 2^64) and the bound 2^30 of the
// second one cuts every row r >= len: loads read zeros there and stores skip it.
//
// Extension points (ARCHITECTURE.md): the producer's A load of a varlen-M tile reads rows
// tile.m0 .. tile.m0 + 127; a gathered-A variant replaces that TMA load by row loads through
// an index vector (cp.async into the same swizzled layout). The epilogue converts the fp32
// accumulators in one place (`store_acc`): an activation, a per-row scale or a second
// output is added there.
#pragma once
#include "kernels/varlen.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "cute/arch/cluster_sm90.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cute/atom/mma_traits_sm90_gmma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

namespace gmm::varlen {

using namespace cute;

// ---------------------------------------------------------------------------------------
// Configuration of one kernel: element type, form, B's major (varlen-M), tile width.

template <class T_, Mode kMode_, bool kBKMajor_, int BN_, bool kGather_ = false>
struct Cfg {
  using T = T_;
  static constexpr Mode kMode = kMode_;
  static constexpr bool kBKMajor = kBKMajor_;  // varlen-M only; varlen-K's B is N-major
  // varlen-M only: A row r is row gather[r] of the activations, loaded by the producer
  // warpgroup with cp.async (TMA cannot gather rows on sm_90).
  static constexpr bool kGather = kGather_;
  static_assert(!kGather || kMode == Mode::M, "gathered A: varlen-M only");
  static constexpr int BM = 128, BN = BN_, BK = 64;
  static constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
  static constexpr bool kAKMajor = kMode == Mode::M;
  static constexpr GMMA::Major kMajA = kAKMajor ? GMMA::Major::K : GMMA::Major::MN;
  static constexpr GMMA::Major kMajB =
      (kMode == Mode::M && kBKMajor) ? GMMA::Major::K : GMMA::Major::MN;
  static_assert(BN % 64 == 0, "BN: whole 64-column chunks");

  using AtomA = conditional_t<kAKMajor, GMMA::Layout_K_SW128_Atom<T>, GMMA::Layout_MN_SW128_Atom<T>>;
  using AtomB = conditional_t<kMajB == GMMA::Major::K, GMMA::Layout_K_SW128_Atom<T>,
                              GMMA::Layout_MN_SW128_Atom<T>>;
  // MN-major tiles are laid out K-first, so that each 64-wide MN chunk (one TMA box of
  // 64 x BK elements) is contiguous.
  using OrderA = conditional_t<kAKMajor, Step<_1, _2, _3>, Step<_2, _1, _3>>;
  using OrderB = conditional_t<kMajB == GMMA::Major::K, Step<_1, _2, _3>, Step<_2, _1, _3>>;

  static constexpr int kStageBytes = (BM + BN) * BK * int(sizeof(T));
  static constexpr int kTmaBytes = (kGather ? BN : BM + BN) * BK * int(sizeof(T));  // per stage
  static constexpr int kDBytes = BM * BN * int(sizeof(T));  // the epilogue tile
  static constexpr int kSmemLimit = 232448;                 // sm_90 opt-in maximum per block
  static constexpr int kFit = (kSmemLimit - kDBytes - 1024) / kStageBytes;
  static constexpr int kStages = kFit > 8 ? 8 : kFit;
  static_assert(kStages >= 3, "tile too large for shared memory");

  using SmemLayoutA = decltype(tile_to_shape(AtomA{}, make_shape(Int<BM>{}, Int<BK>{}, Int<kStages>{}), OrderA{}));
  using SmemLayoutB = decltype(tile_to_shape(AtomB{}, make_shape(Int<BN>{}, Int<BK>{}, Int<kStages>{}), OrderB{}));

  using MmaAtom = decltype(GMMA::ss_op_selector<T, T, float, Shape<_64, Int<BN>, Int<BK>>, kMajA, kMajB>());
  using TiledMma = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<_2, _1, _1>>{}));  // 2 x 64 rows

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  struct alignas(1024) Smem {
    alignas(1024) T a[cosize_v<SmemLayoutA>];
    alignas(1024) T b[cosize_v<SmemLayoutB>];
    // 64-column chunks of BM rows, 128-byte rows with the TMA 128-byte swizzle: the layout
    // of the store boxes.
    alignas(1024) T d[BM * BN];
    typename Pipeline::SharedStorage pipe;
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
  // Gathered A (Cfg::kGather): the activations [a_rows, K] with row stride lda, and the
  // int32 row of each of the m packed rows.
  const void* a;
  const int* gather;
  int64_t lda;
  int a_rows;
};

__host__ __device__ constexpr int big() { return 1 << 30; }  // the ragged maps' bound

// ---------------------------------------------------------------------------------------
// Tile scheduler.

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

  __device__ explicit Scheduler(const Params& p) : offs(p.offs), groups(p.groups), m(p.m), n(p.n), k(p.k) {
    n_tiles = (n + BN - 1) / BN;
    m_tiles_fixed = (m + BM - 1) / BM;
  }

  __device__ int m_tiles(int len) const { return kMode == Mode::M ? (len + BM - 1) / BM : m_tiles_fixed; }

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
  if (__any_sync(0xffffffffu, bad) && lane == 0) *reinterpret_cast<volatile int*>(flag) = 1;
}

// ---------------------------------------------------------------------------------------
// Epilogue (per consumer warpgroup cwg, thread ct in 0..255; the warpgroup owns rows
// 64*cwg .. 64*cwg+63 of the tile).

// Before the warpgroup rewrites its rows of the smem tile, its previous TMA stores must
// have read them.
__device__ __forceinline__ void epilogue_wait(int cwg, int ct) {
  if (ct % 128 == 0) tma_store_wait<0>();
  cutlass::arch::NamedBarrier::sync(128, cwg);
}

// fp32 accumulators -> T, into the swizzled smem tile. Element i of this thread's fragment
// is at row (warp%4)*16 + lane/4 + 8*v1 of the warpgroup's rows and column
// 8*j + 2*(lane%4) + v0, with i = v0 + 2*v1 + 4*j (the wgmma C layout). The tile is 64-column
// chunks of 128-byte rows whose 16-byte units are XOR-ed with row % 8 (== lane/4 here). The
// offsets are explicit and the base opaque: CuTe's swizzled indexing per element made
// ptxas keep every address live across the tile loop and spill. Pairs are converted with
// the CUDA intrinsics: cutlass' scalar conversion is inline asm that makes ptxas serialise
// every wgmma of the kernel (warning C7514).
template <class T, int BM, class Acc>
__device__ __forceinline__ void store_acc(const Acc& acc, uint32_t smem_tile, int cwg, int ct) {
  const int lane = ct % 32, wq = (ct % 128) / 32, sw = lane / 4;
  uint32_t base = smem_tile + uint32_t((64 * cwg + wq * 16 + sw) * 128 + (lane % 4) * 4);
  asm volatile("" : "+r"(base));
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const int v1 = (i / 2) % 2, j = i / 4;
    const uint32_t off = uint32_t((j / 8) * BM * 128 + 8 * v1 * 128) + uint32_t(((j % 8) ^ sw) << 4);
    uint32_t packed;
    if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
      __nv_bfloat162 v = __floats2bfloat162_rn(acc(i), acc(i + 1));
      packed = *reinterpret_cast<uint32_t*>(&v);
    } else {
      __half2 v = __floats2half2_rn(acc(i), acc(i + 1));
      packed = *reinterpret_cast<uint32_t*>(&v);
    }
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + off), "r"(packed) : "memory");
  }
}

// The warpgroup's 64 rows of the smem tile to global memory, one TMA store per 64-column
// chunk, left in flight. varlen-M rows past the group's end fall outside the ragged map's
// bound and are not written; columns past N and rows past M are outside the maps too.
template <Mode kMode, int BM, int BN>
__device__ __forceinline__ void epilogue_store(const Params& p, const Tile& tile, int cwg, int ct,
                                               const unsigned char* smem_tile) {
  cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> the TMA unit
  cutlass::arch::NamedBarrier::sync(128, cwg);
  if (ct % 128 == 0) {
    const unsigned char* rows = smem_tile + 64 * cwg * 128;
    CUTE_UNROLL
    for (int j = 0; j < BN / 64; ++j) {
      const void* src = rows + j * BM * 128;
      if constexpr (kMode == Mode::M) {
        const int local = tile.m0 - tile.start + 64 * cwg;
        SM90_TMA_STORE_4D::copy(&p.tma_d, src, tile.n0 + 64 * j, big() - tile.len + local, big(),
                                tile.start + tile.len);
      } else {
        SM90_TMA_STORE_3D::copy(&p.tma_d, src, tile.n0 + 64 * j, tile.m0 + 64 * cwg, tile.group);
      }
    }
    tma_store_arrive();
  }
}

// ---------------------------------------------------------------------------------------
// Producers.

// varlen-M: the B tile of k-block kb (the weights of the tile's group), by TMA. One thread.
template <class C>
__device__ __forceinline__ void load_b_m(const Params& p, const Tile& tile, int kb, uint64_t* bar,
                                         typename C::T* sb) {
  const uint64_t hint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
  if constexpr (C::kBKMajor) {
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
// out of [0, a_rows) and columns past K are zero-filled without reading memory.
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
        if (v < 0 || v >= p.a_rows) v = -1;
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
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa + uint32_t(i * 16 * 128)), "l"(g),
                     "r"(bytes)
                     : "memory");
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(bar);
      if (pt == 0) load_b_m<C>(p, tile, kb, bar, smem.b + ws.index() * (C::BN * BK));
      ++ws;
    }
  }
}

// ---------------------------------------------------------------------------------------
// The kernel.

template <class C>
__global__ void __launch_bounds__(C::kThreads, 1) varlen_kernel(const __grid_constant__ Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = typename C::T;
  constexpr int BM = C::BM, BN = C::BN, BK = C::BK;
  using Pipeline = typename C::Pipeline;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename C::Smem*>(smem_raw);

  const int warp = threadIdx.x / 32, wg = threadIdx.x / 128, lane = threadIdx.x % 32;
  typename Pipeline::Params pp;
  pp.transaction_bytes = C::kTmaBytes;
  pp.role = wg == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = 256;
  // Gathered A: the 128 producer threads' cp.async arrivals complete a stage too.
  pp.num_producers = C::kGather ? 1 + 128 : 1;
  pp.initializing_warp = 0;
  Pipeline pipeline(smem.pipe, pp, Shape<_1, _1, _1>{});
  __syncthreads();

  Scheduler<C::kMode, BM, BN> sched(p);
  // k-blocks of a tile: varlen-M every group's K; varlen-K its own tokens; 0 for the
  // zero tail and empty groups.
  auto k_blocks = [&](const Tile& tile) {
    if constexpr (C::kMode == Mode::M) return tile.group < p.groups ? (p.k + BK - 1) / BK : 0;
    return (tile.len + BK - 1) / BK;
  };

  if (wg == 0) {
    // ---- producer: TMA loads into the ring (one warp), or the gathered A rows (all four) ----
    // Register budgets per thread, producer / consumers: 40 / 232, or 64 / 216 with the
    // gathered A's row addresses (within the launch's 168 x 384 either way).
    cutlass::arch::warpgroup_reg_dealloc<C::kGather ? 64 : 40>();
    if (warp == 1 && blockIdx.x == 0) check_offs(p.offs, p.groups, C::kMode == Mode::M ? p.m : p.k, p.err_flag);
    if constexpr (C::kGather) {
      produce_gathered<C>(p, pipeline, sched, smem, threadIdx.x);
    } else if (warp == 0) {
      auto ws = cutlass::make_producer_start_state<Pipeline>();
      const uint64_t hint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
      for (int t = blockIdx.x;; t += gridDim.x) {
        const Tile tile = sched.get(t);
        if (!tile.valid) break;
        const int kbs = k_blocks(tile);
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
                SM90_TMA_LOAD_4D::copy(&p.tma_a, bar, hint, sa + j * 64 * BK, tile.m0 + 64 * j, r, big(), e);
              }
              CUTE_UNROLL
              for (int j = 0; j < BN / 64; ++j) {
                SM90_TMA_LOAD_4D::copy(&p.tma_b, bar, hint, sb + j * 64 * BK, tile.n0 + 64 * j, r, big(), e);
              }
            }
          }
          ++ws;
        }
      }
    }
  } else {
    // ---- consumer warpgroups: wgmma, then the epilogue ----
    cutlass::arch::warpgroup_reg_alloc<C::kGather ? 216 : 232>();
    const int ct = threadIdx.x - 128, cwg = wg - 1;
    typename C::TiledMma mma;
    auto thr = mma.get_thread_slice(ct);
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(make_tensor(make_smem_ptr(smem.a), typename C::SmemLayoutA{})));
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(make_tensor(make_smem_ptr(smem.b), typename C::SmemLayoutB{})));
    const unsigned char* tile_bytes = reinterpret_cast<const unsigned char*>(smem.d);
    const uint32_t tile_smem = cast_smem_ptr_to_uint(smem.d);
    typename Pipeline::PipelineState rs, fs;  // read and release positions in the ring

    for (int t = blockIdx.x;; t += gridDim.x) {
      const Tile tile = sched.get(t);
      if (!tile.valid) break;
      const int kbs = k_blocks(tile);
      if (kbs == 0) {
        epilogue_wait(cwg, ct);
        // No reduction (the zero tail, an empty group, K = 0): exact zeros. Apart from the
        // MMA path, so that only wgmma ever defines the accumulators.
        uint4* z = reinterpret_cast<uint4*>(smem.d) + 64 * cwg * 8;
        CUTE_UNROLL
        for (int j = 0; j < BN / 64; ++j) {
          CUTE_UNROLL
          for (int i = 0; i < 64 * 8 / 128; ++i) z[j * BM * 8 + i * 128 + ct % 128] = make_uint4(0, 0, 0, 0);
        }
        epilogue_store<C::kMode, BM, BN>(p, tile, cwg, ct, tile_bytes);
        continue;
      }
      // Per tile: the first wgmma overwrites it (ScaleOut::Zero); no accumulator register
      // is carried across tiles (that too makes ptxas serialise the wgmmas).
      Tensor acc = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
      mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(acc);
      pipeline.consumer_wait(rs);
      if constexpr (C::kGather) cutlass::arch::fence_view_async_shared();  // cp.async -> wgmma
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kk = 0; kk < size<2>(tCrA); ++kk) {
        gemm(mma, tCrA(_, _, kk, rs.index()), tCrB(_, _, kk, rs.index()), acc);
        mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      ++rs;
      warpgroup_fence_operand(acc);
      // Steady state: one batch of wgmmas in flight while the next k-block is waited for.
      for (int kb = 1; kb < kbs; ++kb) {
        pipeline.consumer_wait(rs);
        if constexpr (C::kGather) cutlass::arch::fence_view_async_shared();
        warpgroup_fence_operand(acc);
        warpgroup_arrive();
        CUTE_UNROLL
        for (int kk = 0; kk < size<2>(tCrA); ++kk) {
          gemm(mma, tCrA(_, _, kk, rs.index()), tCrB(_, _, kk, rs.index()), acc);
        }
        warpgroup_commit_batch();
        warpgroup_wait<1>();
        warpgroup_fence_operand(acc);
        pipeline.consumer_release(fs);
        ++fs;
        ++rs;
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc);
      pipeline.consumer_release(fs);
      ++fs;
      // Only now wait for the previous tile's stores to have read the smem tile: they
      // drained while this tile's mainloop ran.
      epilogue_wait(cwg, ct);
      store_acc<T, BM>(acc, tile_smem, cwg, ct);
      epilogue_store<C::kMode, BM, BN>(p, tile, cwg, ct, tile_bytes);
    }
    if (ct % 128 == 0) tma_store_wait<0>();  // stores read smem: drain before the CTA exits
  }
#endif
}

// ---------------------------------------------------------------------------------------
// Host side: the tensor maps and the launch.

inline std::string encode(CUtensorMap* map, CUtensorMapDataType dt, int rank, const void* base,
                          const uint64_t* dims, const uint64_t* strides_bytes, const uint32_t* box,
                          const char* what) {
  const cuuint32_t unit[5] = {1, 1, 1, 1, 1};
  const CUresult r = cuTensorMapEncodeTiled(
      map, dt, cuuint32_t(rank), const_cast<void*>(base), reinterpret_cast<const cuuint64_t*>(dims),
      reinterpret_cast<const cuuint64_t*>(strides_bytes), reinterpret_cast<const cuuint32_t*>(box), unit,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return std::string("cuTensorMapEncodeTiled (") + what + ") failed with CUresult " + std::to_string(int(r));
  }
  return "";
}

// A ragged 4-D map over a 2-D [rows, cols] operand with row stride s (elements).
inline std::string encode_ragged(CUtensorMap* map, CUtensorMapDataType dt, const void* base, int cols,
                                 int64_t s, uint32_t box_cols, uint32_t box_rows, const char* what) {
  const uint64_t es = 2, u = uint64_t(s);
  const uint64_t dims[4] = {uint64_t(cols > 0 ? cols : 1), uint64_t(big()), 0x7fffffffull, 0x7fffffffull};
  const uint64_t str[3] = {u * es, ((uint64_t(1) << 34) - u) * es, u * es};
  const uint32_t box[4] = {box_cols, box_rows, 1, 1};
  return encode(map, dt, 4, base, dims, str, box, what);
}

template <class C>
std::string run(const Args& x) {
  using T = typename C::T;
  constexpr uint64_t es = sizeof(T);
  const CUtensorMapDataType dt =
      std::is_same_v<T, cutlass::bfloat16_t> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  if (x.m == 0 || x.n == 0 || (C::kMode == Mode::K && x.groups == 0)) return "";  // empty output
  Params p{};
  p.offs = x.offs;
  p.groups = x.groups;
  p.m = x.m;
  p.n = x.n;
  p.k = x.k;
  p.err_flag = x.err_flag;
  auto d1 = [](int64_t v) { return uint64_t(v > 0 ? v : 1); };  // extents never read stay legal
  std::string err;
  p.a = x.a;
  p.gather = x.gather;
  p.lda = x.lda;
  p.a_rows = int(x.a_rows);
  if constexpr (C::kMode == Mode::M) {
    if constexpr (!C::kGather) {
      const uint64_t da[2] = {d1(x.k), d1(x.m)}, sa[1] = {uint64_t(x.lda) * es};
      const uint32_t ba[2] = {C::BK, C::BM};
      err = encode(&p.tma_a, dt, 2, x.a, da, sa, ba, "A [T, K]");
    }
    if (err.empty()) {
      const uint64_t sb[2] = {uint64_t(x.ldb) * es, uint64_t(x.ldb_batch) * es};
      if constexpr (C::kBKMajor) {
        const uint64_t db[3] = {d1(x.k), d1(x.n), d1(x.groups)};
        const uint32_t bb[3] = {C::BK, C::BN, 1};
        err = encode(&p.tma_b, dt, 3, x.b, db, sb, bb, "B [G, N, K] (K-major)");
      } else {
        const uint64_t db[3] = {d1(x.n), d1(x.k), d1(x.groups)};
        const uint32_t bb[3] = {64, C::BK, 1};
        err = encode(&p.tma_b, dt, 3, x.b, db, sb, bb, "B [G, K, N] (N-major)");
      }
    }
    if (err.empty()) err = encode_ragged(&p.tma_d, dt, x.d, x.n, x.ldd, 64, 64, "D [T, N] (ragged)");
  } else {
    err = encode_ragged(&p.tma_a, dt, x.a, x.m, x.lda, 64, C::BK, "A = x^T (ragged)");
    if (err.empty()) err = encode_ragged(&p.tma_b, dt, x.b, x.n, x.ldb, 64, C::BK, "B = dY (ragged)");
    if (err.empty()) {
      const uint64_t dd[3] = {d1(x.n), d1(x.m), d1(x.groups)};
      const uint64_t sd[2] = {uint64_t(x.ldd) * es, uint64_t(x.ldd_batch) * es};
      const uint32_t bd[3] = {64, 64, 1};
      err = encode(&p.tma_d, dt, 3, x.d, dd, sd, bd, "D [G, M, N]");
    }
  }
  if (!err.empty()) return err;
  // The dynamic shared memory limit holds per device for the process: set it once.
  static unsigned long long attr_set = 0;  // bit d: device d
  const unsigned long long bit = 1ull << (x.device & 63);
  if (x.device > 63 || !(__atomic_load_n(&attr_set, __ATOMIC_ACQUIRE) & bit)) {
    const cudaError_t e =
        cudaFuncSetAttribute(varlen_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
    if (e != cudaSuccess) return std::string("cudaFuncSetAttribute (varlen kernel): ") + cudaGetErrorString(e);
    __atomic_fetch_or(&attr_set, bit, __ATOMIC_RELEASE);
  }
  // Persistent grid: one CTA per SM, or one per tile when there are fewer (an upper bound:
  // the tile count itself needs offs, which only the device reads).
  const int64_t n_tiles = (x.n + C::BN - 1) / C::BN;
  const int64_t max_tiles = C::kMode == Mode::M ? (int64_t(x.m) / C::BM + x.groups + 1) * n_tiles
                                                : int64_t(x.groups) * ((x.m + C::BM - 1) / C::BM) * n_tiles;
  const int grid = int(max_tiles < x.sm_count ? (max_tiles > 0 ? max_tiles : 1) : x.sm_count);
  varlen_kernel<C><<<grid, C::kThreads, C::kSmemBytes, x.stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return std::string("varlen kernel launch: ") + cudaGetErrorString(e);
  return "";
}

}  // namespace gmm::varlen
