// CUTLASS 2.x grouped GEMM, float16 inputs, float16 or float32 output (sm_80 class;
// also Hopper's fallback for misaligned groups and for float32 output).
#include "kernels/grouped_sm80.cuh"

namespace gmm {
GMM_SM80_16BIT_KERNELS(sm80_f16_grouped, cutlass::half_t, DType::F16)
}  // namespace gmm
