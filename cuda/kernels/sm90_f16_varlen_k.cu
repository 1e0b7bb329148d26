// groupmm's varlen-K kernel (GroupedK: dW), f16: ping-pong 128x192 (the heuristic's
// choice). sm_90a only (build/). See kernels/varlen/args.h.
#include "kernels/varlen/entries.cuh"

namespace gmm {
using namespace varlen;
using T = cutlass::half_t;
GMM_KERNEL_LIST(sm90_f16_varlen_k, (entry<T, DType::F16, Mode::K, 192, Schedule::PingPong>()))
}  // namespace gmm
