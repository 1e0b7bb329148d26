// groupmm's varlen-M kernels (GroupedM: forward and dX), bf16, for weights of either major:
// ping-pong 128x128 and 128x192 (the heuristic's choices). sm_90a only (build/). See
// kernels/varlen/args.h.
#include "kernels/varlen/entries.cuh"

namespace gmm {
using namespace varlen;
using T = cutlass::bfloat16_t;
GMM_KERNEL_LIST(sm90_bf16_varlen_m, (entry<T, DType::BF16, Mode::M, 128, Schedule::PingPong>()),
                (entry<T, DType::BF16, Mode::M, 192, Schedule::PingPong>()))
}  // namespace gmm
