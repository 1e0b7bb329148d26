// groupmm's varlen-M kernels (GroupedM: forward and dX), f16, for weights of either major:
// ping-pong 128x128 and 128x192 (the heuristic's choices) and cooperative 128x128 (for
// GROUPMM_SM90_VARLEN_CONFIG). sm_90a only (build/). See kernels/varlen/args.h.
#include "kernels/registry.h"
#include "kernels/varlen/launch.cuh"

namespace gmm {
namespace {
using namespace varlen;
template <int BN, Schedule S>
std::string run_m(const Args& x) {
  using T = cutlass::half_t;
  return x.b_k_major ? run<Cfg<T, Mode::M, true, BN, S>>(x) : run<Cfg<T, Mode::M, false, BN, S>>(x);
}
constexpr Schedule kPP = Schedule::PingPong, kCO = Schedule::Cooperative;
}  // namespace
GMM_KERNEL_LIST(sm90_f16_varlen_m,
                {Engine::kSm90Varlen,
                 DType::F16,
                 DType::F16,
                 Sm90Tile::kNone,
                 nullptr,
                 nullptr,
                 {Mode::M, kPP, 128, false},
                 run_m<128, kPP>},
                {Engine::kSm90Varlen,
                 DType::F16,
                 DType::F16,
                 Sm90Tile::kNone,
                 nullptr,
                 nullptr,
                 {Mode::M, kPP, 192, false},
                 run_m<192, kPP>},
                {Engine::kSm90Varlen,
                 DType::F16,
                 DType::F16,
                 Sm90Tile::kNone,
                 nullptr,
                 nullptr,
                 {Mode::M, kCO, 128, false},
                 run_m<128, kCO>})
}  // namespace gmm
