// The DGated epilogue's block of varlen::Args (its policy: dgated.cuh). Plain C++ (args.h
// includes it).
//
// The backward of the routed expert block's down projection (the meaning is Fusion's in
// src/exec/ffi.rs): with F = n, the product p [m, F] is not stored; d = dpre [m, 2F],
// act = scale * silu(g) * u [m, F], partial [ceil(F / 64), m] (f32) the per-chunk row sums of
// p * silu(g) * u, from pre [m, 2F] and scale [m] (f32). Every one contiguous (row stride
// 2F, F or m).
#pragma once
#include <cstdint>

#include "device/align.h"
#include "kernels/varlen/key.h"

namespace gmm::varlen {

struct DgatedArgs {
  static constexpr Epilogue kEpi = Epilogue::DGated;
  void* act = nullptr;
  const void* pre = nullptr;
  const float* scale = nullptr;
  float* partial = nullptr;
  // Its operands are in the request (packed.cc).
  bool given() const { return act && pre && scale && partial; }
  // can_read's clause (args.h): varlen-M, F a multiple of 8 (16-byte halves), d contiguous,
  // act and pre 16-byte aligned, scale and partial given.
  template <class A>
  bool can_read(const A& x) const {
    const int64_t f = x.n;
    return x.mode == Mode::M && f > 0 && f % 8 == 0 && is16(int64_t(uintptr_t(act))) &&
           x.ldd == 2 * f && is16(int64_t(uintptr_t(pre))) && scale && partial;
  }
};

}  // namespace gmm::varlen
