// The varlen kernel: groupmm's own persistent, warp-specialized sm_90a grouped GEMM for
// MoE-packed operands. Device code (nvcc only).
//
// - ONE TMA descriptor per operand for the whole call, encoded on the host (launch.cuh):
//   a tile of group g addresses its rows by coordinate, so nothing is rewritten or fenced
//   when a CTA moves to another group (unlike CUTLASS's ptr-array kernels).
// - offs is read by the GEMM itself (scheduler.cuh); one warp validates it into the
//   deferred error flag. Rows past offs[G-1] (varlen-M) and empty groups (varlen-K) get
//   exact zeros from the same kernel.
// - Persistent CTAs (one per SM): a producer warpgroup (producer.cuh) fills a ring of
//   `kStages` stages; two consumer warpgroups run wgmma (mainloop.cuh) and the epilogue
//   (C::Epi, a policy of epilogue/), in one of two schedules:
//   Cooperative: both on one 128 x BN tile, 64 rows each.
//   PingPong: tiles alternate between the warpgroups. A warpgroup starts a tile's
//     mainloop when the other has issued the last wgmma of its previous tile (named
//     barrier kOrderBar + cwg), and hands over the same way, so one warpgroup's epilogue
//     runs under the other's mainloop. Each warpgroup walks every tile of the CTA and
//     skips the other's k-blocks in the ring (it never waits on a stage more than one lap
//     ahead of the producer: the other warpgroup has waited on every stage before it).
#pragma once
#include "kernels/varlen/epilogue/plain.cuh"
#include "kernels/varlen/mainloop.cuh"
#include "kernels/varlen/producer.cuh"

#include "cutlass/arch/reg_reconfig.h"

