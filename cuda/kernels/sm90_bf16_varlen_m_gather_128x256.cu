// groupmm's varlen-M kernel with gathered A rows (the MoE forward reading x through the
// routing's row index, no expert-ordered copy), bf16, 128 x 256 tiles (cp.async loads of A
// bound it: wide tiles gather each row once per 256 output columns), for weights of either
// major; used when GROUPMM_SM90_GATHER=1 (heuristics/sm90.h). sm_90a only (build.rs).
#include "kernels/registry.h"
#include "kernels/varlen_sm90.cuh"

namespace gmm {
namespace {
std::string run_m_gather(const varlen::Args& x) {
  using T = cutlass::bfloat16_t;
  return x.b_k_major ? varlen::run<varlen::Cfg<T, varlen::Mode::M, true, 256, true>>(x)
                     : varlen::run<varlen::Cfg<T, varlen::Mode::M, false, 256, true>>(x);
}
}  // namespace
GMM_KERNEL_LIST(sm90_bf16_varlen_m_gather_128x256,
                {Engine::kSm90Varlen, DType::BF16, DType::BF16, "varlen_m_gather", nullptr, nullptr, run_m_gather})
}  // namespace gmm
