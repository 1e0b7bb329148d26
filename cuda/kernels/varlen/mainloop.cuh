// The mainloop of the varlen kernels: one tile's k-blocks from the ring of stages through
// wgmma into fp32 accumulators. Device code (nvcc only).
#pragma once
#include "kernels/varlen/config.cuh"

namespace gmm::varlen {

// Runs the k-loop of one tile (kbs >= 1 k-blocks, the ring's stages from `rs` on) into
// `acc`, which the first wgmma overwrites (ScaleOut::Zero: no accumulator register is
// carried across tiles; that too makes ptxas serialise the wgmmas). One batch of wgmmas
// stays in flight while the next stage is waited for; a stage is released (`fs`) once the
// wgmmas that read it are done. `issued()` runs right after the tile's last batch is
// issued and before it is waited for: ping-pong hands the tensor cores to the other
// warpgroup there. On return every wgmma of the tile has completed.
template <class C, class Mma, class FragA, class FragB, class Acc, class Pipeline, class State,
          class Issued>
__device__ __forceinline__ void mma_tile(Mma& mma, FragA& tCrA, FragB& tCrB, Acc& acc,
                                         Pipeline& pipeline, State& rs, State& fs, int kbs,
                                         Issued&& issued) {
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  warpgroup_fence_operand(acc);
  pipeline.consumer_wait(rs);
  if constexpr (C::kGather) cutlass::arch::fence_view_async_shared();  // cp.async -> wgmma
  warpgroup_arrive();
  CUTE_UNROLL
  for (int kk = 0; kk < size<2>(tCrA); ++kk) {
    gemm(mma, tCrA(_, _, kk, rs.index()), tCrB(_, _, kk, rs.index()), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if (kbs == 1) issued();
  ++rs;
  warpgroup_fence_operand(acc);
  for (int kb = 1; kb < kbs; ++kb) {
    pipeline.consumer_wait(rs);
    if constexpr (C::kGather) cutlass::arch::fence_view_async_shared();
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kk = 0; kk < size<2>(tCrA); ++kk) {
      gemm(mma, tCrA(_, _, kk, rs.index()), tCrB(_, _, kk, rs.index()), acc);
    }
    warpgroup_commit_batch();
    if (kb == kbs - 1) issued();
    warpgroup_wait<1>();
    warpgroup_fence_operand(acc);
    pipeline.consumer_release(fs);
    ++fs;
    ++rs;
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  pipeline.consumer_release(fs);
  ++fs;
}

}  // namespace gmm::varlen
