// groupmm's own sm_90a grouped GEMMs for the packed MoE forms ("varlen" kernels): what the
// host side needs to know about them (no CUTLASS or CuTe types here).
//
//   varlen-M (GroupedM: forward, dX)  D[T, N] = A[T, K] x B[g](K, N), rows of group g
//             (or with A's rows gathered: A[r] = a[src[r]], the MoE forward on x in
//             token order)
//   varlen-K (GroupedK: dW)           D[g](M, N) = A(M, span_g) x B(span_g, N)
//             (or with one operand's token rows gathered: the weight gradients of the MoE
//             block on x or dY in token order, A = x[src]^T or B = dY[src])
//
// The folder, by role: key.h (the registry key), config.cuh (a kernel's compile-time
// configuration, shared memory, parameters and tensor-map encoders), scheduler.cuh (tiles
// from offs), producer.cuh (the loads), mainloop.cuh (the wgmma k-loop), epilogue/ (one
// policy per epilogue, <name>.cuh, owning all of it: its argument block (<name>.h, plain
// C++, read from Args::epi by position), can_read clause, parameters, tensor maps, shared
// memory and store; common.cuh what several share), kernel.cuh (the roles and the two
// consumer schedules), launch.cuh (host side: the maps and the launch), entries.cuh
// (registry entries), fused.cuh (the one list of the fused epilogues' configurations). One
// kernels/sm90_<dtype>_varlen_*.cu file instantiates the configurations of one (dtype,
// mode) pair; cuda/heuristics/ chooses among them.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include <string>

#include "device/align.h"
#include "device/types.h"
#include "kernels/varlen/key.h"

namespace gmm::varlen {

// One call. Strides are in elements.
struct Args {
  Mode mode = Mode::M;
  // A: varlen-M [T, K] row-major (lda = row stride). varlen-K: x [T, M] row-major, read as
  //    A = x^T (M-major); lda = row stride of x.
  const void* a = nullptr;
  int64_t lda = 0;
  // Gathered rows (Config::gather, set by gather_op): routed row r (varlen-M: row r of A;
  // varlen-K: token r of A = x^T (Gather::A) or of B = dY (Gather::B)) is row src[r] of
  // the operand's tensor (a or b), which has gathered_rows rows. src: the routed-row index
  // (Fusion::src; device int32 [m] varlen-M, [k] varlen-K, never read on the host; an index
  // outside [0, gathered_rows) reads zeros and sets the deferred error flag to kErrIndex).
  // Null for the plain kernels.
  const int* src = nullptr;
  Gather gather_op = Gather::None;
  int64_t gathered_rows = 0;
  // B: varlen-M [G, K, N], element (k, n) of group g at b + g*ldb_batch + k*ldb + n, or at
  //    b + g*ldb_batch + n*ldb + k when b_k_major (a transposed view: the dX product).
  //    varlen-K: dY [T, N] row-major (ldb = row stride).
  const void* b = nullptr;
  int64_t ldb = 0, ldb_batch = 0;
  bool b_k_major = false;
  // D: varlen-M [T, N] row-major (ldd); varlen-K [G, M, N] (ldd, ldd_batch).
  void* d = nullptr;
  int64_t ldd = 0, ldd_batch = 0;
  const int* offs =
      nullptr;  // device int32[groups]: cumulative group ends (never read on the host)
  int groups = 0;
  // varlen-M: m = T (rows), n = N, k = K.  varlen-K: m = M, n = N, k = T (tokens).
  int m = 0, n = 0, k = 0;
  // The epilogue's operands by position (varlen-M; the kernel's Config::epi names the
  // epilogue, whose policy's argument block reads them, epilogue/<name>.h; which
  // configurations each runs in: its policy's fits()).
  EpiOperands epi;
  int* err_flag = nullptr;  // device view of the deferred error flag, may be null
  int sm_count = 0;
  int device = 0;
  cudaStream_t stream = nullptr;
};

// What the kernels can read (the TMA rules: 16-byte aligned bases and strides; whole
// 16-byte output chunks, so N, and for varlen-K also M, a multiple of 8 elements), for
// 2-byte elements. The heuristic (cuda/heuristics/) asks this before it picks a kernel.
// The epilogue's own clause is its block's can_read (epilogue/<name>.h), which the kernel's
// registry entry asks (entries.cuh, epi_reads).
inline bool can_read(const Args& x) {
  auto al = [](const void* p) { return is16(int64_t(uintptr_t(p))); };
  auto st = [](int64_t s) { return s >= 0 && is16(s * 2); };
  bool ok = al(x.a) && al(x.b) && al(x.d) && st(x.lda) && st(x.ldb) && st(x.ldd) &&
            is16(int64_t(x.n) * 2) && x.m >= 0 && x.n >= 0 && x.k >= 0 && x.groups >= 0;
  if (x.mode == Mode::M) {
    ok = ok && st(x.ldb_batch);
    // the gathering producer copies whole 16-byte units of A's rows: K too
    if (x.src != nullptr) ok = ok && is16(int64_t(x.k) * 2);
  } else {
    ok = ok && st(x.ldd_batch) && is16(int64_t(x.m) * 2);
  }
  return ok;
}

}  // namespace gmm::varlen
