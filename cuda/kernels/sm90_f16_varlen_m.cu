// groupmm's varlen-M kernels (GroupedM: forward and dX), f16, for weights of either major:
// ping-pong 128x128 and 128x192 (the heuristic's choices). sm_90a only (build/). See
// kernels/varlen/args.h.
#include "kernels/varlen/entries.cuh"

namespace gmm {
using namespace varlen;
using T = cutlass::half_t;
GMM_KERNEL_LIST(sm90_f16_varlen_m, (entry<T, DType::F16, Mode::M, 128, Schedule::PingPong>()),
                (entry<T, DType::F16, Mode::M, 192, Schedule::PingPong>()))
}  // namespace gmm
