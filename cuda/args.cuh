// Per-group argument building on the device for the packed forms (the rules of
// src/shape.rs: clamp_spans / packed_problems), and the zero-fill kernel.
//
// One block scans offs (a running maximum, so that for any offs the group spans are in
// bounds, ordered and disjoint) and, per group g, writes the group's (m, n, k),
// pointers and leading dimensions into either the primary set (TMA / 16-byte-aligned
// kernel) or the fallback set (any alignment); the other set gets an empty problem at the same index. Groups with k = 0
// and a non-empty output go to the zero set instead, as does the tail past offs[G-1].
#pragma once
#include "common.cuh"
#include "launch.h"

#include <cub/block/block_scan.cuh>

namespace gmm {

// An operand normalised on the host: base pointer, element strides, and which of its
// last two dims is unit-stride (major) with the other stride as leading dimension.
struct OpDesc {
  uintptr_t ptr = 0;
  int64_t rs = 0, cs = 0, bs = 0;
  int major = kRowMajor;
  int64_t ld = 0;
};

struct PackedDesc {
  int form = 0;
  int es_in = 2, es_out = 2;  // element sizes in bytes
  int64_t groups = 0, m = 0, n = 0, k = 0, extent = 0;
  OpDesc a, b, c;
  const int* offs = nullptr;
  GemmSet primary, fallback, zero;  // primary/fallback: groups entries; zero: groups + 1
  int primary_on = 0;               // 0: every group goes to the fallback set
  int* err_flag = nullptr;          // device view of the host-mapped offs error flag
};

__device__ __forceinline__ int64_t clamp64(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// 16-byte rule of TMA and of the vectorised 2.x kernels: aligned base, leading dimension
// and contiguous extent.
__device__ __forceinline__ bool aligned16(uintptr_t p, int64_t ld, int64_t contig, int es) {
  return (p % 16) == 0 && ((ld * es) % 16) == 0 && ((contig * es) % 16) == 0;
}

__device__ __forceinline__ void put(const GemmSet& s, int64_t i, int m, int n, int k, uintptr_t a,
                                    uintptr_t b, uintptr_t c, int64_t lda, int64_t ldb,
                                    int64_t ldc) {
  s.prob[3 * i + 0] = m;
  s.prob[3 * i + 1] = n;
  s.prob[3 * i + 2] = k;
  s.a[i] = reinterpret_cast<void*>(a);
  s.b[i] = reinterpret_cast<void*>(b);
  s.c[i] = reinterpret_cast<void*>(c);
  s.lda[i] = lda;
  s.ldb[i] = ldb;
  s.ldc[i] = ldc;
}

// Problem of group g with span [s, e) into the primary, fallback and zero sets.
__device__ void emit_group(const PackedDesc& d, int64_t g, int64_t s, int64_t e) {
  const int ei = d.es_in, eo = d.es_out;
  int64_t M = d.m, N = d.n, K = d.k;
  uintptr_t pa = d.a.ptr, pb = d.b.ptr, pc = d.c.ptr;
  switch (d.form) {
    case GMM_GROUPED_M:
      M = e - s;
      pa += uintptr_t(s * d.a.rs * ei);
      pb += uintptr_t(g * d.b.bs * ei);
      pc += uintptr_t(s * d.c.rs * eo);
      break;
    case GMM_GROUPED_K:
      K = e - s;
      pa += uintptr_t(s * d.a.cs * ei);
      pb += uintptr_t(s * d.b.rs * ei);
      pc += uintptr_t(g * d.c.bs * eo);
      break;
    case GMM_GROUPED_N:
      N = e - s;
      pa += uintptr_t(g * d.a.bs * ei);
      pb += uintptr_t(s * d.b.cs * ei);
      pc += uintptr_t(s * d.c.cs * eo);
      break;
    default:  // batched
      pa += uintptr_t(g * d.a.bs * ei);
      pb += uintptr_t(g * d.b.bs * ei);
      pc += uintptr_t(g * d.c.bs * eo);
      break;
  }
  const bool empty_out = M == 0 || N == 0;
  const bool zero_k = !empty_out && K == 0;
  put(d.zero, g, zero_k ? int(M) : 0, zero_k ? int(N) : 0, 0, 0, 0, pc, 0, 0, d.c.ld);
  if (empty_out || zero_k) {
    put(d.primary, g, 0, 0, 0, pa, pb, pc, d.a.ld, d.b.ld, d.c.ld);
    put(d.fallback, g, 0, 0, 0, pa, pb, pc, d.a.ld, d.b.ld, d.c.ld);
    return;
  }
  bool fast = d.primary_on != 0;
  if (fast) {
    const int64_t ca = d.a.major == kRowMajor ? K : M;
    const int64_t cb = d.b.major == kRowMajor ? N : K;
    fast = aligned16(pa, d.a.ld, ca, ei) && aligned16(pb, d.b.ld, cb, ei) &&
           aligned16(pc, d.c.ld, N, eo);
  }
  const GemmSet& on = fast ? d.primary : d.fallback;
  const GemmSet& off = fast ? d.fallback : d.primary;
  put(on, g, int(M), int(N), int(K), pa, pb, pc, d.a.ld, d.b.ld, d.c.ld);
  put(off, g, 0, 0, 0, pa, pb, pc, d.a.ld, d.b.ld, d.c.ld);
}

// The zero tail: rows (GroupedM) or columns (GroupedN) past the last group's end.
__device__ void emit_tail(const PackedDesc& d, int64_t end) {
  const int64_t G = d.groups;
  if (d.form == GMM_GROUPED_M && end < d.m) {
    put(d.zero, G, int(d.m - end), int(d.n), 0, 0, 0,
        d.c.ptr + uintptr_t(end * d.c.rs * d.es_out), 0, 0, d.c.ld);
  } else if (d.form == GMM_GROUPED_N && end < d.n) {
    put(d.zero, G, int(d.m), int(d.n - end), 0, 0, 0,
        d.c.ptr + uintptr_t(end * d.c.cs * d.es_out), 0, 0, d.c.ld);
  } else {
    put(d.zero, G, 0, 0, 0, 0, 0, d.c.ptr, 0, 0, d.c.ld);
  }
}

constexpr int kBuilderThreads = 256;

struct MaxOp {
  __device__ __forceinline__ int64_t operator()(int64_t x, int64_t y) const { return x > y ? x : y; }
};

// One block. Spans follow shape::clamp_spans: end_g = max(clamp(offs[0..=g], 0, extent))
// (a running maximum), start_g = end_{g-1} (0 for g = 0), so for ANY offs the spans are
// in bounds, ordered and disjoint; valid offs pass through unchanged. The running max is
// a block-wide scan over chunks of kBuilderThreads groups.
__global__ void __launch_bounds__(kBuilderThreads) build_packed_args(PackedDesc d) {
  using Scan = cub::BlockScan<int64_t, kBuilderThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int64_t ends[kBuilderThreads];
  const int64_t G = d.groups;
  const int64_t ext = d.extent;
  const bool ragged = d.form != GMM_BATCHED;
  int64_t carry = 0;  // end of the previous chunk's last group (same in every thread)
  for (int64_t base = 0; base < G; base += kBuilderThreads) {
    const int64_t g = base + threadIdx.x;
    int64_t v = 0;
    if (ragged && g < G) {
      const int64_t raw = d.offs[g];
      const int64_t prev = g == 0 ? 0 : d.offs[g - 1];
      if ((raw < 0 || raw > ext || raw < prev) && d.err_flag != nullptr) {
        *reinterpret_cast<volatile int*>(d.err_flag) = 1;
      }
      v = clamp64(raw, 0, ext);
    }
    int64_t incl = 0, agg = 0;
    Scan(tmp).InclusiveScan(v, incl, MaxOp(), agg);
    const int64_t e = incl > carry ? incl : carry;
    ends[threadIdx.x] = e;
    __syncthreads();
    const int64_t s = threadIdx.x == 0 ? carry : ends[threadIdx.x - 1];
    if (g < G) emit_group(d, g, ragged ? s : 0, ragged ? e : 0);
    carry = agg > carry ? agg : carry;
    __syncthreads();  // tmp and ends[] are reused by the next chunk
  }
  if (threadIdx.x == 0) emit_tail(d, ragged && G > 0 ? carry : 0);
}

// Writes zeros to the (m, n) region at c[i] (row-major, leading dimension ldc[i]) of
// every entry i in [first, first + count) of a set. Every block walks all entries and
// the blocks split each non-empty region, so the grid needs no device-side sizes.
template <class Word>
__global__ void zero_fill(GemmSet z, int64_t first, int64_t count) {
  for (int64_t i = first; i < first + count; ++i) {
    const int64_t M = z.prob[3 * i], N = z.prob[3 * i + 1];
    if (M <= 0 || N <= 0) continue;
    Word* c = reinterpret_cast<Word*>(z.c[i]);
    const int64_t ld = z.ldc[i];
    const int64_t total = M * N;
    for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
         t += int64_t(gridDim.x) * blockDim.x) {
      const int64_t r = t / N, col = t - r * N;
      c[r * ld + col] = Word(0);
    }
  }
}

}  // namespace gmm
