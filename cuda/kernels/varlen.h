// groupmm's own sm_90a grouped GEMMs for the packed MoE forms ("varlen" kernels): what the
// host side needs to know about them (no CUTLASS or CuTe types here).
//
//   varlen-M (GroupedM: forward, dX)  D[T, N] = A[T, K] x B[g](K, N), rows of group g
//             (or with A's rows gathered: A[r] = a[gather[r]], the MoE forward on x in
//             token order)
//   varlen-K (GroupedK: dW)           D[g](M, N) = A(M, span_g) x B(span_g, N)
//
// kernels/varlen_sm90.cuh holds the kernel; one kernels/sm90_<dtype>_varlen_<m|k>_<tile>.cu
// file instantiates each (dtype, mode) pair. ARCHITECTURE.md ("The varlen kernels") says how
// they work and how a gathered-A operand or an epilogue fusion slots in.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace gmm::varlen {

enum class Mode : int { M = 0, K = 1 };

// One call. Strides are in elements.
struct Args {
  Mode mode = Mode::M;
  // A: varlen-M [T, K] row-major (lda = row stride). varlen-K: x [T, M] row-major, read as
  //    A = x^T (M-major); lda = row stride of x.
  const void* a = nullptr;
  int64_t lda = 0;
  // Gathered A (varlen-M, the "varlen_m_gather" kernels): row r of the product's A is row
  // gather[r] of a, which has a_rows rows (device int32[m], never read on the host; rows
  // whose index is outside [0, a_rows) read as zeros). Null for the plain kernels.
  const int* gather = nullptr;
  int64_t a_rows = 0;
  // B: varlen-M [G, K, N], element (k, n) of group g at b + g*ldb_batch + k*ldb + n, or at
  //    b + g*ldb_batch + n*ldb + k when b_k_major (a transposed view: the dX product).
  //    varlen-K: dY [T, N] row-major (ldb = row stride).
  const void* b = nullptr;
  int64_t ldb = 0, ldb_batch = 0;
  bool b_k_major = false;
  // D: varlen-M [T, N] row-major (ldd); varlen-K [G, M, N] (ldd, ldd_batch).
  void* d = nullptr;
  int64_t ldd = 0, ldd_batch = 0;
  const int* offs = nullptr;  // device int32[groups]: cumulative group ends (never read on the host)
  int groups = 0;
  // varlen-M: m = T (rows), n = N, k = K.  varlen-K: m = M, n = N, k = T (tokens).
  int m = 0, n = 0, k = 0;
  int* err_flag = nullptr;  // device view of the deferred offs-error flag, may be null
  int sm_count = 0;
  int device = 0;
  cudaStream_t stream = nullptr;
};

// What the kernels can read (the TMA rules: 16-byte aligned bases and strides; whole
// 16-byte output chunks, so N — and for varlen-K also M — a multiple of 8 elements), for
// 2-byte elements.
inline bool can_run(const Args& x) {
  auto al = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) % 16) == 0; };
  auto st = [](int64_t s) { return s >= 0 && (s * 2) % 16 == 0; };
  bool ok = al(x.a) && al(x.b) && al(x.d) && st(x.lda) && st(x.ldb) && st(x.ldd) &&
            (x.n * 2) % 16 == 0 && x.m >= 0 && x.n >= 0 && x.k >= 0 && x.groups >= 0;
  if (x.mode == Mode::M) {
    ok = ok && st(x.ldb_batch);
  } else {
    ok = ok && st(x.ldd_batch) && (x.m * 2) % 16 == 0;
  }
  return ok;
}

// The entry points, one per kernels/sm90_<dtype>_varlen_*.cu: run the call on x.stream
// (no host sync), "" on success or a message naming the failed step.
std::string sm90_bf16_varlen_m_run(const Args& x);
std::string sm90_f16_varlen_m_run(const Args& x);
std::string sm90_bf16_varlen_k_run(const Args& x);
std::string sm90_f16_varlen_k_run(const Args& x);

}  // namespace gmm::varlen
