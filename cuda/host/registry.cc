// The kernel table: the KernelList of every kernels/*.cu file this build compiled, as
// build/ listed them in groupmm_kernel_files.inc (one GMM_KERNEL_FILE(<stem>) line per
// file), and the two calls every launch goes through. Host only.
#include "kernels/registry.h"

#include <stdexcept>

namespace gmm {

#define GMM_KERNEL_FILE(stem) extern const KernelList kernels_##stem;
#include "groupmm_kernel_files.inc"
#undef GMM_KERNEL_FILE

namespace {

const KernelList* const kLists[] = {
#define GMM_KERNEL_FILE(stem) &kernels_##stem,
#include "groupmm_kernel_files.inc"
#undef GMM_KERNEL_FILE
    nullptr};

template <class F>
const KernelEntry* first_entry(F&& match) {
  for (const KernelList* const* l = kLists; *l != nullptr; ++l) {
    for (int i = 0; i < (*l)->count; ++i) {
      if (match((*l)->entries[i])) return &(*l)->entries[i];
    }
  }
  return nullptr;
}

}  // namespace

const KernelEntry* find_kernel(Engine engine, DType in, DType out, Sm90Tile tile) {
  return first_entry([&](const KernelEntry& e) {
    return e.engine == engine && e.in == in && e.out == out && e.tile == tile;
  });
}

const KernelEntry* find_varlen(DType dtype, const varlen::Config& config) {
  return first_entry([&](const KernelEntry& e) {
    return e.engine == Engine::kSm90Varlen && e.in == dtype && e.out == dtype && e.varlen == config;
  });
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
