// The row kernels of the MoE glue (what each op computes: rows.h; their launchers:
// rows.cu, the only file that includes this one). Memory-bound: each thread moves 16-byte
// vectors when every row starts 16-byte aligned (else one element), arithmetic in fp32
// (fp64 for float64), one rounding per output element. The gathering kernels (GatherSum,
// ScatterRows) issue all of a thread's index loads, then all of its row loads, before the
// first use (kLoads below); the elementwise ones (SwiGLU and its gradient) and RowDots
// grid-stride. TopK (the router's top-k ids) holds one row in one warp's registers and
// compares values exactly. Device code (nvcc only).
#pragma once
#include "device/rows.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <type_traits>

namespace gmm::rows_kernels {

template <class T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

__device__ inline float to_acc(__half v) { return __half2float(v); }
__device__ inline float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline float to_acc(float v) { return v; }
__device__ inline double to_acc(double v) { return v; }

template <class T>
__device__ inline T from_acc(Acc<T> v) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(v);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    return T(v);
  }
}

template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <class T, int V>
__device__ inline Pack<T, V> load(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}

template <class T, int V>
__device__ inline void store(T* p, const Pack<T, V>& v) {
  *reinterpret_cast<Pack<T, V>*>(p) = v;
}

__device__ inline int64_t first() { return int64_t(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ inline int64_t step() { return int64_t(gridDim.x) * blockDim.x; }

template <class A>
__device__ inline A sigmoid(A g) {
  if constexpr (std::is_same_v<A, double>) {
    return 1.0 / (1.0 + exp(-g));
  } else {
    return 1.0f / (1.0f + expf(-g));
  }
}

template <class T, int V>
__global__ void swiglu(const T* x, T* out, int64_t rows, int64_t cols) {
  using A = Acc<T>;
  const int64_t cv = cols / V, n = rows * cv;
  for (int64_t i = first(); i < n; i += step()) {
    const int64_t r = i / cv, c = (i - r * cv) * V;
    const T* row = x + r * 2 * cols;
    const Pack<T, V> g = load<T, V>(row + c), u = load<T, V>(row + cols + c);
    Pack<T, V> o;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const A gv = to_acc(g.v[e]);
      o.v[e] = from_acc<T>(gv * sigmoid(gv) * to_acc(u.v[e]));
    }
    store<T, V>(out + r * cols + c, o);
  }
}

template <class T, int V>
__global__ void swiglu_backward(const T* grad, const T* pre, T* out, int64_t rows, int64_t cols) {
  using A = Acc<T>;
  const int64_t cv = cols / V, n = rows * cv;
  for (int64_t i = first(); i < n; i += step()) {
    const int64_t r = i / cv, c = (i - r * cv) * V;
    const T* row = pre + r * 2 * cols;
    const Pack<T, V> dh = load<T, V>(grad + r * cols + c);
    const Pack<T, V> g = load<T, V>(row + c), u = load<T, V>(row + cols + c);
    Pack<T, V> dg, du;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const A d = to_acc(dh.v[e]), gv = to_acc(g.v[e]), uv = to_acc(u.v[e]);
      const A s = sigmoid(gv);
      dg.v[e] = from_acc<T>(d * uv * s * (A(1) + gv * (A(1) - s)));
      du.v[e] = from_acc<T>(d * gv * s);
    }
    T* o = out + r * 2 * cols;
    store<T, V>(o + c, dg);
    store<T, V>(o + cols + c, du);
  }
}

// An index outside [0, rows) contributes nothing and raises the deferred error flag
// (kErrIndex, reported by the device's next grouped GEMM call): never read out of bounds,
// never silently a zero row.
__device__ inline bool in_range(int64_t r, int64_t rows, int* err) {
  if (r >= 0 && r < rows) return true;
  if (err != nullptr) *reinterpret_cast<volatile int*>(err) = kErrIndex;
  return false;
}

template <class T, class W>
__device__ inline Acc<T> weight(const W* w, int64_t i) {
  return w == nullptr ? Acc<T>(1) : Acc<T>(to_acc(w[i]));
}

