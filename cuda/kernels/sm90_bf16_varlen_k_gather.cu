// groupmm's varlen-K kernels with one operand's token rows gathered through the routed-row
// index (kernels/varlen/args.h), bf16: the MoE block's weight gradients x[src]^T dH (Gather::A)
// and act^T dY[src] (Gather::B) without an expert-ordered [R, cols] copy of x or dY.
// Cooperative 128x256 (cuda/heuristics/choose.cc). sm_90a only (build/).
#include "kernels/varlen/entries.cuh"

namespace gmm {
using namespace varlen;
using T = cutlass::bfloat16_t;
GMM_KERNEL_LIST(sm90_bf16_varlen_k_gather,
                (entry<T, DType::BF16, Mode::K, 256, Schedule::Cooperative, Gather::A>()),
                (entry<T, DType::BF16, Mode::K, 256, Schedule::Cooperative, Gather::B>()))
}  // namespace gmm
