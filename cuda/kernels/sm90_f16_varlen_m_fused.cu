// groupmm's varlen-M kernels with fused epilogues, f16: the configurations of
// kernels/varlen/fused.cuh's list. sm_90a only (build/).
#include "kernels/varlen/fused.cuh"

namespace gmm {
GMM_KERNEL_LIST(sm90_f16_varlen_m_fused, GMM_VARLEN_FUSED_ENTRIES(cutlass::half_t, DType::F16))
}  // namespace gmm
