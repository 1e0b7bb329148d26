// Which kernels serve a call: the engines of a dtype pair on a device, resolved to
// entries of the kernel registry. Host only.
#pragma once
#include "host/device.h"
#include "kernels/registry.h"

namespace gmm {

// The kernels a call routes its groups to: `primary` (may be null) takes the groups that
// meet the 16-byte rule (device/align.h), `fallback` every other group.
struct Kernels {
  const KernelEntry* primary = nullptr;
  const KernelEntry* fallback = nullptr;
};

// The engines for inputs `in`, outputs `out` on `dev` (TF32 for float32 when
// `allow_tf32`); `primary` of the result is left unresolved (engine only) until the
// caller knows the sm90 configuration. Throws std::runtime_error for an unsupported
// dtype pair or device.
struct Engines {
  bool has_primary = false;
  Engine primary = Engine::kSm80Aligned;
  Engine fallback = Engine::kSm80Any;
};
Engines engines(DType in, DType out, bool allow_tf32, const DevInfo& dev);

// The registry entries of `en`; `sm90_config` names the tile configuration when the
// primary engine is kSm90Tma. Throws when this build lacks one.
Kernels kernels(const Engines& en, DType in, DType out, const char* sm90_config);

// Workspace bytes `k` needs for `count` problems of layout combination `combo`.
size_t kernel_workspace(const KernelEntry* k, int combo, int64_t count, int sm_count);

// Runs the problems of set `s` with `k` (nothing when the set is empty); throws the
// kernel's message on failure.
void run_kernel(const KernelEntry* k, int combo, const GemmSet& s, const RunCtx& ctx);

}  // namespace gmm
