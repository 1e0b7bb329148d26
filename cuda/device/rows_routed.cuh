// The row kernels that read rows through the routing index `inverse` (what they share:
// rows_kernels.cuh; their launchers: rows.cu): GatherSum, ScatterRows (invert, then
// scatter_rows) and RowDots. An index outside [0, rows) is never read and raises the deferred
// error flag. The gathering kernels (GatherSum, ScatterRows) issue all of a thread's index
// loads, then all of its row loads, before the first use (kLoads below); RowDots
// grid-strides. Device code (nvcc only).
#pragma once
#include "device/rows.h"
#include "device/rows_kernels.cuh"

namespace gmm::rows_kernels {

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

}  // namespace gmm::rows_kernels
