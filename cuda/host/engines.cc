// Which kernels serve a call. Host only.
//
// | inputs -> out                 | primary (16-byte-aligned) | fallback (the others)    |
// | 16-bit -> same, sm_90 (built) | CUTLASS 3.x TMA grouped   | 2.x any-alignment        |
// | 16-bit -> same, other GPUs    | 2.x aligned               | 2.x any-alignment        |
// | 16-bit -> fp32                | 2.x aligned (fp32 out)    | 2.x any-alignment (fp32) |
// | fp32                          | -                         | SIMT, or TF32 if allowed |
// | fp64                          | -                         | fp64 tensor cores        |
#include "host/engines.h"

#include <stdexcept>
#include <string>

namespace gmm {

Engines engines(DType in, DType out, bool allow_tf32, const DevInfo& dev) {
  Engines en;
  if (is_16bit(in) && (out == in || out == DType::F32)) {
    // The sm90 kernels are in this build when the registry holds one for `in` (any
    // configuration: "128x256" is always built with the others).
    const bool hopper = dev.cc_major == 9 && dev.cc_minor == 0 &&
                        find_kernel(Engine::kSm90Tma, in, in, "128x256") != nullptr;
    en.has_primary = true;
    en.primary = (out == in && hopper) ? Engine::kSm90Tma : Engine::kSm80Aligned;
    en.fallback = Engine::kSm80Any;
  } else if (in == DType::F32 && out == DType::F32) {
    en.fallback = allow_tf32 ? Engine::kTf32 : Engine::kF32Simt;
  } else if (in == DType::F64 && out == DType::F64) {
    en.fallback = Engine::kF64;
  } else {
    throw std::runtime_error(std::string("unsupported dtype combination: inputs ") +
                             dtype_name(in) + ", output " + dtype_name(out) +
                             " (16-bit inputs give the same dtype or float32; float32 and "
                             "float64 give their own)");
  }
  if (dev.cc_major < 8) {
    throw std::runtime_error("GPU of compute capability " + std::to_string(dev.cc_major) + "." +
                             std::to_string(dev.cc_minor) +
                             " is not supported (groupmm needs sm_80 or newer)");
  }
  return en;
}

Kernels kernels(const Engines& en, DType in, DType out, const char* sm90_config) {
  Kernels k;
  if (en.has_primary) {
    const char* config = en.primary == Engine::kSm90Tma ? sm90_config : "";
    k.primary = find_kernel(en.primary, in, out, config);
    if (k.primary == nullptr) {
      throw std::runtime_error(std::string("no ") +
                               (en.primary == Engine::kSm90Tma ? "sm90 " : "") +
                               "kernel for inputs " + dtype_name(in) + ", output " +
                               dtype_name(out) + (*config ? " in configuration " : "") +
                               config + " in this build");
    }
  }
  k.fallback = find_kernel(en.fallback, in, out);
  if (k.fallback == nullptr) {
    throw std::runtime_error(std::string("no kernel for inputs ") + dtype_name(in) +
                             ", output " + dtype_name(out) + " in this build");
  }
  return k;
}

size_t kernel_workspace(const KernelEntry* k, int combo, int64_t count, int sm_count) {
  if (k == nullptr || k->workspace_bytes == nullptr || count == 0) return 0;
  return k->workspace_bytes(combo, count, sm_count);
}

void run_kernel(const KernelEntry* k, int combo, const GemmSet& s, const RunCtx& ctx) {
  if (s.count == 0) return;
  std::string err = k->run(combo, s, ctx);
  if (!err.empty()) throw std::runtime_error(err);
}

}  // namespace gmm
