// The plain epilogue's block of varlen::Args (its policy: plain.cuh): no operands beyond D.
// Plain C++ (args.h includes it).
#pragma once
#include "kernels/varlen/key.h"

namespace gmm::varlen {

struct PlainArgs {
  static constexpr Epilogue kEpi = Epilogue::Plain;
  bool given() const { return true; }  // its operands are in the request (packed.cc)
  // can_read's clause (args.h): every layout the kernels read otherwise.
  template <class A>
  bool can_read(const A&) const {
    return true;
  }
};

}  // namespace gmm::varlen