// Memory-level parallelism of the gathering kernels (GatherSum, ScatterRows). A thread's
// step covers U work items (a token's -- or a row's -- 16-byte column vector; the items a
// grid-stride apart, so that each load instruction of a warp stays one contiguous run) and,
// per item, KC of its k rows: all U indices (x KC) are loaded, then all U x KC vectors,
// before the first is used, so that U * KC = kLoads 16-byte loads per thread are in flight
// instead of one load waiting on its index (cuda/NOTES.md, "Row kernels at the memory's
// limit"). Summation stays in the order of j, so the results are those of one load at a time.
#ifndef GMM_ROWS_LOADS
#define GMM_ROWS_LOADS 4
#endif
constexpr int kLoads = GMM_ROWS_LOADS;
// ScatterRows' rows per thread step.
#ifndef GMM_ROWS_SCATTER_U
#define GMM_ROWS_SCATTER_U 1
#endif
constexpr int kScatterU = GMM_ROWS_SCATTER_U;

// GatherSum: out[t] = sum_j w[t, j] * x[inverse[t, j]]. k = 1 (kOne: kCopy without weights,
// kScaled with): the one term, x itself or w * x, with no accumulators (their registers cut
// the resident threads, and so the loads in flight, by half).
enum One : int { kSum = 0, kCopy = 1, kScaled = 2 };
template <class T, class W, int V, int U, int KC, int kOne>
__global__ void __launch_bounds__(256)
    gather_sum(const T* __restrict__ x, const int32_t* __restrict__ inverse,
               const W* __restrict__ w, T* __restrict__ out, int64_t tokens, int64_t top_k,
               int64_t rows, int64_t cols, int* err) {
  using A = Acc<T>;
  const int64_t cv = cols / V, n = tokens * cv, st = step();
  bool bad = false;
  for (int64_t i0 = first(); i0 < n; i0 += U * st) {
    int64_t t[U], c[U];
    bool live[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = i0 + u * st;
      live[u] = i < n;
      t[u] = live[u] ? i / cv : 0;
      c[u] = (i - t[u] * cv) * V;
    }
    A acc[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int e = 0; e < V; ++e) acc[u][e] = A(0);
    }
    Pack<T, V> p[U][KC];
    bool ok[U][KC];
    A wt[U][KC];
    for (int64_t j0 = 0; j0 < top_k; j0 += KC) {
      int64_t r[U][KC];
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int jj = 0; jj < KC; ++jj) {
          const bool on = live[u] && j0 + jj < top_k;
          const int64_t at = t[u] * top_k + j0 + jj;
          r[u][jj] = on ? int64_t(__ldg(inverse + at)) : -1;
          if constexpr (kOne != kCopy) wt[u][jj] = on ? weight<T>(w, at) : A(0);
          ok[u][jj] = r[u][jj] >= 0 && r[u][jj] < rows;
          bad |= on && !ok[u][jj];
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int jj = 0; jj < KC; ++jj) {
          if (ok[u][jj]) {
            p[u][jj] = load<T, V>(x + r[u][jj] * cols + c[u]);
          } else {
#pragma unroll
            for (int e = 0; e < V; ++e) p[u][jj].v[e] = T(0);
          }
        }
      }
      if constexpr (kOne == kSum) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
          for (int jj = 0; jj < KC; ++jj) {
            if (ok[u][jj]) {
#pragma unroll
              for (int e = 0; e < V; ++e) acc[u][e] += wt[u][jj] * to_acc(p[u][jj].v[e]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!live[u]) continue;
      Pack<T, V> o;
      if constexpr (kOne != kSum) {
        if (kOne == kCopy || !ok[u][0]) {
          o = p[u][0];  // the row itself (weight 1: exact), or zeros
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) o.v[e] = from_acc<T>(wt[u][0] * to_acc(p[u][0].v[e]));
        }
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) o.v[e] = from_acc<T>(acc[u][e]);
      }
      store<T, V>(out + t[u] * cols + c[u], o);
    }
  }
  if (bad && err != nullptr) *reinterpret_cast<volatile int*>(err) = kErrIndex;
}

// assign[inverse[tj]] = tj + 1 (0 stays for rows no index names).
__global__ void invert(const int32_t* inverse, int32_t* assign, int64_t n, int64_t rows, int* err) {
  for (int64_t i = first(); i < n; i += step()) {
    const int64_t r = inverse[i];
    if (in_range(r, rows, err)) assign[r] = int32_t(i + 1);
  }
}

