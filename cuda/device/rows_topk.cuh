// TopK, the router's top-k ids (what the row kernels share: rows_kernels.cuh; its launcher:
// rows.cu): one row in one warp's registers, values compared exactly. Device code (nvcc
// only).
#pragma once
#include "device/rows_kernels.cuh"

#include <climits>
#include <type_traits>

namespace gmm::rows_kernels {

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
