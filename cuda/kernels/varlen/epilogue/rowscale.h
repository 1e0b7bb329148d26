// The RowScale epilogue's argument block (its policy: rowscale.cuh; its rule, operand list
// and meaning: src/shape/product/epilogues.rs). Plain C++.
//
// A GroupedM product scaled per row: d[r, :] = scale[r] * (a[r, :] . b[g]) from the fp32
// accumulators, scale [m] (f32), e.g. a router weight applied in the down projection.
#pragma once
#include "kernels/varlen/key.h"

namespace gmm::varlen {

struct RowScaleArgs {
  static constexpr Epilogue kEpi = "row_scale";
  const float* scale = nullptr;  // [m]
  // Its rule's operands by position: scale.
  static RowScaleArgs from(const EpiOperands& o) { return {o.ptr<const float>(0)}; }
  bool given() const { return scale != nullptr; }
  // can_read's clause (entries.cuh, epi_reads): varlen-M.
  template <class A>
  bool can_read(const A& x) const {
    return x.mode == Mode::M;
  }
};

}  // namespace gmm::varlen
