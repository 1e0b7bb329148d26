// One configuration of the varlen kernels for the tuning program (main.cu): compiled once
// per variant with -DVARIANT=<i>, so that the variants build in parallel. Development tool
// (dev/varlen/run.sh builds and runs it on a GPU machine); not part of the library.
#include "kernels/varlen/launch.cuh"

namespace gmm::varlen {
using T = cutlass::bfloat16_t;
constexpr Schedule CO = Schedule::Cooperative, PP = Schedule::PingPong;
#define M_VARIANT(BN, S)                                                                 \
  static std::string run_variant(const Args& x) {                                        \
    return x.b_k_major ? run<Cfg<T, Mode::M, true, BN, S>>(x) : run<Cfg<T, Mode::M, false, BN, S>>(x); \
  }
#define K_VARIANT(BN, S) \
  static std::string run_variant(const Args& x) { return run<Cfg<T, Mode::K, false, BN, S>>(x); }
#if VARIANT == 0
M_VARIANT(128, CO)
#elif VARIANT == 1
M_VARIANT(192, CO)
#elif VARIANT == 2
M_VARIANT(256, CO)
#elif VARIANT == 3
M_VARIANT(128, PP)
#elif VARIANT == 4
M_VARIANT(192, PP)
#elif VARIANT == 5
K_VARIANT(192, CO)
#elif VARIANT == 6
K_VARIANT(128, CO)
#elif VARIANT == 7
K_VARIANT(256, CO)
#elif VARIANT == 8
K_VARIANT(128, PP)
#elif VARIANT == 9
K_VARIANT(192, PP)
#endif
}  // namespace gmm::varlen

#define NAME2(a, b) a##b
#define NAME(a, b) NAME2(a, b)
std::string NAME(run_v, VARIANT)(const gmm::varlen::Args& x) { return gmm::varlen::run_variant(x); }
