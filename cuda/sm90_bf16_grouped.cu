// sm_90a ptr-array grouped GEMM, bf16 in and out, for the 4 A/B layout combinations.
// Compiled only for sm_90a (build.rs). This file holds the 128x256x64 cooperative family
// and the dispatch over configurations; the other families are in
// sm90_bf16_grouped_<config>.cu (compiled in parallel).
#include "grouped_sm90.cuh"

namespace gmm {
size_t sm90_bf16_workspace_bytes(int config, int combo, int64_t count, int sm_count) {
  switch (config) {
    case kSm90Tile128x128: return sm90_bf16_128x128_workspace_bytes(combo, count, sm_count);
    case kSm90Ping64x128: return sm90_bf16_ping64x128_workspace_bytes(combo, count, sm_count);
    default:
      return Sm90Family<cutlass::bfloat16_t, Sm90Cfg128x256>::workspace_bytes(combo, count, sm_count);
  }
}
std::string sm90_bf16_run(int config, int combo, const GemmSet& s, const RunCtx& ctx) {
  switch (config) {
    case kSm90Tile128x256:
      return Sm90Family<cutlass::bfloat16_t, Sm90Cfg128x256>::run(combo, s, ctx,
                                                  "CUTLASS 3.x sm90 grouped (bf16, 128x256x64)");
    case kSm90Tile128x128: return sm90_bf16_128x128_run(combo, s, ctx);
    case kSm90Ping64x128: return sm90_bf16_ping64x128_run(combo, s, ctx);
    default:
      return "sm90 grouped (bf16): unknown tile configuration " + std::to_string(config);
  }
}
}  // namespace gmm
