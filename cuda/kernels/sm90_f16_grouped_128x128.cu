// sm_90a ptr-array grouped GEMM, f16 in and out, 4 A/B layouts: 128x128x64 cooperative, cluster
// 1x1x1. Compiled for sm_90a only (build/: the sm90_ prefix); picked by cuda/heuristics/choose.cc
// as configuration "128x128" (or GROUPMM_SM90_CONFIG=128x128).
#include "kernels/grouped_sm90.cuh"

namespace gmm {
GMM_SM90_KERNEL(sm90_f16_grouped_128x128, cutlass::half_t, DType::F16, Sm90Tile::k128x128,
                Sm90Cfg128x128,
                "CUTLASS 3.x sm90 grouped (fp16, 128x128x64 cooperative, cluster 1x1x1)")
}  // namespace gmm
