// groupmm's varlen-M kernels with fused epilogues, bf16: the configurations of
// kernels/varlen/fused.cuh's list. sm_90a only (build/).
#include "kernels/varlen/fused.cuh"

namespace gmm {
GMM_KERNEL_LIST(sm90_bf16_varlen_m_fused,
                GMM_VARLEN_FUSED_ENTRIES(cutlass::bfloat16_t, DType::BF16))
}  // namespace gmm
