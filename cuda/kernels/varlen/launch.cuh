// The host side of the varlen kernels: the tensor maps, encoded once per call, and the
// persistent launch. Included by the kernel files (kernels/sm90_*_varlen_*.cu) only.
//
// The ragged maps (the trick of Triton's tools/ragged_tma.py and quack): a 2-D [rows, C]
// tensor with row stride s is described as 4-D (C, 2^30, 2^31-1, 2^31-1) with strides
// (s, 2^34 - s, s) elements. Coordinates (c, 2^30 - len + r, 2^30, start + len) address
// row start + r (the 2^30 * 2^34 term wraps to 0 modulo 2^64) and the bound 2^30 of the
// second one cuts every row r >= len: loads read zeros there and stores skip it.
#pragma once
#include "kernels/varlen/kernel.cuh"

#include <string>

namespace gmm::varlen {

inline std::string encode(CUtensorMap* map, CUtensorMapDataType dt, int rank, const void* base,
                          const uint64_t* dims, const uint64_t* strides_bytes, const uint32_t* box,
                          const char* what) {
  const cuuint32_t unit[5] = {1, 1, 1, 1, 1};
  const CUresult r = cuTensorMapEncodeTiled(
      map, dt, cuuint32_t(rank), const_cast<void*>(base), reinterpret_cast<const cuuint64_t*>(dims),
      reinterpret_cast<const cuuint64_t*>(strides_bytes), reinterpret_cast<const cuuint32_t*>(box),
      unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return std::string("cuTensorMapEncodeTiled (") + what + ") failed with CUresult " +
           std::to_string(int(r));
  }
  return "";
}

// A ragged 4-D map over a 2-D [rows, cols] operand with row stride s (elements).
inline std::string encode_ragged(CUtensorMap* map, CUtensorMapDataType dt, const void* base,
                                 int cols, int64_t s, uint32_t box_cols, uint32_t box_rows,
                                 const char* what) {
  const uint64_t es = 2, u = uint64_t(s);
  const uint64_t dims[4] = {uint64_t(cols > 0 ? cols : 1), uint64_t(big()), 0x7fffffffull,
                            0x7fffffffull};
  const uint64_t str[3] = {u * es, ((uint64_t(1) << 34) - u) * es, u * es};
  const uint32_t box[4] = {box_cols, box_rows, 1, 1};
  return encode(map, dt, 4, base, dims, str, box, what);
}

template <class C>
std::string run(const Args& x) {
  using T = typename C::T;
  constexpr uint64_t es = sizeof(T);
  const CUtensorMapDataType dt = std::is_same_v<T, cutlass::bfloat16_t>
                                     ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                     : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  if (x.m == 0 || x.n == 0 || (C::kMode == Mode::K && x.groups == 0)) return "";  // empty output
  Params p{};
  p.offs = x.offs;
  p.groups = x.groups;
  p.m = x.m;
  p.n = x.n;
  p.k = x.k;
  p.err_flag = x.err_flag;
  auto d1 = [](int64_t v) { return uint64_t(v > 0 ? v : 1); };  // extents never read stay legal
  std::string err;
  p.gathered = C::kGatherOp == Gather::B ? x.b : x.a;
  p.gathered_ld = C::kGatherOp == Gather::B ? x.ldb : x.lda;
  p.src = x.src;
  p.gathered_rows = int(x.gathered_rows);
  if constexpr (C::kMode == Mode::M) {
    if constexpr (!C::kGather) {
      const uint64_t da[2] = {d1(x.k), d1(x.m)}, sa[1] = {uint64_t(x.lda) * es};
      const uint32_t ba[2] = {C::BK, C::BM};
      err = encode(&p.tma_a, dt, 2, x.a, da, sa, ba, "A [T, K]");
    }
    if (err.empty() && C::kEpi == Epilogue::SwiGLU) {
      // B's gate and up halves, F columns each, read 64 columns at a time.
      const int64_t f = x.n / 2;
      const uint64_t sb[2] = {uint64_t(x.ldb) * es, uint64_t(x.ldb_batch) * es};
      const char* b = static_cast<const char*>(x.b);
      const char* up = b + (C::kBKMajor ? f * x.ldb : f) * int64_t(es);
      if constexpr (C::kBKMajor) {
        const uint64_t db[3] = {d1(x.k), d1(f), d1(x.groups)};
        const uint32_t bb[3] = {C::BK, 64, 1};
        err = encode(&p.tma_b, dt, 3, b, db, sb, bb, "B gate half [G, F, K] (K-major)");
        if (err.empty()) err = encode(&p.tma_b2, dt, 3, up, db, sb, bb, "B up half (K-major)");
      } else {
        const uint64_t db[3] = {d1(f), d1(x.k), d1(x.groups)};
        const uint32_t bb[3] = {64, C::BK, 1};
        err = encode(&p.tma_b, dt, 3, b, db, sb, bb, "B gate half [G, K, F] (N-major)");
        if (err.empty()) err = encode(&p.tma_b2, dt, 3, up, db, sb, bb, "B up half (N-major)");
      }
    } else if (err.empty()) {
      const uint64_t sb[2] = {uint64_t(x.ldb) * es, uint64_t(x.ldb_batch) * es};
      if constexpr (C::kBKMajor) {
        const uint64_t db[3] = {d1(x.k), d1(x.n), d1(x.groups)};
        const uint32_t bb[3] = {C::BK, C::BN, 1};
        err = encode(&p.tma_b, dt, 3, x.b, db, sb, bb, "B [G, N, K] (K-major)");
      } else {
        const uint64_t db[3] = {d1(x.n), d1(x.k), d1(x.groups)};
        const uint32_t bb[3] = {64, C::BK, 1};
        err = encode(&p.tma_b, dt, 3, x.b, db, sb, bb, "B [G, K, N] (N-major)");
      }
    }
    if constexpr (C::kEpi == Epilogue::Plain) {
      if (err.empty())
        err = encode_ragged(&p.tma_d, dt, x.d, x.n, x.ldd, 64, 64, "D [T, N] (ragged)");
    } else {
      // The two F-column halves of d (SwiGLU: pre; DGated: dpre) and act [T, F].
      const int f = C::kEpi == Epilogue::SwiGLU ? x.n / 2 : x.n;
      p.f = f;
      p.pre = x.pre;
      p.scale = x.scale;
      p.partial = x.partial;
      const char* d = static_cast<const char*>(x.d);
      if (err.empty()) err = encode_ragged(&p.tma_d, dt, d, f, x.ldd, 64, 64, "D gate half");
      if (err.empty())
        err = encode_ragged(&p.tma_d2, dt, d + f * es, f, x.ldd, 64, 64, "D up half");
      if (err.empty()) err = encode_ragged(&p.tma_act, dt, x.act, f, f, 64, 64, "act [T, F]");
      if (C::kEpi == Epilogue::DGated) {
        const char* pre = static_cast<const char*>(x.pre);
        if (err.empty()) err = encode_ragged(&p.tma_pre, dt, pre, f, 2 * f, 64, 64, "pre gate");
        if (err.empty())
          err = encode_ragged(&p.tma_pre2, dt, pre + f * es, f, 2 * f, 64, 64, "pre up");
      }
    }
  } else {
    // A gathered operand is read by the producer warpgroup (no map).
    if (C::kGatherOp != Gather::A)
      err = encode_ragged(&p.tma_a, dt, x.a, x.m, x.lda, 64, C::BK, "A = x^T (ragged)");
    if (err.empty() && C::kGatherOp != Gather::B)
      err = encode_ragged(&p.tma_b, dt, x.b, x.n, x.ldb, 64, C::BK, "B = dY (ragged)");
    if (err.empty()) {
      const uint64_t dd[3] = {d1(x.n), d1(x.m), d1(x.groups)};
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
