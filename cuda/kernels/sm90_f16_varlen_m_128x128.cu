// groupmm's varlen-M kernel (GroupedM: forward and dX), f16, 128 x 128 tiles, for weights of
// either major. Compiled only for sm_90a (build.rs). See kernels/varlen_sm90.cuh.
#include "kernels/registry.h"
#include "kernels/varlen_sm90.cuh"

namespace gmm {
namespace {
std::string run_m(const varlen::Args& x) {
  using T = cutlass::half_t;
  return x.b_k_major ? varlen::run<varlen::Cfg<T, varlen::Mode::M, true, 128>>(x)
                     : varlen::run<varlen::Cfg<T, varlen::Mode::M, false, 128>>(x);
}
}  // namespace
GMM_KERNEL_LIST(sm90_f16_varlen_m_128x128,
                {Engine::kSm90Varlen, DType::F16, DType::F16, "varlen_m", nullptr, nullptr, run_m})
}  // namespace gmm
