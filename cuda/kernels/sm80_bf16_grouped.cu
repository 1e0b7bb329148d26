// CUTLASS 2.x grouped GEMM, bfloat16 inputs, bfloat16 or float32 output (sm_80 class;
// also Hopper's fallback for misaligned groups and for float32 output).
#include "kernels/grouped_sm80.cuh"

namespace gmm {
GMM_SM80_16BIT_KERNELS(sm80_bf16_grouped, cutlass::bfloat16_t, DType::BF16)
}  // namespace gmm
