// sm_90a ptr-array grouped GEMM, bf16 in and out, 4 A/B layouts: 128x256x64 cooperative, cluster
// 2x1x1 (large experts). Compiled for sm_90a only (build/: the sm90_ prefix); picked by
// cuda/heuristics/choose.cc as configuration "128x256" (or GROUPMM_SM90_CONFIG=128x256).
#include "kernels/grouped_sm90.cuh"

namespace gmm {
GMM_SM90_KERNEL(sm90_bf16_grouped_128x256, cutlass::bfloat16_t, DType::BF16, Sm90Tile::k128x256,
                Sm90Cfg128x256, "CUTLASS 3.x sm90 grouped (bf16, 128x256x64)")
}  // namespace gmm