// Row by row, so that writes stream in row order and every row is written once:
// out[r] = w[a] * x[a / k] for the assignment a of row r, zeros for rows without one. U rows'
// vectors per thread step, their loads issued together (kScatterU above: 1, as 2 measured no
// faster).
template <class T, class W, int V, int U>
__global__ void __launch_bounds__(256)
    scatter_rows(const T* __restrict__ x, const int32_t* __restrict__ assign,
                 const W* __restrict__ w, T* __restrict__ out, int64_t top_k, int64_t rows,
                 int64_t cols) {
  using A = Acc<T>;
  const int64_t cv = cols / V, n = rows * cv, st = step();
  for (int64_t i0 = first(); i0 < n; i0 += U * st) {
    int64_t r[U], c[U], a[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = i0 + u * st;
      r[u] = i < n ? i / cv : -1;
      c[u] = (i - r[u] * cv) * V;
      a[u] = r[u] >= 0 ? int64_t(__ldg(assign + r[u])) - 1 : -1;
    }
    Pack<T, V> p[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (a[u] >= 0) {
        p[u] = load<T, V>(x + (a[u] / top_k) * cols + c[u]);
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) p[u].v[e] = T(0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (r[u] < 0) continue;
      Pack<T, V> o;
      if (a[u] < 0 || w == nullptr) {
        o = p[u];  // zeros, or the row itself (weight 1: exact)
      } else {
        const A wa = weight<T>(w, a[u]);
#pragma unroll
        for (int e = 0; e < V; ++e) o.v[e] = from_acc<T>(wa * to_acc(p[u].v[e]));
      }
      store<T, V>(out + r[u] * cols + c[u], o);
    }
  }
}

// One warp per (token, j): lanes stride over the columns, then a fixed xor tree.
template <class T, class W, int V>
__global__ void row_dots(const T* x, const T* y, const int32_t* inverse, W* out, int64_t tokens,
                         int64_t top_k, int64_t rows, int64_t cols, int* err) {
  using A = Acc<T>;
  const int lane = threadIdx.x % 32;
  const int64_t n = tokens * top_k;
  for (int64_t wi = first() / 32; wi < n; wi += step() / 32) {
    const int64_t r = inverse[wi];
    A s = A(0);
    if (in_range(r, rows, err)) {
      const T* xr = x + (wi / top_k) * cols;
      const T* yr = y + r * cols;
      for (int64_t c = int64_t(lane) * V; c < cols; c += 32 * V) {
        const Pack<T, V> p = load<T, V>(xr + c), q = load<T, V>(yr + c);
#pragma unroll
        for (int e = 0; e < V; ++e) s += to_acc(p.v[e]) * to_acc(q.v[e]);
      }
    }
#pragma unroll
    for (int d = 16; d > 0; d /= 2) s += __shfl_xor_sync(0xffffffffu, s, d);
    if (lane == 0) out[wi] = from_acc<W>(Acc<W>(s));
  }
}

// TopK: one warp per row (a grid-stride loop over the rows). Lane l holds the row's columns
// l, l + 32, ..., l + 32 (N - 1) in registers (N a power of two, 32 N >= cols; each of the N
// loads of a warp one coalesced run), converted exactly to Acc<T>. k rounds, each: every lane
// offers the best of its columns not yet taken (kept from the round before; a bit mask marks
// the taken slots and the ones past the row, since -inf is a real score and no value is
// overwritten), a warp arg-max by xor shuffles in topk_before's order (strict and total on
// distinct columns, so every lane ends with the same winner), and the winner's lane marks it
// taken and finds its next best. Round r's column is kept by lane r % 32, and each group of
// 32 rounds is written by one coalesced store of int64 ids. For float values (all but
// double) the pair is one 64-bit key (topk_key) and each comparison a 64-bit max.

// A lane with no column left to offer (never the winner while k <= cols).
constexpr int kNoColumn = INT_MAX;

// Whether value a at column ia ranks before value b at column ib (ia != ib): the greater
// value, NaN greater than every number, equal values (NaNs among themselves, -0.0 == 0.0)
// the lower column first. The order of src/shape/rows.rs, topk_before.
template <class A>
__device__ __forceinline__ bool topk_before(A a, int ia, A b, int ib) {
  const bool na = isnan(a), nb = isnan(b);
  if (na || nb) return na && (!nb || ia < ib);
  return a > b || (a == b && ia < ib);
}

// The best of this lane's columns not taken: (value, column), or column kNoColumn. Slots in
// increasing column order, so a tie keeps the first.
template <class A, int N>
__device__ __forceinline__ void topk_lane_best(const A (&v)[N], uint32_t taken, int lane, A& bv,
                                               int& bc) {
  bv = A(0);
  bc = kNoColumn;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int c = lane + 32 * j;
    if (!((taken >> j) & 1u) && (bc == kNoColumn || topk_before(v[j], c, bv, bc))) {
      bv = v[j];
      bc = c;
    }
  }
}

