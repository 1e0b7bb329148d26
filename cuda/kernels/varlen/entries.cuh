// The registry entries of the varlen kernels: one per compiled configuration, so that a
// kernels/sm90_<dtype>_varlen_*.cu file is its list of configurations. Host side of the
// kernel files only.
#pragma once
#include "kernels/registry.h"
#include "kernels/varlen/launch.cuh"

namespace gmm::varlen {

// Runs one call with configuration (kMode, BN, S, G, epilogue policy E) for element type T;
// varlen-M picks the instantiation of the weights' major.
template <class T, Mode kMode, int BN, Schedule S, Gather G, class E>
std::string run_config(const Args& x) {
  if constexpr (kMode == Mode::M) {
    return x.b_k_major ? run<Cfg<T, Mode::M, true, BN, S, G, E>>(x)
                       : run<Cfg<T, Mode::M, false, BN, S, G, E>>(x);
  } else {
    return run<Cfg<T, Mode::K, false, BN, S, G>>(x);
  }
}

// Whether the call's epilogue operands are given and readable by policy E (the kernel's
// registry entry asks it: KernelEntry::epi_reads).
template <class E>
bool epi_reads(const Args& x) {
  const auto e = E::Args::from(x.epi);
  return e.given() && e.can_read(x);
}

// E: an epilogue policy (kernels/varlen/epilogue/), whose header the kernel file includes.
template <class T, DType DT, Mode kMode, int BN, Schedule S, Gather G = Gather::None,
          class E = PlainEpi>
constexpr KernelEntry entry() {
  return KernelEntry{Engine::kSm90Varlen,
                     DT,
                     DT,
                     Sm90Tile::kNone,
                     nullptr,
                     nullptr,
                     Config{kMode, S, BN, G, E::kEpi},
                     &run_config<T, kMode, BN, S, G, E>,
                     &epi_reads<E>};
}

}  // namespace gmm::varlen
