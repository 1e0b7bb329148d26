// The sm90 varlen kernel configurations that only a development build's GROUPMM_SM90_*
// overrides reach (cuda/heuristics/choose.h), bf16: compiled with GROUPMM_DEV_KNOBS=1 only
// (build/main.rs), for kernel tuning and the tests that compare each configuration with the
// rule's. sm_90a only (build/).
#include "kernels/varlen/entries.cuh"
#include "kernels/varlen/epilogue/dgated.cuh"
#include "kernels/varlen/epilogue/swiglu.cuh"

namespace gmm {
using namespace varlen;
using T = cutlass::bfloat16_t;
GMM_KERNEL_LIST(
    sm90_bf16_varlen_dev,
    // GROUPMM_SM90_VARLEN_CONFIG=co128 / co192
    (entry<T, DType::BF16, Mode::M, 128, Schedule::Cooperative>()),
    (entry<T, DType::BF16, Mode::K, 192, Schedule::Cooperative>()),
    // GROUPMM_SM90_GATHER_K=co192 / pp128
    (entry<T, DType::BF16, Mode::K, 192, Schedule::Cooperative, Gather::A>()),
    (entry<T, DType::BF16, Mode::K, 192, Schedule::Cooperative, Gather::B>()),
    (entry<T, DType::BF16, Mode::K, 128, Schedule::PingPong, Gather::A>()),
    (entry<T, DType::BF16, Mode::K, 128, Schedule::PingPong, Gather::B>()),
    // GROUPMM_SM90_SWIGLU=pp128, GROUPMM_SM90_DGATED=pp128
    (entry<T, DType::BF16, Mode::M, 128, Schedule::PingPong, Gather::None, SwigluEpi>()),
    (entry<T, DType::BF16, Mode::M, 128, Schedule::PingPong, Gather::A, SwigluEpi>()),
    (entry<T, DType::BF16, Mode::M, 128, Schedule::PingPong, Gather::A, DgatedEpi>()))
}  // namespace gmm
