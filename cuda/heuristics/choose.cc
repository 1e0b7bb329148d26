// The kernel choice (choose.h): every rule and the measurements behind it. Host only.
#include "heuristics/choose.h"

#include "heuristics/env.h"

#include <optional>
#include <stdexcept>
#include <string>

namespace gmm {
namespace {

// ---------------------------------------------------------------------------------------
// Engines by dtype pair and device.
//
// | inputs -> out                 | primary (16-byte-aligned) | fallback (the others)    |
// | 16-bit -> same, sm_90 (built) | varlen or CUTLASS 3.x TMA | 2.x any-alignment        |
// | 16-bit -> same, other GPUs    | 2.x aligned               | 2.x any-alignment        |
// | 16-bit -> fp32                | 2.x aligned (fp32 out)    | 2.x any-alignment (fp32) |
// | fp32                          | -                         | SIMT, or TF32 if allowed |
// | fp64                          | -                         | fp64 tensor cores        |

struct Engines {
  bool has_primary = false;
  Engine primary = Engine::kSm80Aligned;
  Engine fallback = Engine::kSm80Any;
};

bool aligned16_inputs(DType in, DType out) {
  return is_16bit(in) && (out == in || out == DType::F32);
}

Engines engines(DType in, DType out, bool allow_tf32, const DevInfo& dev) {
  if (dev.cc_major < 8) {
    throw std::runtime_error("GPU of compute capability " + std::to_string(dev.cc_major) + "." +
                             std::to_string(dev.cc_minor) +
                             " is not supported (groupmm needs sm_80 or newer)");
  }
  Engines en;
  if (aligned16_inputs(in, out)) {
    // The sm90 kernels are in this build when the registry holds one for `in`.
    const bool hopper = dev.cc_major == 9 && dev.cc_minor == 0 &&
                        find_kernel(Engine::kSm90Tma, in, in, Sm90Tile::k128x256) != nullptr;
    en.has_primary = true;
    en.primary = (out == in && hopper) ? Engine::kSm90Tma : Engine::kSm80Aligned;
  } else if (in == DType::F32 && out == DType::F32) {
    en.fallback = allow_tf32 ? Engine::kTf32 : Engine::kF32Simt;
  } else if (in == DType::F64 && out == DType::F64) {
    en.fallback = Engine::kF64;
  } else {
    throw std::runtime_error(
        std::string("unsupported dtype combination: inputs ") + dtype_name(in) + ", output " +
        dtype_name(out) +
        " (16-bit inputs give the same dtype or float32; float32 and float64 give their own)");
  }
  return en;
}

// ---------------------------------------------------------------------------------------
// The ptr-array tile (CUTLASS 3.x kernels). Measured on an H200 (benches/bench_gpu.py with
// every config forced, GROUPMM_SM90_CONFIG, on every shape):
// - 128x256 with a 2x1x1 cluster wins wherever a group has >= 2 M tiles of 128 rows, and
//   for every GroupedK call (the output per group is K x N, large).
// - The group tile scheduler rounds each group's M tiles up to the cluster's M (2), so a
//   group of <= 128 rows runs half its CTAs empty under 128x256/2x1x1: there 128x128 with
//   a 1x1x1 cluster wins (+14-16% on 64 experts x 128 rows), and the 64x128 ping-pong tile
//   for still smaller groups (<= 64 rows per group on average; extrapolated).

constexpr EnvName<Sm90Tile> kTileNames[] = {{"128x256", Sm90Tile::k128x256},
                                            {"128x128", Sm90Tile::k128x128},
                                            {"ping64x128", Sm90Tile::kPing64x128},
                                            {"64x128", Sm90Tile::kPing64x128}};

// rows: the M extent of each group's GEMM (GroupedM: the average over the groups).
Sm90Tile ptr_array_tile(bool list, Form form, int64_t groups, int64_t rows, int64_t n, int64_t k) {
  static const std::optional<Sm90Tile> forced = env_choice("GROUPMM_SM90_CONFIG", kTileNames);
  if (forced) return *forced;
  if (groups <= 0 || rows <= 0 || n <= 0 || k <= 0) return Sm90Tile::k128x256;
  if (!list && form == Form::GroupedK) return Sm90Tile::k128x256;
  if (rows <= 64) return Sm90Tile::kPing64x128;
  if (rows <= 128) return Sm90Tile::k128x128;
  return Sm90Tile::k128x256;
}

Kernels resolve(const Engines& en, DType in, DType out, Sm90Tile tile) {
  Kernels k;
  if (en.has_primary) {
    const Sm90Tile t = en.primary == Engine::kSm90Tma ? tile : Sm90Tile::kNone;
    k.primary = find_kernel(en.primary, in, out, t);
    if (k.primary == nullptr) {
      throw std::runtime_error(std::string("no ") + (t != Sm90Tile::kNone ? "sm90 " : "") +
                               "kernel for inputs " + dtype_name(in) + ", output " +
                               dtype_name(out) + " in this build");
    }
  }
  k.fallback = find_kernel(en.fallback, in, out);
  if (k.fallback == nullptr) {
    throw std::runtime_error(std::string("no kernel for inputs ") + dtype_name(in) + ", output " +
                             dtype_name(out) + " in this build");
  }
  return k;
}

// ---------------------------------------------------------------------------------------
// The varlen kernels (groupmm's own, kernels/varlen/).
//
// Varlen or ptr-array: the varlen kernels whenever they can read the call. With the earlier
// cooperative configurations (a development ctypes benchmark, H200 and H100) they were
// 1.03-1.9x the ptr-array kernels on fine-grained experts but 0.95-1.00x on 4096 rows per
// expert, so calls above 1024 rows per group went to the ptr-array kernels.
// With the ping-pong configurations (H200, bench_gpu with each forced, 24 rows of
// Mixtral (4096 rows per expert) and DeepSeek-V3 (2048) shapes, uniform and Zipf-1.2,
// fwd/dX/dW): varlen geomean 1.05x F.grouped_mm, min 0.98; ptr-array geomean 1.00x, min 0.99.
// No crossover up to 4096 rows per group: the threshold is gone.
// The configuration (H200, dev/varlen: 8 MoE shapes x uniform/Zipf-1.2 x
// fwd/dX/dW, every configuration timed interleaved in one process):
// - Ping-pong 128x192 is the best or within 2% of it on 40 of 48 rows: +1-8% over the
//   cooperative 128x128 (varlen-M) / 128x192 (varlen-K) kernels that ran before.
// - Where 192 columns pad N by more than 5% (N = 1024: 12.5%) ping-pong 128x128 wins
//   (64 experts x 128 rows, N = 1024: +1-2% over cooperative, +5% over 128x192).
// - Decode sizes (a few rows per expert) are weight-read bound: every configuration within
//   noise.
constexpr EnvName<varlen::Config> kVarlenNames[] = {
    {"pp128", {varlen::Mode::M, varlen::Schedule::PingPong, 128}},
    {"pp192", {varlen::Mode::M, varlen::Schedule::PingPong, 192}},
    {"co128", {varlen::Mode::M, varlen::Schedule::Cooperative, 128}},
    {"co192", {varlen::Mode::M, varlen::Schedule::Cooperative, 192}}};

constexpr EnvName<bool> kOnOff[] = {{"0", false}, {"1", true}};

varlen::Config auto_config(varlen::Mode mode, int64_t n) {
  const int64_t pad192 = (n + 191) / 192 * 192, pad128 = (n + 127) / 128 * 128;
  const int bn = mode == varlen::Mode::M && pad192 * 100 > pad128 * 105 ? 128 : 192;
  return varlen::Config{mode, varlen::Schedule::PingPong, bn};
}

// The varlen kernel for a call of `mode` with N = n: the forced configuration where this
// build has it for the mode (the file comments of kernels/sm90_*_varlen_*.cu list them),
// else the rule's.
const KernelEntry* choose_varlen(DType dtype, varlen::Mode mode, int64_t n) {
  static const std::optional<varlen::Config> forced =
      env_choice("GROUPMM_SM90_VARLEN_CONFIG", kVarlenNames);
  if (forced) {
    if (const KernelEntry* k =
            find_varlen(dtype, varlen::Config{mode, forced->schedule, forced->bn}))
      return k;
  }
  return find_varlen(dtype, auto_config(mode, n));
}

bool use_varlen() {
  static const std::optional<bool> forced = env_choice("GROUPMM_SM90_VARLEN", kOnOff);
  return forced.value_or(true);
}

// The gathered varlen-K kernel (the MoE block's weight gradients, x[src]^T dH and act^T
// dY[src]): cooperative 128 x 256 (GROUPMM_SM90_GATHER_K=co192: cooperative 128 x 192;
// GROUPMM_SM90_GATHER_K=pp128 or GROUPMM_SM90_VARLEN_CONFIG=pp128: ping-pong 128 x 128;
// ping-pong 128 x 192 would not fit its accumulators beside the gathering producer's
// registers). Measured (H100, bf16, T = 16384, uniform top-k, a timing script running the
// kernel directly, one process per configuration, alternated, two rounds), co256 over co192,
// outputs bitwise equal: x[src]^T dH 1.03-1.30x (Qwen3-30B 1.12-1.17x, OLMoE 1.10-1.18x,
// d 4096 / F 512 1.17-1.30x, the smallest gain d 768 / F 1024 top-2); act^T dY[src]
// 1.05-1.12x (a third more MMA work per k-block for the same gathered bytes on A; on B
// the other operand's bytes per FLOP fall and the per-tile costs spread over more work).
constexpr EnvName<varlen::Config> kGatherKNames[] = {
    {"pp128", {varlen::Mode::K, varlen::Schedule::PingPong, 128}},
    {"co192", {varlen::Mode::K, varlen::Schedule::Cooperative, 192}},
    {"co256", {varlen::Mode::K, varlen::Schedule::Cooperative, 256}}};

varlen::Config gather_k_config(varlen::Gather g) {
  static const std::optional<varlen::Config> forced =
      env_choice("GROUPMM_SM90_VARLEN_CONFIG", kVarlenNames);
  static const std::optional<varlen::Config> chosen =
      env_choice("GROUPMM_SM90_GATHER_K", kGatherKNames);
  varlen::Config c = chosen.value_or(kGatherKNames[2].value);
  if (forced && forced->schedule == varlen::Schedule::PingPong && forced->bn == 128)
    c = kGatherKNames[0].value;
  return varlen::Config{varlen::Mode::K, c.schedule, c.bn, g};
}

// The SwiGLU epilogue's configuration: cooperative 128 x 256 (half the A bytes per FLOP of
// ping-pong 128 x 128, which a gathered A pays for in cp.async requests), or the ping-pong
// 128 x 128 one where GROUPMM_SM90_SWIGLU=pp128. Measured (H100, bf16, T = 16384, uniform
// top-k, one process per configuration via the environment variable, alternated, two
// rounds) on rows gathered through src, co256 over pp128: Qwen3-30B 1.34-1.44x, OLMoE 1.26-1.35x,
// a 256-wide expert 1.26x, a 512-wide top-16 one 1.36x, Qwen3-235B 1.34x; on packed rows
// 0.96-1.12x (Qwen3-30B 1.03x, Qwen3-235B 1.12x, the 256-wide 0.96-1.04x).
constexpr EnvName<varlen::Config> kSwigluNames[] = {
    {"pp128", {varlen::Mode::M, varlen::Schedule::PingPong, 128}},
    {"co256", {varlen::Mode::M, varlen::Schedule::Cooperative, 256}}};

// The DGated epilogue's configuration on rows gathered through src: cooperative 128 x 256
// (half the gathered bytes per FLOP of ping-pong 128 x 128, whose cp.async producer bounds it
// at D >= 2048; the epilogue runs after the mainloop, pre's first chunk loads during it), or
// ping-pong 128 x 128 (its epilogue under the other warpgroup's mainloop) where
// GROUPMM_SM90_DGATED=pp128. Packed rows: ping-pong 128 x 128. Measured (H100, bf16, uniform
// top-k, one process per configuration via the environment variable, alternated, two
// rounds), co256 over pp128 at T = 16384: Qwen3-30B 1.06x, OLMoE 1.08-1.10x, Qwen3-235B 1.24-1.27x,
// gpt-oss-20b 1.01-1.16x, d 1536 / F 512 top-16 1.02-1.03x, d 1536 / F 256 1.00-1.01x,
// Mixtral-size experts under EP = 2 (D 4096, F 14336, 32768 rows) 1.19-1.23x; Qwen3-30B at
// T = 4096 0.96-0.98x (kept simple: one default); bitwise equal.
constexpr EnvName<varlen::Config> kDgatedNames[] = {
    {"pp128", {varlen::Mode::M, varlen::Schedule::PingPong, 128}},
    {"co256", {varlen::Mode::M, varlen::Schedule::Cooperative, 256}}};

varlen::Config fused_config(varlen::Gather g, Epilogue epi) {
  static const std::optional<varlen::Config> forced =
      env_choice("GROUPMM_SM90_SWIGLU", kSwigluNames);
  static const std::optional<varlen::Config> dgated =
      env_choice("GROUPMM_SM90_DGATED", kDgatedNames);
  if (epi == "swiglu") {
    const varlen::Config c = forced.value_or(kSwigluNames[1].value);
    return varlen::Config{varlen::Mode::M, c.schedule, c.bn, g, epi};
  }
  if (epi == "dgated" && g == varlen::Gather::A) {
    const varlen::Config c = dgated.value_or(kDgatedNames[1].value);
    return varlen::Config{varlen::Mode::M, c.schedule, c.bn, g, epi};
  }
  return varlen::Config{varlen::Mode::M, varlen::Schedule::PingPong, 128, g, epi};
}

}  // namespace

// In-GEMM gathering (the cp.async producers, kernels/varlen/producer.cuh) is on unless
// GROUPMM_SM90_GATHER=0, which makes the caller gather the rows first and run the TMA
// kernels (both exact and bitwise equal). Measured after the producers' rewrite (H100, bf16,
// uniform top-k routing, T = 16384, a timing script: in-GEMM vs torch's index_select plus
// the TMA kernel on the copy, interleaved, two rounds), the
// in-GEMM product over the gather-first pair: up projection 1.18-1.63x, SwiGLU up projection
// 0.87-1.23x (OLMoE sizes 0.87-0.98x, the rest >= 0.95x), DGated 1.20-1.78x, dW_in
// (x[src]^T dH) 0.96-1.46x, dW_out (act^T dY[src]) 1.07-2.05x, over Qwen3-30B, OLMoE,
// a 256-wide and a 512-wide top-16 configuration (cuda/NOTES.md has the design). Before
// the rewrite (every copy re-read the kernel's
// parameters and waited for its own address, the producer's instruction latency bound the
// kernel) the weight gradients ran at 0.45-0.65x of the TMA kernel and gathering first won.
bool gather_in_gemm() {
  static const bool on = env_choice("GROUPMM_SM90_GATHER", kOnOff).value_or(true);
  return on;
}

bool gathers_rows(DType dt, const DevInfo& dev) {
  if (!gather_in_gemm() || !(dt == DType::BF16 || dt == DType::F16)) return false;
  const Engines en = engines(dt, dt, false, dev);
  return en.has_primary && en.primary == Engine::kSm90Tma;
}

PackedChoice choose_packed(const PackedCall& c, const DevInfo& dev) {
  PackedChoice ch;
  const Engines en = engines(c.in, c.out, c.allow_tf32, dev);
  const bool sm90 = en.has_primary && en.primary == Engine::kSm90Tma;
  const bool gather = c.gather != varlen::Gather::None;
  if (sm90 && c.varlen != nullptr && varlen::can_read(*c.varlen) && c.in == c.out) {
    if (!c.epi.empty()) {
      // The fused epilogues (fused_config); on gathered rows only when in-GEMM gathering is
      // on (otherwise the caller gathers first). On gathered rows the caller's composition
      // (the gathering cooperative 128 x 256 product, then the SwiGLU row op) was tried
      // against the ping-pong 128 x 128 SwiGLU kernel: whole layers on an H100 (bf16,
      // T = 16384) were 1-7 % slower with it but for OLMoE sizes (1 % faster); the fused
      // cooperative 128 x 256 kernel now beats both.
      if (!gather || gather_in_gemm()) {
        ch.varlen = find_varlen(c.in, fused_config(c.gather, c.epi));
        // the epilogue's own clause of can_read (its argument block's, epilogue/<name>.h)
        if (ch.varlen != nullptr && !ch.varlen->epi_reads(*c.varlen)) ch.varlen = nullptr;
      }
    } else if (gather && c.varlen->mode == varlen::Mode::K) {
      if (gather_in_gemm()) ch.varlen = find_varlen(c.in, gather_k_config(c.gather));
    } else if (c.gather == varlen::Gather::A) {  // varlen-M: A only
      if (gather_in_gemm()) {
        ch.varlen = find_varlen(c.in, varlen::Config{varlen::Mode::M, varlen::Schedule::Cooperative,
                                                     256, varlen::Gather::A});
      }
    } else if (use_varlen()) {
      ch.varlen = choose_varlen(c.in, c.varlen->mode, c.varlen->n);
    }
    if (ch.varlen != nullptr) return ch;
  }
  if (gather || !c.epi.empty()) {  // only the varlen kernels gather or fuse
    ch.unsupported = true;
    return ch;
  }
  Sm90Tile tile = Sm90Tile::kNone;
  if (sm90) {
    const int64_t rows = c.form == Form::GroupedM && c.groups > 0 ? c.m / c.groups : c.m;
    tile = ptr_array_tile(false, c.form, c.groups, rows, c.n, c.k);
  }
  ch.kernels = resolve(en, c.in, c.out, tile);
  return ch;
}

bool has_aligned_engine(DType in, DType out) { return aligned16_inputs(in, out); }

Kernels choose_list(const ListCall& c, const DevInfo& dev) {
  const Engines en = engines(c.in, c.out, c.allow_tf32, dev);
  Sm90Tile tile = Sm90Tile::kNone;
  if (en.has_primary && en.primary == Engine::kSm90Tma) {
    tile = ptr_array_tile(true, Form::GroupedM, c.groups, c.avg_m, c.max_n, c.max_k);
  }
  return resolve(en, c.in, c.out, tile);
}

}  // namespace gmm
