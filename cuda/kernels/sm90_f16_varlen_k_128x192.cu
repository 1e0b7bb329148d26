// groupmm's varlen-K kernel (GroupedK: dW), f16, 128 x 192 tiles. Compiled only for sm_90a
// (build.rs). See kernels/varlen_sm90.cuh.
#include "kernels/registry.h"
#include "kernels/varlen_sm90.cuh"

namespace gmm {
namespace {
std::string run_k(const varlen::Args& x) {
  return varlen::run<varlen::Cfg<cutlass::half_t, varlen::Mode::K, false, 192>>(x);
}
}  // namespace
GMM_KERNEL_LIST(sm90_f16_varlen_k_128x192,
                {Engine::kSm90Varlen, DType::F16, DType::F16, "varlen_k", nullptr, nullptr, run_k})
}  // namespace gmm
