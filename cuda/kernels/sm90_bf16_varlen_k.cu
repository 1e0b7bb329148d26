// groupmm's varlen-K kernel (GroupedK: dW), bf16: ping-pong 128x192 (the heuristic's
// choice). sm_90a only (build/). See kernels/varlen/args.h.
#include "kernels/varlen/entries.cuh"

namespace gmm {
using namespace varlen;
using T = cutlass::bfloat16_t;
GMM_KERNEL_LIST(sm90_bf16_varlen_k, (entry<T, DType::BF16, Mode::K, 192, Schedule::PingPong>()))
}  // namespace gmm
