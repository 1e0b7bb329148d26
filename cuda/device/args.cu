// Per-group argument building on the device for the packed forms (the rules of
// src/shape/offs.rs clamp_spans, src/cpu/problems.rs packed_problems), fused with the zero fill,
// and the zero fill of the list form. Compiled by nvcc for every listed architecture.
//
// Every block of build_packed_args scans offs (a running maximum, so that for any offs
// the group spans are in bounds, ordered and disjoint). Block 0 writes, per group g, the
// group's (m, n, k), pointers and leading dimensions into either the primary set (TMA /
// 16-byte-aligned kernel) or the fallback set (any alignment); the other set gets an
// empty problem at the same index. Outputs that no GEMM writes (groups with k = 0 and a
// non-empty output, and the tail past offs[G-1]) are zeroed by all blocks together, in
// the same launch: no second kernel, and no walk over the groups that need nothing.
#include "device/args.h"

#include "device/align.h"

#include <cub/block/block_scan.cuh>

#include <algorithm>

namespace gmm {

__device__ __forceinline__ int64_t clamp64(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
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

// One group's problem: sizes and operand addresses for span [s, e).
struct GroupProblem {
  int64_t M = 0, N = 0, K = 0;
  uintptr_t pa = 0, pb = 0, pc = 0;
  // Output that no GEMM writes and must be zeroed: k = 0 with a non-empty output.
  __device__ bool zero_only() const { return M > 0 && N > 0 && K == 0; }
};

__device__ GroupProblem group_problem(const PackedDesc& d, int64_t g, int64_t s, int64_t e) {
  const int ei = d.es_in, eo = d.es_out;
  GroupProblem p;
  p.M = d.m;
  p.N = d.n;
  p.K = d.k;
  p.pa = d.a.ptr;
  p.pb = d.b.ptr;
  p.pc = d.c.ptr;
  switch (d.form) {
    case Form::GroupedM:
      p.M = e - s;
      p.pa += uintptr_t(s * d.a.rs * ei);
      p.pb += uintptr_t(g * d.b.bs * ei);
      p.pc += uintptr_t(s * d.c.rs * eo);
      break;
    case Form::GroupedK:
      p.K = e - s;
      p.pa += uintptr_t(s * d.a.cs * ei);
      p.pb += uintptr_t(s * d.b.rs * ei);
      p.pc += uintptr_t(g * d.c.bs * eo);
      break;
    case Form::GroupedN:
      p.N = e - s;
      p.pa += uintptr_t(g * d.a.bs * ei);
      p.pb += uintptr_t(s * d.b.cs * ei);
      p.pc += uintptr_t(s * d.c.cs * eo);
      break;
    default:  // batched
      p.pa += uintptr_t(g * d.a.bs * ei);
      p.pb += uintptr_t(g * d.b.bs * ei);
      p.pc += uintptr_t(g * d.c.bs * eo);
      break;
  }
  return p;
}

// Group g's entry in the primary and fallback sets (an empty problem in the set that
// does not run it; empty in both when no GEMM is needed).
__device__ void emit_group(const PackedDesc& d, int64_t g, const GroupProblem& p) {
  const int ei = d.es_in, eo = d.es_out;
  if (p.M == 0 || p.N == 0 || p.K == 0) {
    put(d.primary, g, 0, 0, 0, p.pa, p.pb, p.pc, d.a.ld, d.b.ld, d.c.ld);
    put(d.fallback, g, 0, 0, 0, p.pa, p.pb, p.pc, d.a.ld, d.b.ld, d.c.ld);
    return;
  }
  bool fast = d.primary_on != 0;
  if (fast) {
    const int64_t ca = d.a.major == kRowMajor ? p.K : p.M;
    const int64_t cb = d.b.major == kRowMajor ? p.N : p.K;
    fast = aligned16(p.pa, d.a.ld, ca, ei) && aligned16(p.pb, d.b.ld, cb, ei) &&
           aligned16(p.pc, d.c.ld, p.N, eo);
  }
  const GemmSet& on = fast ? d.primary : d.fallback;
  const GemmSet& off = fast ? d.fallback : d.primary;
  put(on, g, int(p.M), int(p.N), int(p.K), p.pa, p.pb, p.pc, d.a.ld, d.b.ld, d.c.ld);
  put(off, g, 0, 0, 0, p.pa, p.pb, p.pc, d.a.ld, d.b.ld, d.c.ld);
}

// This block's share of zeroing a row-major rows x cols region at c (leading dimension
// ld elements, es bytes each): the rows congruent to (part + rot) modulo parts, 16-byte
// stores when the region allows them. `rot` spreads many small regions over the blocks.
template <class Word>
__device__ void zero_rows_as(uintptr_t c, int64_t rows, int64_t words, int64_t ld_bytes,
                             int64_t part, int64_t parts) {
  const int64_t my_rows = rows > part ? (rows - part + parts - 1) / parts : 0;
  if (words >= int64_t(blockDim.x)) {
    for (int64_t i = 0; i < my_rows; ++i) {
      Word* row = reinterpret_cast<Word*>(c + uintptr_t((part + i * parts) * ld_bytes));
      for (int64_t w = threadIdx.x; w < words; w += blockDim.x) row[w] = Word{};
    }
    return;
  }
  // Short rows: the block's threads cover several rows at once.
  const int64_t total = my_rows * words;
  for (int64_t t = threadIdx.x; t < total; t += blockDim.x) {
    const int64_t i = t / words, w = t - i * words;
    reinterpret_cast<Word*>(c + uintptr_t((part + i * parts) * ld_bytes))[w] = Word{};
  }
}

__device__ void zero_rows(uintptr_t c, int64_t rows, int64_t cols, int64_t ld, int es,
                          int64_t rot) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t parts = gridDim.x;
  const int64_t part = (int64_t(blockIdx.x) + parts - rot % parts) % parts;
  const int64_t ld_bytes = ld * es, row_bytes = cols * es;
  if (c % 16 == 0 && ld_bytes % 16 == 0 && row_bytes % 16 == 0) {
    zero_rows_as<uint4>(c, rows, row_bytes / 16, ld_bytes, part, parts);
  } else if (es == 2) {
    zero_rows_as<uint16_t>(c, rows, cols, ld_bytes, part, parts);
  } else if (es == 4) {
    zero_rows_as<uint32_t>(c, rows, cols, ld_bytes, part, parts);
  } else {
    zero_rows_as<uint64_t>(c, rows, cols, ld_bytes, part, parts);
  }
}

struct MaxOp {
  __device__ __forceinline__ int64_t operator()(int64_t x, int64_t y) const {
    return x > y ? x : y;
  }
};

// Spans follow shape::clamp_spans: end_g = max(clamp(offs[0..=g], 0, extent)) (a running
// maximum), start_g = end_{g-1} (0 for g = 0), so for ANY offs the spans are in bounds,
// ordered and disjoint; valid offs pass through unchanged. The running max is a
// block-wide scan over chunks of kBuilderThreads groups, repeated by every block (offs
// is small and stays in L2) so that each block knows every span without a grid sync.
// Block 0 writes the GEMM arguments and reports invalid offs; every block zeroes its
// share of the k = 0 groups (chunk by chunk) and of the tail.
__global__ void __launch_bounds__(kBuilderThreads) build_packed_args(PackedDesc d) {
  using Scan = cub::BlockScan<int64_t, kBuilderThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int64_t ends[kBuilderThreads];
  __shared__ int64_t zero_g[kBuilderThreads], zero_m[kBuilderThreads], zero_n[kBuilderThreads];
  __shared__ uintptr_t zero_c[kBuilderThreads];
  __shared__ int zero_count;
  const bool writer = blockIdx.x == 0;
  const int64_t G = d.groups;
  const int64_t ext = d.extent;
  const bool ragged = d.form != Form::Batched;
  int64_t carry = 0;  // end of the previous chunk's last group (same in every thread)
  for (int64_t base = 0; base < G; base += kBuilderThreads) {
    const int64_t g = base + threadIdx.x;
    int64_t v = 0;
    if (ragged && g < G) {
      const int64_t raw = d.offs[g];
      const int64_t prev = g == 0 ? 0 : d.offs[g - 1];
      if (writer && (raw < 0 || raw > ext || raw < prev) && d.err_flag != nullptr) {
        *reinterpret_cast<volatile int*>(d.err_flag) = kErrOffs;
      }
      v = clamp64(raw, 0, ext);
    }
    int64_t incl = 0, agg = 0;
    Scan(tmp).InclusiveScan(v, incl, MaxOp(), agg);
    const int64_t e = incl > carry ? incl : carry;
    ends[threadIdx.x] = e;
    if (threadIdx.x == 0) zero_count = 0;
    __syncthreads();
    const int64_t s = threadIdx.x == 0 ? carry : ends[threadIdx.x - 1];
    if (g < G) {
      const GroupProblem p = group_problem(d, g, ragged ? s : 0, ragged ? e : 0);
      if (writer) emit_group(d, g, p);
      if (p.zero_only()) {
        const int z = atomicAdd(&zero_count, 1);
        zero_g[z] = g;
        zero_m[z] = p.M;
        zero_n[z] = p.N;
        zero_c[z] = p.pc;
      }
    }
    carry = agg > carry ? agg : carry;
    __syncthreads();  // zero_* complete
    for (int z = 0; z < zero_count; ++z) {
      zero_rows(zero_c[z], zero_m[z], zero_n[z], d.c.ld, d.es_out, zero_g[z]);
    }
    __syncthreads();  // tmp, ends[] and zero_* are reused by the next chunk
  }
  // The tail past the last group's end: rows (GroupedM) or columns (GroupedN).
  const int64_t end = ragged && G > 0 ? carry : 0;
  if (d.form == Form::GroupedM && end < d.m) {
    zero_rows(d.c.ptr + uintptr_t(end * d.c.rs * d.es_out), d.m - end, d.n, d.c.ld, d.es_out, G);
  } else if (d.form == Form::GroupedN && end < d.n) {
    zero_rows(d.c.ptr + uintptr_t(end * d.c.cs * d.es_out), d.m, d.n - end, d.c.ld, d.es_out, G);
  }
}

// Zero fill of the list form: the (m, n) region at c[i] (row-major, leading dimension
// ldc[i]) of every entry i of a set built on the host (only the entries that need it).
__global__ void zero_fill(GemmSet z, int es) {
  for (int64_t i = 0; i < z.count; ++i) {
    zero_rows(reinterpret_cast<uintptr_t>(z.c[i]), z.prob[3 * i], z.prob[3 * i + 1], z.ldc[i], es,
              i);
  }
}

unsigned zero_blocks(int64_t max_elems, int es, int sm_count) {
  const int64_t per_block = int64_t(kBuilderThreads) * 4 * (16 / es);
  const int64_t blocks = max_elems / per_block + (max_elems % per_block != 0);
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(sm_count) * 2)));
}

cudaError_t launch_packed_args(const PackedDesc& d, unsigned blocks, cudaStream_t stream) {
  build_packed_args<<<blocks, kBuilderThreads, 0, stream>>>(d);
  return cudaGetLastError();
}

cudaError_t launch_zero_fill(const GemmSet& z, int es, unsigned blocks, cudaStream_t stream) {
  zero_fill<<<blocks, kBuilderThreads, 0, stream>>>(z, es);
  return cudaGetLastError();
}

}  // namespace gmm
