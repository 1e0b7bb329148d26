// The plain epilogue's block of varlen::Args (its policy: plain.cuh): no operands beyond D.
// Plain C++ (entries.cuh reads it).
#pragma once
#include "kernels/varlen/key.h"

namespace gmm::varlen {

struct PlainArgs {
  static constexpr Epilogue kEpi = {};
  static PlainArgs from(const EpiOperands&) { return {}; }
  bool given() const { return true; }
  // can_read's clause (entries.cuh, epi_reads): every layout the kernels read otherwise.
  template <class A>
  bool can_read(const A&) const {
    return true;
  }
};

}  // namespace gmm::varlen
