// CUTLASS 2.x grouped GEMM, bfloat16 inputs, bfloat16 or float32 output (sm_80 class;
// also Hopper's fallback for misaligned groups and for float32 output).
#include "grouped_sm80.cuh"

namespace gmm {
std::string sm80_bf16_run(int out_dtype, int combo, bool aligned8, const GemmSet& s,
                          const RunCtx& ctx) {
  return run_family16<cutlass::bfloat16_t>(out_dtype, combo, aligned8, s, ctx, out_dtype != 2);
}
}  // namespace gmm
