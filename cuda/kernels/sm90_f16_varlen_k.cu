// groupmm's varlen-K kernels (GroupedK: dW), f16: ping-pong 128x192 (the heuristic's
// choice) and cooperative 128x192 (for GROUPMM_SM90_VARLEN_CONFIG). sm_90a only (build/).
// See kernels/varlen/args.h.
#include "kernels/registry.h"
#include "kernels/varlen/launch.cuh"

namespace gmm {
namespace {
using namespace varlen;
template <int BN, Schedule S>
std::string run_k(const Args& x) {
  return run<Cfg<cutlass::half_t, Mode::K, false, BN, S>>(x);
}
constexpr Schedule kPP = Schedule::PingPong, kCO = Schedule::Cooperative;
}  // namespace
GMM_KERNEL_LIST(sm90_f16_varlen_k,
                {Engine::kSm90Varlen,
                 DType::F16,
                 DType::F16,
                 Sm90Tile::kNone,
                 nullptr,
                 nullptr,
                 {Mode::K, kPP, 192, false},
                 run_k<192, kPP>},
                {Engine::kSm90Varlen,
                 DType::F16,
                 DType::F16,
                 Sm90Tile::kNone,
                 nullptr,
                 nullptr,
                 {Mode::K, kCO, 192, false},
                 run_k<192, kCO>})
}  // namespace gmm
