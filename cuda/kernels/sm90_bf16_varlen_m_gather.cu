// groupmm's varlen-M kernel with gathered A rows (the MoE forward reading x through the
// routed-row index, no expert-ordered copy), bf16, cooperative 128 x 256 tiles (cp.async loads
// of A bound it: wide tiles gather each row once per 256 output columns), for weights of
// either major; used when GROUPMM_SM90_GATHER=1 (heuristics/choose.h). sm_90a only (build/).
#include "kernels/varlen/entries.cuh"

namespace gmm {
using namespace varlen;
GMM_KERNEL_LIST(
    sm90_bf16_varlen_m_gather,
    (entry<cutlass::bfloat16_t, DType::BF16, Mode::M, 256, Schedule::Cooperative, Gather::A>()))
}  // namespace gmm
