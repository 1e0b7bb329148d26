// Shared between the nvcc-compiled files of groupmm: the per-group argument arrays
// ("sets") that the argument builders write and the kernels read, and the entry points
// of each kernel family. Host code compiled by nvcc only.
#pragma once
#include <cuda_runtime.h>
#include <cstddef>
#include <cstdint>
#include <string>

namespace gmm {

enum Major : int { kRowMajor = 0, kColMajor = 1 };

// Layout combination index: a_major * 2 + b_major.
inline int combo_of(int a_major, int b_major) { return a_major * 2 + b_major; }

inline size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// A structure-of-arrays block of `count` GEMM problems in device memory.
//   prob: 3 ints per problem (m, n, k), the layout of cutlass::gemm::GemmCoord and of
//         cute::Shape<int, int, int>;
//   a, b, c: element pointers; lda/ldb/ldc: leading dimensions in elements (a single
//         int64 each, the layout of CUTLASS 3.x packed strides with one dynamic mode).
// Output C is always row-major; A and B have the majors of the set's kernel.
struct GemmSet {
  int* prob = nullptr;
  void** a = nullptr;
  void** b = nullptr;
  void** c = nullptr;
  int64_t* lda = nullptr;
  int64_t* ldb = nullptr;
  int64_t* ldc = nullptr;
  int64_t count = 0;
};

inline size_t set_bytes(int64_t count) {
  return round_up(size_t(count) * 12, 16) + size_t(count) * 6 * 8;
}

// Carves a set of `count` problems at `base` (16-byte aligned).
inline GemmSet set_at(uintptr_t base, int64_t count) {
  GemmSet s;
  s.count = count;
  s.prob = reinterpret_cast<int*>(base);
  uintptr_t p = base + round_up(size_t(count) * 12, 16);
  size_t n = size_t(count) * 8;
  s.a = reinterpret_cast<void**>(p);
  s.b = reinterpret_cast<void**>(p + n);
  s.c = reinterpret_cast<void**>(p + 2 * n);
  s.lda = reinterpret_cast<int64_t*>(p + 3 * n);
  s.ldb = reinterpret_cast<int64_t*>(p + 4 * n);
  s.ldc = reinterpret_cast<int64_t*>(p + 5 * n);
  return s;
}

// Where a kernel family runs.
struct RunCtx {
  cudaStream_t stream = nullptr;
  int device = 0;
  int sm_count = 1;
  void* workspace = nullptr;  // CUTLASS workspace (sm90 kernels), may be shared by runs
  size_t workspace_bytes = 0;
};

// Kernel families. Each returns "" on success, else a message naming the failed call.
// dtype codes are gmm_dtype values (launch.h).

// CUTLASS 3.x sm_90a ptr-array grouped GEMM (TMA, warp-specialized), 16-bit in/out.
// Requires every problem of the set to be 16-byte aligned (base, leading dimension and
// contiguous extent); the argument builders route the others to the fallback.
// `config` is a tile configuration id picked by sm90_pick_config() (dispatch.cu).
enum Sm90Config : int {
  kSm90Tile128x256 = 0,  // cooperative 128x256x64, cluster 2x1x1
  kSm90Tile128x128 = 1,  // cooperative 128x128x64, cluster 1x1x1
  kSm90Ping64x128 = 2,   // ping-pong 64x128x128, cluster 1x1x1
};
size_t sm90_bf16_workspace_bytes(int config, int combo, int64_t count, int sm_count);
std::string sm90_bf16_run(int config, int combo, const GemmSet& s, const RunCtx& ctx);
size_t sm90_f16_workspace_bytes(int config, int combo, int64_t count, int sm_count);
std::string sm90_f16_run(int config, int combo, const GemmSet& s, const RunCtx& ctx);

// CUTLASS 2.x grouped GEMM (tensor cores), 16-bit in, same dtype or float32 out.
// aligned8: the 16-byte-aligned variant (multistage, cp.async); otherwise the
// alignment-1 variant (2-stage, any address), used for misaligned groups.
std::string sm80_bf16_run(int out_dtype, int combo, bool aligned8, const GemmSet& s,
                          const RunCtx& ctx);
std::string sm80_f16_run(int out_dtype, int combo, bool aligned8, const GemmSet& s,
                         const RunCtx& ctx);

// CUTLASS 2.x grouped GEMM for float32 (SIMT full fp32, or TF32 tensor cores) and float64
// (fp64 tensor cores). Any alignment.
std::string f32_run(bool tf32, int combo, const GemmSet& s, const RunCtx& ctx);
std::string f64_run(int combo, const GemmSet& s, const RunCtx& ctx);

std::string cuda_fail(const char* what, cudaError_t e);

}  // namespace gmm
