// groupmm's varlen-M kernels with fused epilogues (kernels/varlen/args.h), f16, for weights
// of either major: SwiGLU (the routed expert block's up projection, on packed rows or rows
// gathered through an index; cooperative 128x256), DGated (its down projection's backward,
// on packed rows of dY, ping-pong 128x128, or rows gathered through the index, cooperative
// 128x256) and, ping-pong 128x128, RowScale. sm_90a only (build/).
#include "kernels/varlen/entries.cuh"
#include "kernels/varlen/epilogue/dgated.cuh"
#include "kernels/varlen/epilogue/rowscale.cuh"
#include "kernels/varlen/epilogue/swiglu.cuh"

namespace gmm {
using namespace varlen;
using T = cutlass::half_t;
GMM_KERNEL_LIST(
    sm90_f16_varlen_m_fused,
    (entry<T, DType::F16, Mode::M, 256, Schedule::Cooperative, Gather::None, SwigluEpi>()),
    (entry<T, DType::F16, Mode::M, 256, Schedule::Cooperative, Gather::A, SwigluEpi>()),
    (entry<T, DType::F16, Mode::M, 128, Schedule::PingPong, Gather::None, DgatedEpi>()),
    (entry<T, DType::F16, Mode::M, 256, Schedule::Cooperative, Gather::A, DgatedEpi>()),
    (entry<T, DType::F16, Mode::M, 128, Schedule::PingPong, Gather::None, RowScaleEpi>()))
}  // namespace gmm
