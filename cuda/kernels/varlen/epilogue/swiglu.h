// The SwiGLU epilogue's argument block (its policy: swiglu.cuh; its rule, operand list and
// meaning: src/shape/product/epilogues.rs). Plain C++.
//
// The routed expert block's up projection:
// with F = n / 2, d = the product [m, 2F] (gate | up halves, = pre) and act = silu(gate) * up
// [m, F], both contiguous; B's gate and up halves are read as two column ranges of one tile:
// b's columns [0, F) and [F, 2F), or, with up, b [G, K, F] (the gate) and up of b's strides.
#pragma once
#include <cstdint>

#include "device/align.h"
#include "kernels/varlen/key.h"

namespace gmm::varlen {

struct SwigluArgs {
  static constexpr Epilogue kEpi = "swiglu";
  void* act = nullptr;       // [m, F]
  const void* up = nullptr;  // B's up half as a tensor of its own, or null
  // Its rule's operands by position: up (or 0), act.
  static SwigluArgs from(const EpiOperands& o) {
    SwigluArgs e;
    e.up = o.ptr<const void>(0);
    e.act = o.ptr<void>(1);
    return e;
  }
  bool given() const { return act != nullptr; }
  // can_read's clause (entries.cuh, epi_reads): varlen-M, F a multiple of 8 (16-byte halves), d and
  // act contiguous, act (and up) 16-byte aligned.
  template <class A>
  bool can_read(const A& x) const {
    const int64_t f = x.n / 2;
    return x.mode == Mode::M && f > 0 && f % 8 == 0 && is16(int64_t(uintptr_t(act))) &&
           is16(int64_t(uintptr_t(up))) && x.n % 2 == 0 && x.ldd == x.n;
  }
};

}  // namespace gmm::varlen
