// What the epilogues of the varlen kernels share: the shape of an epilogue policy, the named
// barriers, the conversions and the staged 64-column stores of the fused epilogues. Device
// code (nvcc only), and the host's encoder of the fused epilogues' output maps.
//
// An epilogue policy (plain.cuh, swiglu.cuh, dgated.cuh) owns everything of one epilogue,
// derived from EpilogueBase<its Args> or FusedEpilogue (whose defaults it keeps or hides):
//   Args                 its argument block (<name>.h, plain C++: from(), the block read
//                        from Args::epi by position; given() and its can_read clause, which
//                        its registry entries ask); kEpi, its name and Config::epi
//   fits(mode, s, bn)    the configurations it runs in (Cfg asserts it)
//   Params               its kernel parameters (KernelParams::epi, config.cuh)
//   coop_chunks(bn)      the cooperative staging tile's chunk buffers (default: the tile)
//   Smem, init<C>(smem)  its shared memory (Smem::epi) and their set-up by every thread
//                        before the CTA's first barrier
//   kLoadsB, load_b<C>   B's k-block tiles when it reads B its own way (producer.cuh)
//   tensor_maps<C>       host, varlen-M: its tensor maps (D's, and B's when kLoadsB) and
//                        Params, from its Args block (launch.cuh)
//   store<C, kZeros>     a ping-pong warpgroup's tile to memory (kernel.cuh; kZeros: a tile
//                        with no k-blocks, exact zeros)
//   store_coop<C, kZeros> a cooperative warpgroup's 64 rows of the tile (where fits() allows)
//   CoopState, prefetch_coop<C>  a cooperative warpgroup's state across tiles (store_coop's
//                        last argument) and the hook before a tile's mainloop (default:
//                        nothing)
// Adding one: <name>.h and <name>.cuh here, and its lines in the list of the fused kernels
// (kernels/varlen/fused.cuh: its header and its configurations). Its name and operand order
// are its rule's (src/shape/product/epilogues.rs).
//
// Conversions go through the CUDA pair intrinsics: cutlass' scalar conversion is inline
// asm that makes ptxas serialise every wgmma of the kernel (warning C7514). Shared-memory
// offsets are explicit and the base opaque: CuTe's swizzled indexing per element made
// ptxas keep every address live across the tile loop and spill. An activation, a per-row
// scale or a second output (the fused epilogues) goes where `pack` converts a pair.
#pragma once
#include "kernels/varlen/scheduler.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "cutlass/arch/barrier.h"

namespace gmm::varlen {

// The defaults of an epilogue policy with argument block A (above): every configuration, no
// parameters or shared memory of its own, B read as the mainloop reads it.
template <class A>
struct EpilogueBase {
  using Args = A;
  static constexpr Epilogue kEpi = A::kEpi;
  static constexpr bool fits(Mode, Schedule, int) { return true; }
  // The cooperative staging tile's 64-column chunk buffers of BM rows (a tile of bn columns).
  static constexpr int coop_chunks(int bn) { return bn / 64; }
  struct Params {};
  struct Smem {};
  static constexpr bool kLoadsB = false;
  template <class C>
  __device__ __forceinline__ static void init(Smem&) {}
  struct CoopState {};
  template <class C, class S>
  __device__ __forceinline__ static void prefetch_coop(const typename C::Params&, const Tile&,
                                                       typename C::Smem&, int, int, S&) {}
};

// The fused epilogues' configuration: varlen-M, ping-pong 128 x 128 (a warpgroup's tile is
// 64 gate and 64 up columns for SwiGLU, B read as two 64-column halves, or 128 columns of p
// for DGated); SwiGLU, and DGated on gathered rows, also run cooperative 128 x 256 (their
// store_coop).
template <class A>
struct FusedEpilogue : EpilogueBase<A> {
  static constexpr bool fits(Mode mode, Schedule s, int bn) {
    return mode == Mode::M && s == Schedule::PingPong && bn == 128;
  }
};

// Named barriers (cutlass::arch::NamedBarrier ids, after CUTLASS's reserved ones): the
// consumer warpgroup cwg's own epilogue barrier is kEpilogueBar + cwg; ping-pong's mainloop
// turn of warpgroup cwg is kOrderBar + cwg.
constexpr int kEpilogueBar = 0;
constexpr int kOrderBar = 2;

template <class T>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// ---------------------------------------------------------------------------------------
// The fused epilogues of ping-pong 128 x 128 tiles (swiglu.cuh, dgated.cuh). Each writes up
// to two 64-column output chunks per stage through the warpgroup's two chunk buffers (BM
// rows x 128 bytes each, after the other warpgroup's): a stage first waits for all of the
// warpgroup's earlier stores to have read them (the epilogue runs under the other
// warpgroup's mainloop, which a 128 x 128 x K tile keeps busy for several microseconds, so
// the wait costs the tensor cores nothing). Fragment element i = 64 mb + 4 (8 j + jj) + 2 v1
// + v0 is at row 64 mb + 16 wq + lane/4 + 8 v1 and column 64 j + 8 jj + 2 (lane % 4) + v0 of
// the tile.

// The two chunk buffers of warpgroup cwg in the staging tile.
template <class C>
__device__ __forceinline__ unsigned char* chunk_buffers(typename C::Smem& smem, int cwg) {
  return reinterpret_cast<unsigned char*>(smem.d) + cwg * 2 * (C::BM * 128);
}

// The approximate reciprocal (MUFU.RCP; __frcp_rn's IEEE rounding is a dozen instructions
// more, and cost the cooperative SwiGLU kernel 5-9 %: its epilogue does not overlap a
// mainloop). 0 for x below about -88 (exp overflows), 1 above about 17.
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }

