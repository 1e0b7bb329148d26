// groupmm's varlen-M kernel with gathered A rows (the MoE forward reading x through the
// routed-row index, no expert-ordered copy), bf16, cooperative 128 x 256 tiles (cp.async loads
// of A bound it: wide tiles gather each row once per 256 output columns), for weights of
// either major; used when GROUPMM_SM90_GATHER=1 (heuristics/choose.h). sm_90a only (build/).
#include "kernels/registry.h"
#include "kernels/varlen/launch.cuh"

namespace gmm {
namespace {
using namespace varlen;
std::string run_m_gather(const Args& x) {
  using T = cutlass::bfloat16_t;
  constexpr Schedule kCO = Schedule::Cooperative;
  return x.b_k_major ? run<Cfg<T, Mode::M, true, 256, kCO, true>>(x)
                     : run<Cfg<T, Mode::M, false, 256, kCO, true>>(x);
}
}  // namespace
GMM_KERNEL_LIST(sm90_bf16_varlen_m_gather, {Engine::kSm90Varlen,
                                            DType::BF16,
                                            DType::BF16,
                                            Sm90Tile::kNone,
                                            nullptr,
                                            nullptr,
                                            {Mode::M, Schedule::Cooperative, 256, true},
                                            run_m_gather})
}  // namespace gmm
