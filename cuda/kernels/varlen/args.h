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
// The folder, by role: config.cuh (a kernel's compile-time configuration and shared
// memory), scheduler.cuh (tiles from offs), producer.cuh (the loads), mainloop.cuh (the
// wgmma k-loop), epilogue.cuh (accumulators to global memory), kernel.cuh (the roles and
// the two consumer schedules), launch.cuh (host side: tensor maps and the launch). One
// kernels/sm90_<dtype>_varlen_*.cu file instantiates the configurations of one
// (dtype, mode) pair; cuda/heuristics/ chooses among them.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include <string>
#include "device/types.h"

namespace gmm::varlen {

enum class Mode : uint8_t { M = 0, K = 1 };

// How the two consumer warpgroups share the work.
// - Cooperative: both work on one 128-row tile (64 rows each) and store it together.
// - PingPong: each takes whole tiles in turn; one runs its mainloop while the other runs
//   its epilogue, handed over as soon as the last wgmma of a tile is issued.
enum class Schedule : uint8_t { Cooperative = 0, PingPong = 1 };

// Which operand's token rows the producer warpgroup reads through Args::src (cp.async:
// sm_90's TMA cannot gather rows). varlen-M: A only; varlen-K: A (x^T) or B (dY).
enum class Gather : uint8_t { None = 0, A = 1, B = 2 };

// One compiled kernel configuration, the key of its registry entry.
struct Config {
  Mode mode = Mode::M;
  Schedule schedule = Schedule::Cooperative;
  int bn = 128;                  // tile width (the tile is 128 rows)
  Gather gather = Gather::None;  // the operand whose rows are read through Args::src
  // varlen-M: what the epilogue does beyond storing the product (Args::epi).
  Epilogue epi = Epilogue::Plain;
  constexpr bool operator==(const Config& o) const {
    return mode == o.mode && schedule == o.schedule && bn == o.bn && gather == o.gather &&
           epi == o.epi;
  }
};

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
  // The fused epilogues (varlen-M, ping-pong 128 x 128; the meaning is Fusion's in
  // src/exec/ffi.rs). With F = n / 2 (SwiGLU) or n (DGated):
  // - SwiGLU: d = the product [m, 2F] (gate | up halves), act = silu(gate) * up [m, F];
  //   B's gate and up halves are read as two column ranges of one tile.
  // - DGated: the product p [m, F] is not stored; d = dpre [m, 2F], act = scale * silu(g) * u
  //   [m, F], partial [ceil(F / 64), m] (f32) the per-chunk row sums of p * silu(g) * u,
  //   from pre [m, 2F] and scale [m] (f32). Every one contiguous (row stride 2F, F or m).
  Epilogue epi = Epilogue::Plain;
  void* act = nullptr;
  const void* pre = nullptr;
  const float* scale = nullptr;
  float* partial = nullptr;
  int* err_flag = nullptr;  // device view of the deferred error flag, may be null
  int sm_count = 0;
  int device = 0;
  cudaStream_t stream = nullptr;
};

// What the kernels can read (the TMA rules: 16-byte aligned bases and strides; whole
// 16-byte output chunks, so N, and for varlen-K also M, a multiple of 8 elements), for
// 2-byte elements. The heuristic (cuda/heuristics/) asks this before it picks a kernel.
inline bool can_read(const Args& x) {
  auto al = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) % 16) == 0; };
  auto st = [](int64_t s) { return s >= 0 && (s * 2) % 16 == 0; };
  bool ok = al(x.a) && al(x.b) && al(x.d) && st(x.lda) && st(x.ldb) && st(x.ldd) &&
            (x.n * 2) % 16 == 0 && x.m >= 0 && x.n >= 0 && x.k >= 0 && x.groups >= 0;
  if (x.epi != Epilogue::Plain) {
    // F a multiple of 8 (16-byte halves), contiguous outputs, row-major A, varlen-M.
    const int64_t f = x.epi == Epilogue::SwiGLU ? x.n / 2 : x.n;
    ok = ok && x.mode == Mode::M && f > 0 && f % 8 == 0 && al(x.act) &&
         (x.epi == Epilogue::SwiGLU ? x.n % 2 == 0 && x.ldd == x.n
                                    : x.ldd == 2 * f && al(x.pre) && x.scale && x.partial);
  }
  if (x.mode == Mode::M) {
    ok = ok && st(x.ldb_batch);
  } else {
    ok = ok && st(x.ldd_batch) && (x.m * 2) % 16 == 0;
  }
  return ok;
}

}  // namespace gmm::varlen
