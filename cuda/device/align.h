// The one 16-byte alignment rule, shared by the host routing (cuda/host/packed.cc proves
// it for every group at once, cuda/host/list.cc checks it per group) and the device
// argument builder (cuda/device/args.cu, per group of a packed call).
//
// A group may run on the primary kernels (the sm_90a TMA kernels, or CUTLASS 2.x's
// vectorised multistage ones) only when each of its operands has a 16-byte aligned base,
// a leading dimension and a contiguous extent that are multiples of 16 bytes: TMA's rule,
// and what CUTLASS's can_implement checks for host shapes. Every other group runs on the
// any-alignment fallback.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define GMM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define GMM_HOST_DEVICE inline
#endif

namespace gmm {

// True when `bytes` (an address or a byte distance) is a multiple of 16.
GMM_HOST_DEVICE bool is16(int64_t bytes) { return bytes % 16 == 0; }

// The rule for one operand of one group: base address `p`, leading dimension `ld` and
// contiguous extent `contig` (elements of `es` bytes).
GMM_HOST_DEVICE bool aligned16(uintptr_t p, int64_t ld, int64_t contig, int es) {
  return p % 16 == 0 && is16(ld * es) && is16(contig * es);
}

}  // namespace gmm
