// What a grouped kernel family reads and where it runs: the per-group argument arrays
// ("sets") that the argument builders write (cuda/device/args.cu on the device,
// cuda/host/list.cc on the host) and the kernels of cuda/kernels/ read, the run context,
// and how a run reports a CUDA failure. Plain C++ (host code includes it too).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace gmm {

enum Major : int { kRowMajor = 0, kColMajor = 1 };

// Layout combination index of a grouped kernel: a_major * 2 + b_major.
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

// "<what> failed: <error name>: <error string>".
inline std::string cuda_fail(const char* what, cudaError_t e) {
  return std::string(what) + " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

}  // namespace gmm
