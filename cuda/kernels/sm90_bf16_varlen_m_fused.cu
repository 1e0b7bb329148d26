// groupmm's varlen-M kernels with fused epilogues (kernels/varlen/args.h), bf16, for weights
// of either major, ping-pong 128x128: SwiGLU (the routed expert block's up projection, on
// packed rows or rows gathered through an index) and DGated (its down projection's
// backward). sm_90a only (build/).
#include "kernels/varlen/entries.cuh"

namespace gmm {
using namespace varlen;
using T = cutlass::bfloat16_t;
GMM_KERNEL_LIST(
    sm90_bf16_varlen_m_fused,
    (entry<T, DType::BF16, Mode::M, 128, Schedule::PingPong, false, Epilogue::SwiGLU>()),
    (entry<T, DType::BF16, Mode::M, 128, Schedule::PingPong, true, Epilogue::SwiGLU>()),
    (entry<T, DType::BF16, Mode::M, 128, Schedule::PingPong, false, Epilogue::DGated>()))
}  // namespace gmm
