// The sm_90a tile configuration rule and its environment override. Host only.
//
// Measured on an H200 (benches/NOTES-gpu.md, every config forced on every shape):
// - The 128x256 cluster-2x1x1 tile wins wherever a group has >= 2 M tiles of 128 rows:
//   every large shape, Qwen3-like experts (~256 rows), and every dW (GroupedK: the output
//   per group is K x N, large; the reduction, the group's tokens, does not change the
//   tiling). Smaller tiles there lose 5-30% (more tiles, and each tile that starts a new
//   group pays the tensor-map updates of the ptr-array kernel).
// - The group tile scheduler rounds each group's M tiles up to the cluster's M (2), so a
//   group of <= 128 rows runs half its CTAs empty under 128x256/2x1x1: there 128x128 with
//   a 1x1x1 cluster wins (+14-16% on 64 experts x 128 rows), and the 64x128 ping-pong
//   tile for still smaller groups (<= 64 rows per group on average; extrapolated: it
//   won by ~5% on skewed routing, where most groups hold < 64 rows).
//
// A new configuration: add its kernel file(s) (kernels/sm90_<dtype>_grouped_<config>.cu)
// and a line below that returns "<config>" where it should win; the override accepts it
// with no further change.
#include "heuristics/sm90.h"

#include "kernels/registry.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace gmm {
namespace {

// GROUPMM_SM90_CONFIG = auto (default) | <config> of any sm90 kernel file of this build
// ("64x128" is accepted for "ping64x128"). nullptr: auto.
const char* forced_config() {
  static const std::string forced = [] {
    const char* v = std::getenv("GROUPMM_SM90_CONFIG");
    if (v == nullptr || *v == 0 || std::strcmp(v, "auto") == 0) return std::string();
    std::string name = std::strcmp(v, "64x128") == 0 ? "ping64x128" : v;
    if (!has_sm90_config(name.c_str())) {
      std::fprintf(stderr,
                   "groupmm: GROUPMM_SM90_CONFIG=%s not understood (auto, or a configuration "
                   "of cuda/kernels/sm90_*_grouped_<config>.cu in this build); using auto\n",
                   v);
      return std::string();
    }
    return name;
  }();
  return forced.empty() ? nullptr : forced.c_str();
}

}  // namespace

const char* sm90_pick_config(const Sm90Shape& s) {
  if (const char* forced = forced_config()) return forced;
  if (s.groups <= 0 || s.m <= 0 || s.n <= 0 || s.k <= 0) return "128x256";
  // Rows per group: the M extent each group's GEMM has (the average over the groups
  // where M is the grouped dimension).
  const int64_t rows = !s.list && s.form == Form::GroupedM ? s.m / s.groups : s.m;
  // sm_count: no measured shape needed a wave-count rule (NOTES-gpu.md: a wave model
  // over-predicted the small tiles); kept in Sm90Shape for the next rule.
  if (!s.list && s.form == Form::GroupedK) return "128x256";
  if (rows <= 64) return "ping64x128";
  if (rows <= 128) return "128x128";
  return "128x256";
}

// Measured on an H200 and an H100 (benches/NOTES-gpu.md, run 7): the varlen kernels beat
// the ptr-array ones (and F.grouped_mm) by 1.03-1.9x on fine-grained experts (64-128
// experts, up to ~256 rows per expert: Qwen3, 64 small experts), every pass, uniform and
// skewed; on large experts (Mixtral: 4096 rows per expert, DeepSeek-V3 local: 2048) they
// were 0.95-1.00x of F.grouped_mm on the H100 while the ptr-array kernels are at parity
// (128x256 tiles with a 2x1 cluster), so calls with more than 1024 rows (tokens) per group
// on average stay on the ptr-array kernels.
bool sm90_use_varlen(const Sm90Shape& s) {
  static const int forced = [] {
    const char* v = std::getenv("GROUPMM_SM90_VARLEN");
    if (v == nullptr || *v == 0 || std::strcmp(v, "auto") == 0) return -1;
    if (std::strcmp(v, "0") == 0) return 0;
    if (std::strcmp(v, "1") == 0) return 1;
    std::fprintf(stderr, "groupmm: GROUPMM_SM90_VARLEN=%s not understood (auto, 0, 1); using auto\n", v);
    return -1;
  }();
  if (forced >= 0) return forced == 1;
  const int64_t per_group = s.form == Form::GroupedM ? s.m : s.k;  // rows / tokens in all
  return s.groups == 0 || per_group <= 1024 * s.groups;
}

// The cp.async producer of the gathering kernel keeps too few A bytes in flight: on an
// H200 (bf16, uniform top-8 routing, run 10) the up projection of a Qwen3-like layer took
// 0.454 ms gathering in the GEMM vs 0.427 ms gathering first (0.94x), DeepSeek-V3-local
// 3.70 vs 3.25 ms (0.88x); with 128 x 128 tiles it was 0.58x.
bool sm90_gather_in_gemm() {
  static const bool on = [] {
    const char* v = std::getenv("GROUPMM_SM90_GATHER");
    if (v == nullptr || *v == 0 || std::strcmp(v, "0") == 0 || std::strcmp(v, "auto") == 0) return false;
    if (std::strcmp(v, "1") == 0) return true;
    std::fprintf(stderr, "groupmm: GROUPMM_SM90_GATHER=%s not understood (auto, 0, 1); using auto\n", v);
    return false;
  }();
  return on;
}

}  // namespace gmm
