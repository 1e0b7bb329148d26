// groupmm's varlen-K kernels (GroupedK: dW), f16: ping-pong 128x192 (the heuristic's
// choice) and cooperative 128x192 (for GROUPMM_SM90_VARLEN_CONFIG). sm_90a only (build/).
// See kernels/varlen/args.h.
#include "kernels/varlen/entries.cuh"

namespace gmm {
using namespace varlen;
using T = cutlass::half_t;
GMM_KERNEL_LIST(sm90_f16_varlen_k, (entry<T, DType::F16, Mode::K, 192, Schedule::PingPong>()),
                (entry<T, DType::F16, Mode::K, 192, Schedule::Cooperative>()))
}  // namespace gmm
