// The registry key of a varlen kernel (Config) and its parts: the form it computes, how its
// consumer warpgroups share the work, which operand it gathers, its epilogue. Plain C++:
// host code reads it through args.h, the epilogues' argument blocks (epilogue/<name>.h) too.
#pragma once
#include <cstdint>

#include "device/types.h"

namespace gmm::varlen {

enum class Mode : uint8_t { M = 0, K = 1 };

// How the two consumer warpgroups share the work.
// - Cooperative: both work on one 128-row tile (64 rows each) and store it together.
// - PingPong: each takes whole tiles in turn; one runs its mainloop while the other runs
//   its epilogue, handed over as soon as the last wgmma of a tile is issued.
enum class Schedule : uint8_t { Cooperative = 0, PingPong = 1 };

// A fused epilogue's operands (inputs, then outputs beyond D), in the order of its rule's
// operand list (src/shape/product/epilogues.rs): device addresses, 0 for an absent one. Its
// policy's argument block reads them by position (epilogue/<name>.h, from()).
constexpr int kEpiOperands = 6;
struct EpiOperands {
  uint64_t at[kEpiOperands] = {};
  template <class P>
  P* ptr(int i) const {
    return reinterpret_cast<P*>(at[i]);
  }
};

// Which operand's token rows the producer warpgroup reads through Args::src (cp.async:
// sm_90's TMA cannot gather rows). varlen-M: A only; varlen-K: A (x^T) or B (dY).
enum class Gather : uint8_t { None = 0, A = 1, B = 2 };

// One compiled kernel configuration, the key of its registry entry.
struct Config {
  Mode mode = Mode::M;
  Schedule schedule = Schedule::Cooperative;
  int bn = 128;                  // tile width (the tile is 128 rows)
  Gather gather = Gather::None;  // the operand whose rows are read through Args::src
  // varlen-M: what the epilogue does beyond storing the product, by name (the policy types
  // of epilogue/ name their value, kEpi; empty: the plain store).
  Epilogue epi = {};
  constexpr bool operator==(const Config& o) const {
    return mode == o.mode && schedule == o.schedule && bn == o.bn && gather == o.gather &&
           epi == o.epi;
  }
};

}  // namespace gmm::varlen
