// sm_90a ptr-array grouped GEMM, bf16 in and out, 4 A/B layouts: 128x128x64 cooperative, cluster 1x1x1.
// Compiled only for sm_90a (build.rs); dispatched from sm90_bf16_grouped.cu.
#include "grouped_sm90.cuh"

namespace gmm {
GMM_SM90_DEFINE(bf16, 128x128, cutlass::bfloat16_t, Sm90Cfg128x128, "CUTLASS 3.x sm90 grouped (bf16, 128x128x64 cooperative, cluster 1x1x1)")
}  // namespace gmm
