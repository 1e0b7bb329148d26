// The varlen-M kernels with fused epilogues: the one list of their compiled configurations,
// which every kernels/sm90_<dtype>_varlen_m_fused.cu file instantiates for its dtype. One
// line per configuration of an epilogue (a policy of epilogue/, its header included here),
// for weights of either major (run_config): SwiGLU (the routed expert block's up projection,
// on packed rows or rows gathered through an index; cooperative 128x256), DGated (its down
// projection's backward, on packed rows of dY, ping-pong 128x128, or rows gathered through
// the index, cooperative 128x256) and, ping-pong 128x128, RowScale. The heuristic's choice
// among an epilogue's configurations: fused_config (cuda/heuristics/choose.cc; ping-pong
// 128x128 unless a rule there says otherwise). sm_90a only (build/).
#pragma once
#include "kernels/varlen/entries.cuh"
#include "kernels/varlen/epilogue/dgated.cuh"
#include "kernels/varlen/epilogue/rowscale.cuh"
#include "kernels/varlen/epilogue/swiglu.cuh"

// The registry entries (entries.cuh) of element type T, DType DT, inside namespace gmm.
// clang-format off
#define GMM_VARLEN_FUSED_ENTRIES(T, DT)                                                          \
  (varlen::entry<T, DT, varlen::Mode::M, 256, varlen::Schedule::Cooperative, varlen::Gather::None, varlen::SwigluEpi>()), \
  (varlen::entry<T, DT, varlen::Mode::M, 256, varlen::Schedule::Cooperative, varlen::Gather::A, varlen::SwigluEpi>()),    \
  (varlen::entry<T, DT, varlen::Mode::M, 128, varlen::Schedule::PingPong, varlen::Gather::None, varlen::DgatedEpi>()),    \
  (varlen::entry<T, DT, varlen::Mode::M, 256, varlen::Schedule::Cooperative, varlen::Gather::A, varlen::DgatedEpi>()),    \
  (varlen::entry<T, DT, varlen::Mode::M, 128, varlen::Schedule::PingPong, varlen::Gather::None, varlen::RowScaleEpi>())
// clang-format on
