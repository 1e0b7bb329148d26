// The DGated epilogue's argument block (its policy: dgated.cuh; its rule, operand list and
// meaning: src/shape/product/epilogues.rs). Plain C++.
//
// The backward of the routed expert block's down projection: with F = n, the product p [m, F] is
// not stored; d = dpre [m, 2F], act = scale * silu(g) * u [m, F], partial [ceil(F / 64), m] (f32)
// the per-chunk row sums of p * silu(g) * u, from pre [m, 2F] and scale [m] (f32). Every one
// contiguous (row stride 2F, F or m).
#pragma once
#include <cstdint>

#include "device/align.h"
#include "kernels/varlen/key.h"

namespace gmm::varlen {

struct DgatedArgs {
  static constexpr Epilogue kEpi = "dgated";
  void* act = nullptr;
  const void* pre = nullptr;
  const float* scale = nullptr;
  float* partial = nullptr;
  // Its rule's operands by position: pre, scale, act, partial.
  static DgatedArgs from(const EpiOperands& o) {
    DgatedArgs e;
    e.pre = o.ptr<const void>(0);
    e.scale = o.ptr<const float>(1);
    e.act = o.ptr<void>(2);
    e.partial = o.ptr<float>(3);
    return e;
  }
  bool given() const { return act && pre && scale && partial; }
  // can_read's clause (entries.cuh, epi_reads): varlen-M, F a multiple of 8 (16-byte halves), d
  // contiguous, act and pre 16-byte aligned, scale and partial given.
  template <class A>
  bool can_read(const A& x) const {
    const int64_t f = x.n;
    return x.mode == Mode::M && f > 0 && f % 8 == 0 && is16(int64_t(uintptr_t(act))) &&
           x.ldd == 2 * f && is16(int64_t(uintptr_t(pre))) && scale && partial;
  }
};

}  // namespace gmm::varlen
