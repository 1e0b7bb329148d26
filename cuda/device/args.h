// The device-side argument builder of the packed forms and the zero fill of the list
// form (kernels in args.cu): what the host hands them, and how to launch them.
// Plain C++ (the host launch code includes it).
#pragma once
#include "device/gemm_set.h"
#include "device/types.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace gmm {

// An operand as the builder reads it: base pointer, element strides, and which of its
// last two dims is unit-stride (major) with the other stride as leading dimension.
struct OpDesc {
  uintptr_t ptr = 0;
  int64_t rs = 0, cs = 0, bs = 0;
  int major = kRowMajor;
  int64_t ld = 0;
};

struct PackedDesc {
  Form form = Form::GroupedM;
  int es_in = 2, es_out = 2;  // element sizes in bytes
  int64_t groups = 0, m = 0, n = 0, k = 0, extent = 0;
  OpDesc a, b, c;
  const int* offs = nullptr;
  GemmSet primary, fallback;  // groups entries each
  int primary_on = 0;         // 0: every group goes to the fallback set
  int* err_flag = nullptr;    // device view of the host-mapped offs error flag
};

constexpr int kBuilderThreads = 256;

// Blocks for a builder that may zero up to `max_elems` output elements of `es` bytes:
// enough for a few 16-byte stores per thread, at most two per SM, at least one.
unsigned zero_blocks(int64_t max_elems, int es, int sm_count);

// Enqueues the argument builder of a packed launch (arguments + zero fill in one
// launch); returns the launch status (cudaGetLastError).
cudaError_t launch_packed_args(const PackedDesc& d, unsigned blocks, cudaStream_t stream);

// Enqueues the zero fill of the list form: the (m, n) region at c[i] of every entry of
// the set `z` (built on the host), outputs of `es` bytes per element.
cudaError_t launch_zero_fill(const GemmSet& z, int es, unsigned blocks, cudaStream_t stream);

}  // namespace gmm
