// The RowScale epilogue's block of varlen::Args (its policy: rowscale.cuh). Plain C++
// (args.h includes it).
//
// A GroupedM product scaled per row (the meaning is Fusion's in src/exec/ffi.rs): d[r, :] =
// scale[r] * (a[r, :] . b[g]) from the fp32 accumulators, scale [m] (f32), e.g. a router
// weight applied in the down projection.
#pragma once
#include "kernels/varlen/key.h"

namespace gmm::varlen {

struct RowScaleArgs {
  static constexpr Epilogue kEpi = Epilogue::RowScale;
  const float* scale = nullptr;                    // [m]
  bool given() const { return scale != nullptr; }  // its operands are in the request (packed.cc)
  // can_read's clause (args.h): varlen-M.
  template <class A>
  bool can_read(const A& x) const {
    return x.mode == Mode::M;
  }
};

}  // namespace gmm::varlen
