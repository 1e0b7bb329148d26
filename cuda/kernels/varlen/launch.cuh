// The host side of the varlen kernels: the tensor maps, encoded once per call (the
// encoders: config.cuh; the epilogue's maps: its policy, epilogue/), and the persistent
// launch. Included by the kernel files (kernels/sm90_*_varlen_*.cu) only.
#pragma once
#include "kernels/varlen/kernel.cuh"

#include <string>

namespace gmm::varlen {

template <class C>
std::string run(const Args& x) {
  using T = typename C::T;
  using Epi = typename C::Epi;
  constexpr uint64_t es = sizeof(T);
  const CUtensorMapDataType dt = std::is_same_v<T, cutlass::bfloat16_t>
                                     ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                     : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  if (x.m == 0 || x.n == 0 || (C::kMode == Mode::K && x.groups == 0)) return "";  // empty output
  typename C::Params p{};
  p.offs = x.offs;
  p.groups = x.groups;
  p.m = x.m;
  p.n = x.n;
  p.k = x.k;
  p.err_flag = x.err_flag;
  std::string err;
  p.gathered = C::kGatherOp == Gather::B ? x.b : x.a;
  p.gathered_ld = C::kGatherOp == Gather::B ? x.ldb : x.lda;
  p.src = x.src;
  p.gathered_rows = int(x.gathered_rows);
  if constexpr (C::kMode == Mode::M) {
    if constexpr (!C::kGather) {
      const uint64_t da[2] = {extent(x.k), extent(x.m)}, sa[1] = {uint64_t(x.lda) * es};
      const uint32_t ba[2] = {C::BK, C::BM};
      err = encode(&p.tma_a, dt, 2, x.a, da, sa, ba, "A [T, K]");
    }
    if (err.empty() && !Epi::kLoadsB) {
      const uint64_t sb[2] = {uint64_t(x.ldb) * es, uint64_t(x.ldb_batch) * es};
      if constexpr (C::kBKMajor) {
        const uint64_t db[3] = {extent(x.k), extent(x.n), extent(x.groups)};
        const uint32_t bb[3] = {C::BK, C::BN, 1};
        err = encode(&p.tma_b, dt, 3, x.b, db, sb, bb, "B [G, N, K] (K-major)");
      } else {
        const uint64_t db[3] = {extent(x.n), extent(x.k), extent(x.groups)};
        const uint32_t bb[3] = {64, C::BK, 1};
        err = encode(&p.tma_b, dt, 3, x.b, db, sb, bb, "B [G, K, N] (N-major)");
      }
    }
    // D's maps (and B's, kLoadsB) and the epilogue's own
    if (err.empty()) err = Epi::template tensor_maps<C>(p, x, dt);
  } else {
    // A gathered operand is read by the producer warpgroup (no map).
    if (C::kGatherOp != Gather::A)
      err = encode_ragged(&p.tma_a, dt, x.a, x.m, x.lda, 64, C::BK, "A = x^T (ragged)");
    if (err.empty() && C::kGatherOp != Gather::B)
      err = encode_ragged(&p.tma_b, dt, x.b, x.n, x.ldb, 64, C::BK, "B = dY (ragged)");
    if (err.empty()) {
      const uint64_t dd[3] = {extent(x.n), extent(x.m), extent(x.groups)};
      const uint64_t sd[2] = {uint64_t(x.ldd) * es, uint64_t(x.ldd_batch) * es};
      const uint32_t bd[3] = {64, 64, 1};
      err = encode(&p.tma_d, dt, 3, x.d, dd, sd, bd, "D [G, M, N]");
    }
  }
  if (!err.empty()) return err;
  // The dynamic shared memory limit holds per device for the process: set it once.
  static unsigned long long attr_set = 0;  // bit d: device d
  const unsigned long long bit = 1ull << (x.device & 63);
  if (x.device > 63 || !(__atomic_load_n(&attr_set, __ATOMIC_ACQUIRE) & bit)) {
    const cudaError_t e = cudaFuncSetAttribute(
        varlen_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
    if (e != cudaSuccess)
      return std::string("cudaFuncSetAttribute (varlen kernel): ") + cudaGetErrorString(e);
    __atomic_fetch_or(&attr_set, bit, __ATOMIC_RELEASE);
  }
  // Persistent grid: one CTA per SM, or one per tile when there are fewer (an upper bound:
  // the tile count itself needs offs, which only the device reads).
  const int64_t n_tiles = (x.n + C::BN - 1) / C::BN;
  const int64_t max_tiles = C::kMode == Mode::M
                                ? (int64_t(x.m) / C::BM + x.groups + 1) * n_tiles
                                : int64_t(x.groups) * ((x.m + C::BM - 1) / C::BM) * n_tiles;
  const int grid = int(max_tiles < x.sm_count ? (max_tiles > 0 ? max_tiles : 1) : x.sm_count);
  varlen_kernel<C><<<grid, C::kThreads, C::kSmemBytes, x.stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return std::string("varlen kernel launch: ") + cudaGetErrorString(e);
  return "";
}

}  // namespace gmm::varlen
