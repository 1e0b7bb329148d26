// sm_90a ptr-array grouped GEMM, bf16 in and out, 4 A/B layouts: 64x128x128 ping-pong, cluster
// 1x1x1. Compiled for sm_90a only (build/: the sm90_ prefix); picked by cuda/heuristics/choose.cc
// as configuration "ping64x128" (or GROUPMM_SM90_CONFIG=ping64x128).
#include "kernels/grouped_sm90.cuh"

namespace gmm {
GMM_SM90_KERNEL(sm90_bf16_grouped_ping64x128, cutlass::bfloat16_t, DType::BF16,
                Sm90Tile::kPing64x128, Sm90CfgPing64x128,
                "CUTLASS 3.x sm90 grouped (bf16, 64x128x128 ping-pong, cluster 1x1x1)")
}  // namespace gmm