// Every fragment pair (mb, jj, v1) of a 64-column chunk.
template <class F>
__device__ __forceinline__ void each_pair(F&& f) {
  CUTE_UNROLL
  for (int mb = 0; mb < 2; ++mb) {
    CUTE_UNROLL
    for (int jj = 0; jj < 8; ++jj) {
      CUTE_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) f(mb, jj, v1);
    }
  }
}

// Rows row0 .. row0 + 63 of the tile (relative to its first row), 64 rows of 128 bytes at
// `buf`, to `map` (ragged over [m, F]) at column `col`.
__device__ __forceinline__ void store_rows(const CUtensorMap* map, const Tile& tile,
                                           const unsigned char* buf, int row0, int col) {
  const int r = big() - tile.len + (tile.m0 - tile.start) + row0;
  SM90_TMA_STORE_4D::copy(map, buf, col, r, big(), tile.start + tile.len);
}

// The tile's 128 rows of one 64-column chunk buffer to `map` (ragged over [m, F]) at `col`.
__device__ __forceinline__ void store_chunk(const CUtensorMap* map, const Tile& tile,
                                            const unsigned char* buf, int col) {
  store_rows(map, tile, buf, 0, col);
  store_rows(map, tile, buf + 64 * 128, 64, col);
}

// One stage: `fill(offset_of, slot)` writes the chunk values with st_pair(buffer, mb, jj, v1,
// value); then buffer 0 goes to (map0, col) and, when map1 is set, buffer 1 to (map1, col).
template <class Fill>
__device__ __forceinline__ void fused_stage(const Tile& tile, unsigned char* bufs, int cwg, int lt,
                                            const CUtensorMap* map0, const CUtensorMap* map1,
                                            int col, Fill&& fill) {
  constexpr int kBuf = 128 * 128;
  if (lt == 0) tma_store_wait<0>();
  cutlass::arch::NamedBarrier::sync(128, kEpilogueBar + cwg);
  const int lane = lt % 32, wq = lt / 32, sw = lane / 4;
  uint32_t base = cast_smem_ptr_to_uint(bufs) + uint32_t((wq * 16 + sw) * 128 + (lane % 4) * 4);
  asm volatile("" : "+r"(base));
  auto st = [&](int b, int mb, int jj, int v1, uint32_t v) {
    const uint32_t off = uint32_t(b * kBuf + (64 * mb + 8 * v1) * 128) + uint32_t((jj ^ sw) << 4);
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + off), "r"(v) : "memory");
  };
  fill(st);
  cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> the TMA unit
  cutlass::arch::NamedBarrier::sync(128, kEpilogueBar + cwg);
  if (lt == 0) {
    store_chunk(map0, tile, bufs, col);
    if (map1 != nullptr) store_chunk(map1, tile, bufs + kBuf, col);
    tma_store_arrive();
  }
}

// Host: the fused epilogues' outputs, the two F-column halves of d (row stride ldd) and act
// [T, F], as ragged maps.
inline std::string encode_halves(CUtensorMap* lo, CUtensorMap* hi, CUtensorMap* act,
                                 CUtensorMapDataType dt, const void* d, int64_t ldd,
                                 const void* act_base, int f, uint64_t es) {
  const char* dc = static_cast<const char*>(d);
  std::string err = encode_ragged(lo, dt, dc, f, ldd, 64, 64, "D gate half");
  if (err.empty()) err = encode_ragged(hi, dt, dc + f * es, f, ldd, 64, 64, "D up half");
  if (err.empty()) err = encode_ragged(act, dt, act_base, f, f, 64, 64, "act [T, F]");
  return err;
}

}  // namespace gmm::varlen