// float values (fp32, bf16, fp16 widened exactly): topk_before as one 64-bit key,
// (the value's order-preserving bits) << 32 | (2^32 - 1 - column), NaN above every number
// and -0.0 as 0.0, so each arg-max step is a 64-bit max; 0 marks a slot taken or past the
// row (no value's key is 0: the lowest, -inf's, is 0x007fffff << 32 | ...).
__device__ __forceinline__ uint64_t topk_key(float v, int c) {
  uint32_t u = __float_as_uint(v == 0.f ? 0.f : v);
  u = isnan(v) ? 0xffffffffu : (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (uint64_t(u) << 32) | uint64_t(0xffffffffu - uint32_t(c));
}

template <int N>
__device__ __forceinline__ uint64_t topk_key_max(const uint64_t (&key)[N]) {
  uint64_t m = key[0];
#pragma unroll
  for (int j = 1; j < N; ++j) m = key[j] > m ? key[j] : m;
  return m;
}

template <class T, int N>
__device__ __forceinline__ void topk_row_keys(const T* row, int64_t* o, int cols, int top_k,
                                              int lane) {
  uint64_t key[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int c = lane + 32 * j;
    key[j] = c < cols ? topk_key(to_acc(row[c]), c) : uint64_t(0);
  }
  uint64_t best = topk_key_max(key);
  int64_t mine = 0;
  for (int r = 0; r < top_k; ++r) {
    uint64_t w = best;
#pragma unroll
    for (int d = 16; d > 0; d /= 2) {
      const uint64_t other = __shfl_xor_sync(0xffffffffu, w, d);
      w = other > w ? other : w;
    }
    const int wc = int(0xffffffffu - uint32_t(w));
    if (lane == r % 32) mine = w == 0 ? int64_t(-1) : int64_t(wc);
    if (r % 32 == 31 || r + 1 == top_k) {
      if (lane <= r % 32) o[r - r % 32 + lane] = mine;
    }
    if (w == best) {  // this lane's: take it, offer the next
#pragma unroll
      for (int j = 0; j < N; ++j) key[j] = key[j] == w ? uint64_t(0) : key[j];
      best = topk_key_max(key);
    }
  }
}

// double values: (value, column) pairs compared by topk_before.
template <class T, int N>
__device__ __forceinline__ void topk_rows_double(const T* __restrict__ x, int64_t* __restrict__ out,
                                                 int64_t tokens, int cols, int top_k, int lane) {
  using A = Acc<T>;
  for (int64_t t = first() / 32; t < tokens; t += step() / 32) {
    const T* row = x + t * cols;
    A v[N];
    uint32_t taken = 0;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int c = lane + 32 * j;
      if (c < cols) {
        v[j] = to_acc(row[c]);
      } else {
        v[j] = A(0);
        taken |= 1u << j;  // past the row: never offered
      }
    }
    A bv;
    int bc;
    topk_lane_best(v, taken, lane, bv, bc);
    int64_t* o = out + t * top_k;
    int64_t mine = 0;
    for (int r = 0; r < top_k; ++r) {
      A wv = bv;
      int wc = bc;
#pragma unroll
      for (int d = 16; d > 0; d /= 2) {
        const A ov = __shfl_xor_sync(0xffffffffu, wv, d);
        const int oc = __shfl_xor_sync(0xffffffffu, wc, d);
        if (oc != kNoColumn && (wc == kNoColumn || topk_before(ov, oc, wv, wc))) {
          wv = ov;
          wc = oc;
        }
      }
      if (lane == r % 32) mine = wc == kNoColumn ? int64_t(-1) : int64_t(wc);
      if (r % 32 == 31 || r + 1 == top_k) {
        if (lane <= r % 32) o[r - r % 32 + lane] = mine;
      }
      if (wc != kNoColumn && wc % 32 == lane) {  // the winner's lane: take it, offer the next
        taken |= 1u << (wc / 32);
        topk_lane_best(v, taken, lane, bv, bc);
      }
    }
  }
}

template <class T, int N>
__global__ void __launch_bounds__(256) topk_ids(const T* __restrict__ x, int64_t* __restrict__ out,
                                                int64_t tokens, int cols, int top_k) {
  static_assert(N >= 1 && N <= 32, "TopK: at most 32 values a lane (kTopKMaxCols)");
  const int lane = threadIdx.x % 32;
  if constexpr (std::is_same_v<Acc<T>, float>) {
    for (int64_t t = first() / 32; t < tokens; t += step() / 32)
      topk_row_keys<T, N>(x + t * cols, out + t * top_k, cols, top_k, lane);
  } else {
    topk_rows_double<T, N>(x, out, tokens, cols, top_k, lane);
  }
}

}  // namespace gmm::rows_kernels
