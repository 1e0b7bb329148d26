// sm_90a ptr-array grouped GEMM, bf16 in and out, 4 A/B layouts: 64x128x128 ping-pong, cluster 1x1x1.
// Compiled only for sm_90a (build.rs); dispatched from sm90_bf16_grouped.cu.
#include "grouped_sm90.cuh"

namespace gmm {
GMM_SM90_DEFINE(bf16, ping64x128, cutlass::bfloat16_t, Sm90CfgPing64x128, "CUTLASS 3.x sm90 grouped (bf16, 64x128x128 ping-pong, cluster 1x1x1)")
}  // namespace gmm
