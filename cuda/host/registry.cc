// The kernel table: the KernelList of every kernels/*.cu file this build compiled, as
// build.rs listed them in groupmm_kernel_files.inc (one GMM_KERNEL_FILE(<stem>) line per
// file). Host only.
#include "kernels/registry.h"

#include <cstring>

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

const KernelEntry* find_kernel(Engine engine, DType in, DType out, const char* config) {
  return first_entry([&](const KernelEntry& e) {
    return e.engine == engine && e.in == in && e.out == out &&
           std::strcmp(e.config, config) == 0;
  });
}

bool has_sm90_config(const char* config) {
  return first_entry([&](const KernelEntry& e) {
           return e.engine == Engine::kSm90Tma && std::strcmp(e.config, config) == 0;
         }) != nullptr;
}

}  // namespace gmm