namespace gmm::varlen {

// The epilogue policy's store_coop (plain, SwiGLU and DGated at 128 x 256: their fits()),
// after its prefetch_coop, called before each tile's mainloop (DGated starts loading its
// first operand chunk there), with the warpgroup's state of the policy's own across tiles.
template <class C, class Pipeline, class Sched>
__device__ __forceinline__ void consume_cooperative(const typename C::Params& p, Pipeline& pipeline,
                                                    Sched& sched, typename C::Smem& smem, int cwg,
                                                    int ct) {
  constexpr int BM = C::BM, BN = C::BN;
  typename C::TiledMma mma;
  auto thr = mma.get_thread_slice(ct);
  Tensor tCrA = thr.make_fragment_A(
      thr.partition_A(make_tensor(make_smem_ptr(smem.a), typename C::SmemLayoutA{})));
  Tensor tCrB = thr.make_fragment_B(
      thr.partition_B(make_tensor(make_smem_ptr(smem.b), typename C::SmemLayoutB{})));
  typename Pipeline::PipelineState rs, fs;  // read and release positions in the ring
  typename C::Epi::CoopState es{};
  for (int t = blockIdx.x;; t += gridDim.x) {
    const Tile tile = sched.get(t);
    if (!tile.valid) break;
    const int kbs = k_blocks<C>(p, tile);
    if (kbs == 0) {
      C::Epi::template store_coop<C, true>(p, tile, 0, smem, cwg, ct, es);
      continue;
    }
    C::Epi::template prefetch_coop<C>(p, tile, smem, cwg, ct, es);
    Tensor acc = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
    mma_tile<C>(mma, tCrA, tCrB, acc, pipeline, rs, fs, kbs, [] {});
    C::Epi::template store_coop<C, false>(p, tile, acc, smem, cwg, ct, es);
  }
  if (ct % 128 == 0) tma_store_wait<0>();  // stores read smem: drain before the CTA exits
}

template <class C, class Pipeline, class Sched>
__device__ __forceinline__ void consume_pingpong(const typename C::Params& p, Pipeline& pipeline,
                                                 Sched& sched, typename C::Smem& smem, int cwg,
                                                 int lt) {
  constexpr int BM = C::BM, BN = C::BN;
  typename C::TiledMma mma;
  auto thr = mma.get_thread_slice(lt);
  Tensor tCrA = thr.make_fragment_A(
      thr.partition_A(make_tensor(make_smem_ptr(smem.a), typename C::SmemLayoutA{})));
  Tensor tCrB = thr.make_fragment_B(
      thr.partition_B(make_tensor(make_smem_ptr(smem.b), typename C::SmemLayoutB{})));
  typename Pipeline::PipelineState rs, fs;
  int chunk = 0;  // this warpgroup's epilogue count (the epilogue's: chunks, barrier uses)
  int i = 0;      // the CTA's tile count so far; tile i is warpgroup i % 2's
  for (int t = blockIdx.x;; t += gridDim.x, ++i) {
    const Tile tile = sched.get(t);
    if (!tile.valid) break;
    const int kbs = k_blocks<C>(p, tile);
    if ((i & 1) != cwg) {  // the other warpgroup's tile: skip its stages
      rs.advance(kbs);
      fs.advance(kbs);
      continue;
    }
    // Our turn: the other warpgroup has issued tile i - 1 (one arrival per sync: it
    // arrives only when tile i exists).
    if (i > 0) cutlass::arch::NamedBarrier::sync(256, kOrderBar + cwg);
    const bool next = sched.get(t + gridDim.x).valid;
    auto hand_off = [&] {
      if (next) cutlass::arch::NamedBarrier::arrive(256, kOrderBar + (cwg ^ 1));
    };
    if (kbs == 0) {
      hand_off();
      C::Epi::template store<C, true>(p, tile, 0, smem, cwg, lt, chunk);
      continue;
    }
    Tensor acc = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
    mma_tile<C>(mma, tCrA, tCrB, acc, pipeline, rs, fs, kbs, hand_off);
    C::Epi::template store<C, false>(p, tile, acc, smem, cwg, lt, chunk);
  }
  if (lt == 0) tma_store_wait<0>();
}

template <class C>
__global__ void __launch_bounds__(C::kThreads, 1)
    varlen_kernel(const __grid_constant__ typename C::Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Pipeline = typename C::Pipeline;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename C::Smem*>(smem_raw);

  const int warp = threadIdx.x / 32, wg = threadIdx.x / 128, lane = threadIdx.x % 32;
  typename Pipeline::Params pp;
  pp.transaction_bytes = C::kTmaBytes;
  pp.role = wg == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = C::kConsumerThreads;  // the threads that read one stage
  // Gathered rows: the 128 producer threads' cp.async arrivals complete a stage too.
  pp.num_producers = C::kGather ? 1 + 128 : 1;
  pp.initializing_warp = 0;
  Pipeline pipeline(smem.pipe, pp, Shape<_1, _1, _1>{});
  C::Epi::template init<C>(smem.epi);
  __syncthreads();

  Scheduler<C::kMode, C::BM, C::BN> sched(p);
  if (wg == 0) {
    // Register budgets per thread, producer / consumers: 40 / 232, or 64 / 216 with the
    // gathered rows' addresses (within the launch's 168 x 384 either way).
    cutlass::arch::warpgroup_reg_dealloc<C::kGather ? 64 : 40>();
    if (warp == 1 && blockIdx.x == 0)
      check_offs(p.offs, p.groups, C::kMode == Mode::M ? p.m : p.k, p.err_flag);
    if constexpr (C::kGather && C::kMode == Mode::M) {
      produce_gathered<C>(p, pipeline, sched, smem, threadIdx.x);
    } else if constexpr (C::kGather) {
      produce_gathered_k<C>(p, pipeline, sched, smem, threadIdx.x);
    } else if (warp == 0) {
      produce_tma<C>(p, pipeline, sched, smem, lane);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<C::kGather ? 216 : 232>();
    if constexpr (C::kPingPong) {
      consume_pingpong<C>(p, pipeline, sched, smem, wg - 1, threadIdx.x - 128 * wg);
    } else {
      consume_cooperative<C>(p, pipeline, sched, smem, wg - 1, threadIdx.x - 128);
    }
  }
#endif
}

}  // namespace gmm::varlen
