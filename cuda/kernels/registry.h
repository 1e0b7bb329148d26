// The kernel registry: every kernels/<stem>.cu file defines a list of KernelEntry with
// GMM_KERNEL_LIST(<stem>, ...), and build/ lists the files it compiled (one
// GMM_KERNEL_FILE(<stem>) line each, generated into groupmm_kernel_files.inc), so that
// adding a kernel family is adding one file; cuda/heuristics/choose.cc decides when it
// runs. See ARCHITECTURE.md.
#pragma once
#include "device/gemm_set.h"
#include "device/types.h"
#include "kernels/varlen/args.h"

#include <cstddef>
#include <cstdint>
#include <string>

namespace gmm {

// The kinds of grouped GEMM kernel the host routes groups to.
enum class Engine : int {
  kSm90Tma,      // CUTLASS 3.x ptr-array TMA grouped GEMM, sm_90a; 16-byte-aligned groups
  kSm80Aligned,  // CUTLASS 2.x grouped, multistage, 16-byte vectors; 16-byte-aligned groups
  kSm80Any,      // CUTLASS 2.x grouped, 2-stage, alignment 1: any group
  kF32Simt,      // CUTLASS 2.x grouped, float32 SIMT (full fp32)
  kTf32,         // CUTLASS 2.x grouped, float32 on TF32 tensor cores
  kF64,          // CUTLASS 2.x grouped, float64 tensor cores
  kSm90Varlen,   // groupmm's own sm_90a kernels for the packed MoE forms (kernels/varlen/)
};

// The tile configurations of the kSm90Tma engine, one per kernels/sm90_<dtype>_grouped_<tile>.cu
// (names: heuristics/choose.cc's table, the values of GROUPMM_SM90_CONFIG).
enum class Sm90Tile : uint8_t {
  kNone = 0,    // the other engines
  k128x256,     // 128x256x64 cooperative, cluster 2x1x1
  k128x128,     // 128x128x64 cooperative, cluster 1x1x1
  kPing64x128,  // 64x128x128 ping-pong, cluster 1x1x1
};

// One kernel family.
struct KernelEntry {
  Engine engine;
  DType in, out;
  Sm90Tile tile;  // kSm90Tma: its tile configuration; kNone otherwise
  // Workspace the kernel needs for `count` problems (host only, never syncs); nullptr
  // when it needs none.
  size_t (*workspace_bytes)(int combo, int64_t count, int sm_count);
  // Runs the problems of a GemmSet for each of the four A/B layout combinations (combo_of)
  // on ctx.stream: "" on success, else a message that names the kernel and the failed call.
  // Null for kSm90Varlen.
  std::string (*run)(int combo, const GemmSet& s, const RunCtx& ctx);
  // kSm90Varlen only: its configuration, and the launcher of one packed call, which reads
  // offs on the device itself (no GemmSet, no argument builder, no workspace).
  varlen::Config varlen = {};
  std::string (*run_varlen)(const varlen::Args& x) = nullptr;
  // kSm90Varlen only: whether its epilogue is given its operands and can read them
  // (its argument block's given() and can_read clause, epilogue/<name>.h).
  bool (*epi_reads)(const varlen::Args& x) = nullptr;
};

// The entries of one kernels/<stem>.cu file.
struct KernelList {
  const KernelEntry* entries;
  int count;
};

// Defines the KernelList of the kernels/<stem>.cu file being compiled (inside namespace
// gmm); `stem` must be the file's name without .cu.
#define GMM_KERNEL_LIST(stem, ...)                                  \
  static const ::gmm::KernelEntry stem##_entries[] = {__VA_ARGS__}; \
  extern const ::gmm::KernelList kernels_##stem;                    \
  const ::gmm::KernelList kernels_##stem = {                        \
      stem##_entries, int(sizeof(stem##_entries) / sizeof(stem##_entries[0]))};

// The kernel of `engine` for inputs `in` and outputs `out` (and, for kSm90Tma, tile `tile`)
// in this build, or nullptr (cuda/host/registry.cc).
const KernelEntry* find_kernel(Engine engine, DType in, DType out, Sm90Tile tile = Sm90Tile::kNone);

// The varlen kernel of configuration `config` for `dtype` in this build, or nullptr.
const KernelEntry* find_varlen(DType dtype, const varlen::Config& config);

// Workspace bytes `k` needs for `count` problems of layout combination `combo`.
size_t kernel_workspace(const KernelEntry* k, int combo, int64_t count, int sm_count);

// Runs the problems of set `s` with `k` (nothing when the set is empty); throws the
// kernel's message on failure.
void run_kernel(const KernelEntry* k, int combo, const GemmSet& s, const RunCtx& ctx);

}  // namespace gmm
