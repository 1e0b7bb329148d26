// The C launch API of launch.h: validation, kernel choice, argument building (on the
// device for the packed forms, on the host for the list form), zero fill, and the
// per-device invalid-offs flag. Compiled for every listed architecture.
#include "args.cuh"
#include "common.cuh"
#include "launch.h"

#include "cutlass/version.h"

#include <algorithm>
#include <cstdlib>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>

#include <cuda.h>

// --------------------------------------------------------------------------------------
// cuTensorMapEncodeTiled for CUTLASS without linking libcuda.
//
// build.rs defines CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL, so CUTLASS calls the driver
// function by name. This definition (hidden: it never interposes on the real libcuda
// symbol for anyone else) resolves the driver entry point once, through the runtime
// (cudaGetDriverEntryPointByVersion), and caches it; CUTLASS's own wrapper would repeat
// that lookup for every TMA descriptor of every launch.
extern "C" __attribute__((visibility("hidden"))) CUresult CUDAAPI cuTensorMapEncodeTiled(
    CUtensorMap* tensor_map, CUtensorMapDataType dtype, cuuint32_t rank, void* global_address,
    const cuuint64_t* global_dim, const cuuint64_t* global_strides, const cuuint32_t* box_dim,
    const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
    CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2_promotion,
    CUtensorMapFloatOOBfill oob_fill) {
  using Fn = CUresult(CUDAAPI*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static const Fn fn = []() -> Fn {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      return nullptr;
    }
    return reinterpret_cast<Fn>(p);
  }();
  if (fn == nullptr) return CUDA_ERROR_NOT_FOUND;
  return fn(tensor_map, dtype, rank, global_address, global_dim, global_strides, box_dim,
            element_strides, interleave, swizzle, l2_promotion, oob_fill);
}
#include <string>
#include <vector>

namespace gmm {

std::string cuda_fail(const char* what, cudaError_t e) {
  return std::string(what) + " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

namespace {

constexpr int kMaxDevices = 64;

const char* dtype_name(int d) {
  switch (d) {
    case GMM_F16: return "torch.float16";
    case GMM_BF16: return "torch.bfloat16";
    case GMM_F32: return "torch.float32";
    case GMM_F64: return "torch.float64";
    default: return "unknown dtype";
  }
}

const char* form_name(int f) {
  switch (f) {
    case GMM_GROUPED_M: return "GroupedM [T,K]x[G,K,N]";
    case GMM_GROUPED_K: return "GroupedK [M,T]x[T,N]";
    case GMM_GROUPED_N: return "GroupedN [G,M,K]x[K,N]";
    case GMM_BATCHED: return "Batched [G,M,K]x[G,K,N]";
    default: return "unknown form";
  }
}

int elem_size(int d) {
  switch (d) {
    case GMM_F16:
    case GMM_BF16: return 2;
    case GMM_F32: return 4;
    case GMM_F64: return 8;
    default: return 0;
  }
}

struct Fail {
  std::string msg;
};

int report(const std::string& msg, char* out, size_t out_len) {
  if (out != nullptr && out_len > 0) {
    size_t n = std::min(msg.size(), out_len - 1);
    std::memcpy(out, msg.data(), n);
    out[n] = 0;
  }
  return 1;
}

// Per-device facts (host-only attribute queries, cached; no sync).
struct DevInfo {
  int sm_count = 0, cc_major = 0, cc_minor = 0;
  cudaError_t err = cudaSuccess;
};

DevInfo dev_info(int device) {
  static std::once_flag once[kMaxDevices];
  static DevInfo info[kMaxDevices];
  std::call_once(once[device], [&] {
    DevInfo d;
    d.err = cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, device);
    if (d.err == cudaSuccess)
      d.err = cudaDeviceGetAttribute(&d.cc_major, cudaDevAttrComputeCapabilityMajor, device);
    if (d.err == cudaSuccess)
      d.err = cudaDeviceGetAttribute(&d.cc_minor, cudaDevAttrComputeCapabilityMinor, device);
    info[device] = d;
  });
  return info[device];
}

void check_device(int device) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) throw Fail{cuda_fail("cudaGetDeviceCount", e)};
  if (device < 0 || device >= count || device >= kMaxDevices) {
    throw Fail{"device index " + std::to_string(device) + " out of range (" +
               std::to_string(count) + " CUDA devices visible)"};
  }
}

// The static CUDA runtime keeps its own current device: set it at every entry, and
// clear any stale error so a later cudaGetLastError() reports only our launches.
DevInfo enter(int device) {
  check_device(device);
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) throw Fail{cuda_fail("cudaSetDevice", e)};
  (void)cudaGetLastError();
  DevInfo d = dev_info(device);
  if (d.err != cudaSuccess) throw Fail{cuda_fail("cudaDeviceGetAttribute", d.err)};
  return d;
}

// Host-mapped pinned flag per device, allocated once.
struct Flag {
  int* host = nullptr;
  int* dev = nullptr;
};
std::mutex flag_mutex;
Flag flags[kMaxDevices];

Flag offs_flag(int device) {
  std::lock_guard<std::mutex> lock(flag_mutex);
  Flag& f = flags[device];
  if (f.host != nullptr) return f;
  // Allowed during stream capture: switch this thread to relaxed capture mode for the
  // allocation (a one-time, non-stream call).
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaError_t e = cudaThreadExchangeStreamCaptureMode(&mode);
  if (e != cudaSuccess) throw Fail{cuda_fail("cudaThreadExchangeStreamCaptureMode", e)};
  void* h = nullptr;
  e = cudaHostAlloc(&h, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable);
  cudaError_t e2 = cudaThreadExchangeStreamCaptureMode(&mode);
  if (e != cudaSuccess) throw Fail{cuda_fail("cudaHostAlloc (offs error flag)", e)};
  if (e2 != cudaSuccess) throw Fail{cuda_fail("cudaThreadExchangeStreamCaptureMode", e2)};
  *static_cast<volatile int*>(h) = 0;
  void* d = nullptr;
  e = cudaHostGetDevicePointer(&d, h, 0);
  if (e != cudaSuccess) {
    cudaFreeHost(h);
    throw Fail{cuda_fail("cudaHostGetDevicePointer (offs error flag)", e)};
  }
  f.host = static_cast<int*>(h);
  f.dev = static_cast<int*>(d);
  return f;
}

// Operand checks and normalisation. `rows`, `cols` are the extents of the last two dims.
// `index` >= 0 names a list element ("As[3]"); the name is built only for messages.
OpDesc normalise(const char* base, int64_t index, const gmm_operand& o, int64_t batch,
                 int64_t rows, int64_t cols) {
  auto shape = [&] {
    std::string name = base;
    if (index >= 0) name += "[" + std::to_string(index) + "]";
    return name + " [" + std::to_string(o.batch) + ", " + std::to_string(o.rows) +
           ", " + std::to_string(o.cols) + "] strides (" + std::to_string(o.batch_stride) + ", " +
           std::to_string(o.row_stride) + ", " + std::to_string(o.col_stride) + ")";
  };
  if (o.batch != batch || o.rows != rows || o.cols != cols) {
    throw Fail{shape() + ": expected extents [" + std::to_string(batch) + ", " +
               std::to_string(rows) + ", " + std::to_string(cols) + "]"};
  }
  if (o.batch_stride < 0 || o.row_stride < 0 || o.col_stride < 0) {
    throw Fail{shape() + ": negative strides are not supported"};
  }
  if (batch > 1 && rows > 0 && cols > 0 && o.batch_stride == 0) {
    throw Fail{shape() + ": batch stride 0 (expanded operand) is not supported"};
  }
  const int64_t numel = batch * rows * cols;
  if (numel > 0 && o.ptr == 0) throw Fail{shape() + ": null data pointer"};
  OpDesc d;
  d.ptr = uintptr_t(o.ptr);
  d.rs = o.row_stride;
  d.cs = o.col_stride;
  d.bs = o.batch_stride;
  // A leading dimension that is never used to address anything (its dim has extent
  // <= 1): any value >= the contiguous extent, rounded so it never spoils alignment.
  auto unused_ld = [](int64_t extent) { return int64_t(round_up(size_t(std::max<int64_t>(extent, 1)), 8)); };
  if (rows == 0 || cols == 0) {
    // No elements: any strides are fine (torch gives all sorts for empty tensors); no
    // problem built from this operand reads or writes it.
    d.major = kRowMajor;
    d.ld = unused_ld(cols);
    d.rs = d.ld;
    d.cs = 1;
    return d;
  }
  // Row-major: unit column stride (or a single column), rows apart by >= cols.
  if ((o.col_stride == 1 || cols <= 1) && (rows <= 1 || o.row_stride >= std::max<int64_t>(cols, 1))) {
    d.major = kRowMajor;
    d.ld = rows <= 1 ? unused_ld(cols) : o.row_stride;
    if (cols <= 1) d.cs = 1;
    return d;
  }
  if ((o.row_stride == 1 || rows <= 1) && (cols <= 1 || o.col_stride >= std::max<int64_t>(rows, 1))) {
    d.major = kColMajor;
    d.ld = cols <= 1 ? unused_ld(rows) : o.col_stride;
    if (rows <= 1) d.rs = 1;
    return d;
  }
  throw Fail{shape() +
             ": needs a unit stride in one of its last two dims and a leading stride >= the "
             "other extent (copy it to contiguous memory first)"};
}

// Which kernels serve a dtype on a device.
enum Kind { kNone, kSm90, kAligned16, kAny16, kF32Simt, kTf32, kF64 };

struct Engines {
  Kind primary = kNone;   // 16-byte-aligned groups
  Kind fallback = kNone;  // everything else
};

// ---- sm90 tile configuration choice (the one place) --------------------------------
//
// GROUPMM_SM90_CONFIG = auto (default) | 128x256 | 128x128 | ping64x128 forces a
// configuration (read once per process; for tuning and benchmarks).
int sm90_forced_config() {
  static const int forced = [] {
    const char* v = std::getenv("GROUPMM_SM90_CONFIG");
    if (v == nullptr || *v == 0 || std::strcmp(v, "auto") == 0) return -1;
    if (std::strcmp(v, "128x256") == 0) return int(kSm90Tile128x256);
    if (std::strcmp(v, "128x128") == 0) return int(kSm90Tile128x128);
    if (std::strcmp(v, "ping64x128") == 0 || std::strcmp(v, "64x128") == 0)
      return int(kSm90Ping64x128);
    std::fprintf(stderr,
                 "groupmm: GROUPMM_SM90_CONFIG=%s not understood (auto, 128x256, 128x128, "
                 "ping64x128); using auto\n",
                 v);
    return -1;
  }();
  return forced;
}

// Picks the configuration from host-known values only (no device reads, no sync):
// the form, G, the operand extents (m, n, k as passed to the packed launcher; for
// GroupedM m = T total rows, for GroupedK k = T total reduction, for GroupedN n = total
// columns) and the SM count. `form` < 0: the list form, with m = average rows of the
// non-empty groups, n and k their maxima.
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
int sm90_pick_config(int form, int64_t groups, int64_t m, int64_t n, int64_t k,
                     int sm_count) {
  const int forced = sm90_forced_config();
  if (forced >= 0) return forced;
  if (groups <= 0 || m <= 0 || n <= 0 || k <= 0) return kSm90Tile128x256;
  // Rows per group: the M extent each group's GEMM has (average over groups where M is
  // the grouped dimension).
  int64_t rows;
  switch (form) {
    case GMM_GROUPED_M: rows = m / groups; break;
    default: rows = m; break;  // GroupedN / Batched: m per group; list: the average
  }
  // sm_count: no measured shape needed a wave-count rule (NOTES-gpu.md: a wave model
  // over-predicted the small tiles); kept in the signature for the next rule.
  (void)sm_count;
  if (form == GMM_GROUPED_K) return kSm90Tile128x256;
  if (rows <= 64) return kSm90Ping64x128;
  if (rows <= 128) return kSm90Tile128x128;
  return kSm90Tile128x256;
}

Engines engines(int dtype, int out, bool tf32, const DevInfo& dev) {
  Engines en;
  const bool is16 = dtype == GMM_F16 || dtype == GMM_BF16;
  if (is16 && (out == dtype || out == GMM_F32)) {
    bool hopper = false;
#if defined(GROUPMM_SM90_TMA)
    hopper = dev.cc_major == 9 && dev.cc_minor == 0;
#endif
    en.primary = (out == dtype && hopper) ? kSm90 : kAligned16;
    en.fallback = kAny16;
  } else if (dtype == GMM_F32 && out == GMM_F32) {
    en.fallback = tf32 ? kTf32 : kF32Simt;
  } else if (dtype == GMM_F64 && out == GMM_F64) {
    en.fallback = kF64;
  } else {
    throw Fail{std::string("unsupported dtype combination: inputs ") + dtype_name(dtype) +
               ", output " + dtype_name(out) +
               " (16-bit inputs give the same dtype or float32; float32 and float64 give their own)"};
  }
  if (dev.cc_major < 8) {
    throw Fail{"GPU of compute capability " + std::to_string(dev.cc_major) + "." +
               std::to_string(dev.cc_minor) + " is not supported (groupmm needs sm_80 or newer)"};
  }
  return en;
}

size_t kind_workspace(Kind kind, int dtype, int combo, int64_t count, int sm_count,
                      int config) {
  if (kind != kSm90 || count == 0) return 0;
#if defined(GROUPMM_SM90_TMA)
  return dtype == GMM_BF16 ? sm90_bf16_workspace_bytes(config, combo, count, sm_count)
                           : sm90_f16_workspace_bytes(config, combo, count, sm_count);
#else
  (void)dtype; (void)combo; (void)sm_count; (void)config;
  return 0;
#endif
}

std::string run_kind(Kind kind, int dtype, int out, int combo, int config, const GemmSet& s,
                     const RunCtx& ctx) {
  if (s.count == 0) return "";
  switch (kind) {
    case kSm90:
#if defined(GROUPMM_SM90_TMA)
      return dtype == GMM_BF16 ? sm90_bf16_run(config, combo, s, ctx)
                               : sm90_f16_run(config, combo, s, ctx);
#else
      (void)config;
      return "sm90 kernels are not in this build";
#endif
    case kAligned16:
    case kAny16:
      return dtype == GMM_BF16 ? sm80_bf16_run(out, combo, kind == kAligned16, s, ctx)
                               : sm80_f16_run(out, combo, kind == kAligned16, s, ctx);
    case kF32Simt: return f32_run(false, combo, s, ctx);
    case kTf32: return f32_run(true, combo, s, ctx);
    case kF64: return f64_run(combo, s, ctx);
    default: return "no kernel for this case";
  }
}

void check_dim(const char* what, int64_t v) {
  if (v < 0 || v > INT32_MAX) {
    throw Fail{std::string(what) + " = " + std::to_string(v) + " is out of range [0, 2^31)"};
  }
}

std::string context(const gmm_packed& p) {
  return std::string("groupmm CUDA (") + form_name(p.form) + ", dtype " + dtype_name(p.dtype) +
         ", out " + dtype_name(p.out_dtype) + ", " + std::to_string(p.groups) +
         " groups, device " + std::to_string(p.device) + "): ";
}

// Everything a packed launch needs, derived on the host from the launch description
// alone (no device reads).
struct PackedPlan {
  PackedDesc d;
  Engines en;
  int combo = 0;
  int config = 0;
  bool need_fallback = true;  // false: alignment proven on the host for every group
  size_t args_bytes = 0;      // primary + fallback sets
  size_t cutlass_bytes = 0;
  DevInfo dev;
};

PackedPlan plan_packed(const gmm_packed& p, const DevInfo& dev) {
  PackedPlan pl;
  pl.dev = dev;
  PackedDesc& d = pl.d;
  if (elem_size(p.dtype) == 0 || elem_size(p.out_dtype) == 0) throw Fail{"unknown dtype code"};
  pl.en = engines(p.dtype, p.out_dtype, p.allow_tf32 != 0, dev);
  check_dim("groups", p.groups);
  check_dim("m", p.m);
  check_dim("n", p.n);
  check_dim("k", p.k);
  const int64_t G = p.groups, m = p.m, n = p.n, k = p.k;
  d.form = p.form;
  d.es_in = elem_size(p.dtype);
  d.es_out = elem_size(p.out_dtype);
  d.groups = G;
  d.m = m;
  d.n = n;
  d.k = k;
  switch (p.form) {
    case GMM_GROUPED_M:
      d.a = normalise("a", -1, p.a, 1, m, k);
      d.b = normalise("b", -1, p.b, G, k, n);
      d.c = normalise("out", -1, p.c, 1, m, n);
      d.extent = m;
      break;
    case GMM_GROUPED_K:
      d.a = normalise("a", -1, p.a, 1, m, k);
      d.b = normalise("b", -1, p.b, 1, k, n);
      d.c = normalise("out", -1, p.c, G, m, n);
      d.extent = k;
      break;
    case GMM_GROUPED_N:
      d.a = normalise("a", -1, p.a, G, m, k);
      d.b = normalise("b", -1, p.b, 1, k, n);
      d.c = normalise("out", -1, p.c, 1, m, n);
      d.extent = n;
      break;
    case GMM_BATCHED:
      d.a = normalise("a", -1, p.a, G, m, k);
      d.b = normalise("b", -1, p.b, G, k, n);
      d.c = normalise("out", -1, p.c, G, m, n);
      d.extent = 0;
      break;
    default: throw Fail{"unknown form code " + std::to_string(p.form)};
  }
  if (d.c.major != kRowMajor) throw Fail{"out must be row-major (unit column stride)"};
  if (p.form != GMM_BATCHED && p.offs == 0 && G > 0) throw Fail{"offs: null device pointer"};
  d.offs = reinterpret_cast<const int*>(p.offs);
  pl.combo = combo_of(d.a.major, d.b.major);
  pl.config = sm90_pick_config(p.form, G, m, n, k, dev.sm_count);
  d.primary_on = pl.en.primary != kNone;

  // Can the host prove every group 16-byte aligned? Bases, leading dims, batch strides
  // and contiguous extents must be, and every stride that offs multiplies.
  if (d.primary_on) {
    const int64_t vi = 16 / d.es_in, vo = 16 / d.es_out;
    auto ok = [](const OpDesc& o, int64_t v) { return o.ptr % 16 == 0 && o.ld % v == 0 && o.bs % v == 0; };
    bool proven = ok(d.a, vi) && ok(d.b, vi) && ok(d.c, vo);
    // contiguous extents (group-dependent ones are not provable)
    auto contig = [&](const OpDesc& o, int64_t rows, int64_t cols, int64_t v, bool rows_grouped,
                      bool cols_grouped) {
      if (o.major == kRowMajor) return !cols_grouped && cols % v == 0 && (!rows_grouped || o.rs % v == 0);
      return !rows_grouped && rows % v == 0 && (!cols_grouped || o.cs % v == 0);
    };
    const bool gm = p.form == GMM_GROUPED_M, gk = p.form == GMM_GROUPED_K,
               gn = p.form == GMM_GROUPED_N;
    proven = proven && contig(d.a, m, k, vi, gm, gk) && contig(d.b, k, n, vi, gk, gn) &&
             contig(d.c, m, n, vo, gm, gn);
    pl.need_fallback = !proven;
  }
  const size_t set = round_up(set_bytes(G), 256);
  pl.args_bytes = 2 * set;
  pl.cutlass_bytes = kind_workspace(pl.en.primary, p.dtype, pl.combo, G, dev.sm_count, pl.config);
  return pl;
}

size_t packed_total(const PackedPlan& pl) {
  return pl.args_bytes + round_up(pl.cutlass_bytes, 256);
}

// Blocks for a kernel that may zero up to max_elems output elements: enough for a few
// 16-byte stores per thread, at most two per SM, at least one.
unsigned zero_blocks(int64_t max_elems, int es, const DevInfo& dev) {
  const int64_t per_block = int64_t(kBuilderThreads) * 4 * (16 / es);
  const int64_t blocks = max_elems / per_block + (max_elems % per_block != 0);
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(dev.sm_count) * 2)));
}

std::string zero_launch(const GemmSet& z, int64_t max_elems, int es, const DevInfo& dev,
                        cudaStream_t stream) {
  if (z.count == 0 || max_elems == 0) return "";
  zero_fill<<<zero_blocks(max_elems, es, dev), kBuilderThreads, 0, stream>>>(z, es);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_fail("zero-fill kernel launch", e);
  return "";
}

void launch_packed(const gmm_packed& p, uint64_t workspace, size_t workspace_bytes) {
  DevInfo dev = enter(p.device);
  PackedPlan pl = plan_packed(p, dev);
  const size_t need = packed_total(pl);
  if (workspace_bytes < need || (need > 0 && workspace == 0)) {
    throw Fail{"workspace too small: " + std::to_string(workspace_bytes) + " bytes given, " +
               std::to_string(need) + " needed (ask packed_workspace_bytes)"};
  }
  if (workspace % 256 != 0) throw Fail{"workspace must be 256-byte aligned"};
  const int64_t G = p.groups;
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(p.stream);
  PackedDesc d = pl.d;
  const size_t set = round_up(set_bytes(G), 256);
  d.primary = set_at(uintptr_t(workspace), G);
  d.fallback = set_at(uintptr_t(workspace) + set, G);
  if (p.form != GMM_BATCHED) d.err_flag = offs_flag(p.device).dev;

  // Arguments and zero fill in one launch (see args.cuh). The most it may zero: every
  // group's output when k = 0 or for GroupedK (empty groups), else the tail.
  int64_t max_zero = p.m * p.n;  // < 2^62
  if (p.form == GMM_GROUPED_K || (p.form == GMM_BATCHED && p.k == 0)) {
    max_zero = G > 0 && max_zero > INT64_MAX / G ? INT64_MAX : max_zero * G;
  }
  if (p.form == GMM_BATCHED && p.k != 0) max_zero = 0;
  build_packed_args<<<zero_blocks(max_zero, d.es_out, dev), kBuilderThreads, 0, stream>>>(d);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw Fail{cuda_fail("argument-builder kernel launch", e)};
  std::string err;

  RunCtx ctx;
  ctx.stream = stream;
  ctx.device = p.device;
  ctx.sm_count = dev.sm_count;
  ctx.workspace = reinterpret_cast<void*>(workspace + pl.args_bytes);
  ctx.workspace_bytes = workspace_bytes - pl.args_bytes;
  if (pl.en.primary != kNone) {
    err = run_kind(pl.en.primary, p.dtype, p.out_dtype, pl.combo, pl.config, d.primary, ctx);
    if (!err.empty()) throw Fail{err};
  }
  if (pl.need_fallback || pl.en.primary == kNone) {
    err = run_kind(pl.en.fallback, p.dtype, p.out_dtype, pl.combo, pl.config, d.fallback, ctx);
    if (!err.empty()) throw Fail{err};
  }
}

// ---------------------------------------------------------------------------------
// List form: per-group arrays built on the host.

struct ListSet {
  Kind kind;
  int combo;
  int64_t count = 0;
  size_t offset = 0;  // in the argument block
};

struct ListPlan {
  Engines en;
  int config = 0;
  DevInfo dev;
  std::vector<OpDesc> a, b, c;
  // route[i]: index into sets (or -1: nothing to run; -2: zero set)
  std::vector<int> route;
  std::vector<ListSet> sets;  // GEMM sets, then nothing else
  int64_t zero_count = 0;
  size_t zero_offset = 0;
  int64_t zero_max_elems = 0;
  size_t bytes = 0;
  size_t cutlass_bytes = 0;
};

std::string context(const gmm_list& l) {
  return std::string("groupmm CUDA (list form, dtype ") + dtype_name(l.dtype) + ", out " +
         dtype_name(l.out_dtype) + ", " + std::to_string(l.groups) + " groups, device " +
         std::to_string(l.device) + "): ";
}

ListPlan plan_list(const gmm_list& l, const DevInfo& dev) {
  ListPlan pl;
  pl.dev = dev;
  if (elem_size(l.dtype) == 0 || elem_size(l.out_dtype) == 0) throw Fail{"unknown dtype code"};
  pl.en = engines(l.dtype, l.out_dtype, l.allow_tf32 != 0, dev);
  check_dim("groups", l.groups);
  const int64_t G = l.groups;
  if (G > 0 && (l.dims == nullptr || l.a == nullptr || l.b == nullptr || l.c == nullptr)) {
    throw Fail{"null group arrays"};
  }
  const int ei = elem_size(l.dtype), eo = elem_size(l.out_dtype);
  int64_t maxn = 0, maxk = 0, summ = 0, nonempty = 0;
  pl.route.assign(size_t(G), -1);
  // set index per (primary?, combo)
  int idx[2][4];
  for (auto& r : idx) for (int& v : r) v = -1;
  for (int64_t i = 0; i < G; ++i) {
    const int64_t m = l.dims[3 * i], n = l.dims[3 * i + 1], k = l.dims[3 * i + 2];
    if (m < 0 || n < 0 || k < 0 || m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) {
      throw Fail{"group " + std::to_string(i) + ": (m, n, k) = (" + std::to_string(m) + ", " +
                 std::to_string(n) + ", " + std::to_string(k) + ") out of range [0, 2^31)"};
    }
    OpDesc a = normalise("As", i, l.a[i], 1, m, k);
    OpDesc b = normalise("Bs", i, l.b[i], 1, k, n);
    OpDesc c = normalise("out", i, l.c[i], 1, m, n);
    if (c.major != kRowMajor) throw Fail{"out[" + std::to_string(i) + "] must be row-major"};
    pl.a.push_back(a);
    pl.b.push_back(b);
    pl.c.push_back(c);
    maxn = std::max(maxn, n);
    maxk = std::max(maxk, k);
    if (m == 0 || n == 0) continue;
    summ += m;
    nonempty++;
    if (k == 0) {
      pl.route[size_t(i)] = -2;
      pl.zero_count++;
      pl.zero_max_elems = std::max(pl.zero_max_elems, m * n);
      continue;
    }
    bool fast = pl.en.primary != kNone;
    if (fast) {
      auto al = [](const OpDesc& o, int64_t contig, int es) {
        return o.ptr % 16 == 0 && (o.ld * es) % 16 == 0 && (contig * es) % 16 == 0;
      };
      fast = al(a, a.major == kRowMajor ? k : m, ei) && al(b, b.major == kRowMajor ? n : k, ei) &&
             al(c, n, eo);
    }
    const int combo = combo_of(a.major, b.major);
    int& s = idx[fast ? 0 : 1][combo];
    if (s < 0) {
      s = int(pl.sets.size());
      pl.sets.push_back(ListSet{fast ? pl.en.primary : pl.en.fallback, combo});
    }
    pl.sets[size_t(s)].count++;
    pl.route[size_t(i)] = s;
  }
  pl.config = sm90_pick_config(-1, std::max<int64_t>(1, nonempty),
                               nonempty > 0 ? summ / nonempty : 0, maxn, maxk, dev.sm_count);
  size_t off = 0;
  for (ListSet& s : pl.sets) {
    s.offset = off;
    off += round_up(set_bytes(s.count), 256);
    pl.cutlass_bytes =
        std::max(pl.cutlass_bytes, kind_workspace(s.kind, l.dtype, s.combo, s.count, dev.sm_count, pl.config));
  }
  pl.zero_offset = off;
  off += round_up(set_bytes(pl.zero_count), 256);
  pl.bytes = off;
  return pl;
}

DevInfo list_dev(const gmm_list& l) {
  // The plan only needs device attributes; no cudaSetDevice for host-only calls.
  check_device(l.device);
  DevInfo dev = dev_info(l.device);
  if (dev.err != cudaSuccess) throw Fail{cuda_fail("cudaDeviceGetAttribute", dev.err)};
  return dev;
}

void write_list(const gmm_list& l, void* host, size_t host_bytes, uint64_t device_addr) {
  ListPlan pl = plan_list(l, list_dev(l));
  if (host_bytes < pl.bytes || (pl.bytes > 0 && host == nullptr)) {
    throw Fail{"argument block too small: " + std::to_string(host_bytes) + " bytes given, " +
               std::to_string(pl.bytes) + " needed"};
  }
  if (device_addr % 256 != 0) throw Fail{"argument block device address must be 256-byte aligned"};
  // Stage through an aligned buffer when the caller's is not 16-byte aligned (the block
  // holds 8-byte pointers and ints written through typed pointers).
  std::vector<uint64_t> staging;
  void* dst = host;
  if (uintptr_t(host) % 16 != 0) {
    staging.assign(pl.bytes / 8 + 2, 0);
    dst = reinterpret_cast<void*>(round_up(uintptr_t(staging.data()), 16));
  }
  std::memset(dst, 0, pl.bytes);
  const uintptr_t hbase = uintptr_t(dst);
  std::vector<int64_t> fill(pl.sets.size(), 0);
  int64_t zfill = 0;
  GemmSet zero = set_at(hbase + pl.zero_offset, pl.zero_count);
  std::vector<GemmSet> sets;
  for (const ListSet& s : pl.sets) sets.push_back(set_at(hbase + s.offset, s.count));
  for (int64_t i = 0; i < l.groups; ++i) {
    const int r = pl.route[size_t(i)];
    const int64_t m = l.dims[3 * i], n = l.dims[3 * i + 1], k = l.dims[3 * i + 2];
    const OpDesc &a = pl.a[size_t(i)], &b = pl.b[size_t(i)], &c = pl.c[size_t(i)];
    GemmSet* s = nullptr;
    int64_t j = 0;
    if (r == -2) {
      s = &zero;
      j = zfill++;
    } else if (r >= 0) {
      s = &sets[size_t(r)];
      j = fill[size_t(r)]++;
    } else {
      continue;
    }
    s->prob[3 * j] = int(m);
    s->prob[3 * j + 1] = int(n);
    s->prob[3 * j + 2] = r == -2 ? 0 : int(k);
    s->a[j] = reinterpret_cast<void*>(a.ptr);
    s->b[j] = reinterpret_cast<void*>(b.ptr);
    s->c[j] = reinterpret_cast<void*>(c.ptr);
    s->lda[j] = a.ld;
    s->ldb[j] = b.ld;
    s->ldc[j] = c.ld;
  }
  if (dst != host) std::memcpy(host, dst, pl.bytes);
  // Internal pointers are device addresses; the values above are already device
  // pointers, nothing else in the block points into it.
  (void)device_addr;
}

void launch_list(const gmm_list& l, uint64_t device_args, uint64_t workspace,
                 size_t workspace_bytes) {
  DevInfo dev = enter(l.device);
  ListPlan pl = plan_list(l, dev);
  if (pl.bytes > 0 && device_args == 0) throw Fail{"null device argument block"};
  if (device_args % 256 != 0) throw Fail{"argument block device address must be 256-byte aligned"};
  if (workspace_bytes < pl.cutlass_bytes || (pl.cutlass_bytes > 0 && workspace == 0)) {
    throw Fail{"workspace too small: " + std::to_string(workspace_bytes) + " bytes given, " +
               std::to_string(pl.cutlass_bytes) + " needed (ask list_workspace_bytes)"};
  }
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(l.stream);
  GemmSet zero = set_at(uintptr_t(device_args) + pl.zero_offset, pl.zero_count);
  std::string err = zero_launch(zero, pl.zero_max_elems, elem_size(l.out_dtype), dev, stream);
  if (!err.empty()) throw Fail{err};
  RunCtx ctx;
  ctx.stream = stream;
  ctx.device = l.device;
  ctx.sm_count = dev.sm_count;
  ctx.workspace = reinterpret_cast<void*>(workspace);
  ctx.workspace_bytes = workspace_bytes;
  for (const ListSet& s : pl.sets) {
    GemmSet set = set_at(uintptr_t(device_args) + s.offset, s.count);
    err = run_kind(s.kind, l.dtype, l.out_dtype, s.combo, pl.config, set, ctx);
    if (!err.empty()) throw Fail{err};
  }
}

template <class F>
int guarded(const std::string& ctx, char* msg, size_t msg_len, F&& f) {
  try {
    f();
    return 0;
  } catch (const Fail& e) {
    return report(ctx + e.msg, msg, msg_len);
  } catch (const std::exception& e) {
    return report(ctx + "internal error: " + e.what(), msg, msg_len);
  } catch (...) {
    return report(ctx + "internal error", msg, msg_len);
  }
}

}  // namespace
}  // namespace gmm

using namespace gmm;

extern "C" {

int gmm_packed_workspace_bytes(const gmm_packed* p, size_t* bytes, char* msg, size_t msg_len) {
  if (p == nullptr || bytes == nullptr) return report("groupmm CUDA: null argument", msg, msg_len);
  return guarded(context(*p), msg, msg_len, [&] {
    check_device(p->device);
    DevInfo dev = dev_info(p->device);
    if (dev.err != cudaSuccess) throw Fail{cuda_fail("cudaDeviceGetAttribute", dev.err)};
    *bytes = packed_total(plan_packed(*p, dev));
  });
}

int gmm_launch_packed(const gmm_packed* p, uint64_t workspace, size_t workspace_bytes, char* msg,
                      size_t msg_len) {
  if (p == nullptr) return report("groupmm CUDA: null argument", msg, msg_len);
  return guarded(context(*p), msg, msg_len,
                 [&] { launch_packed(*p, workspace, workspace_bytes); });
}

int gmm_list_args_bytes(const gmm_list* l, size_t* bytes, char* msg, size_t msg_len) {
  if (l == nullptr || bytes == nullptr) return report("groupmm CUDA: null argument", msg, msg_len);
  return guarded(context(*l), msg, msg_len, [&] { *bytes = plan_list(*l, list_dev(*l)).bytes; });
}

int gmm_write_list_args(const gmm_list* l, void* host, size_t host_bytes, uint64_t device_addr,
                        char* msg, size_t msg_len) {
  if (l == nullptr) return report("groupmm CUDA: null argument", msg, msg_len);
  return guarded(context(*l), msg, msg_len,
                 [&] { write_list(*l, host, host_bytes, device_addr); });
}

int gmm_list_workspace_bytes(const gmm_list* l, size_t* bytes, char* msg, size_t msg_len) {
  if (l == nullptr || bytes == nullptr) return report("groupmm CUDA: null argument", msg, msg_len);
  return guarded(context(*l), msg, msg_len,
                 [&] { *bytes = plan_list(*l, list_dev(*l)).cutlass_bytes; });
}

int gmm_launch_list(const gmm_list* l, uint64_t device_args, uint64_t workspace,
                    size_t workspace_bytes, char* msg, size_t msg_len) {
  if (l == nullptr) return report("groupmm CUDA: null argument", msg, msg_len);
  return guarded(context(*l), msg, msg_len,
                 [&] { launch_list(*l, device_args, workspace, workspace_bytes); });
}

int gmm_take_offs_error(int32_t device, int32_t* flag, char* msg, size_t msg_len) {
  if (flag == nullptr) return report("groupmm CUDA: null argument", msg, msg_len);
  return guarded("groupmm CUDA (take_offs_error, device " + std::to_string(device) + "): ", msg,
                 msg_len, [&] {
                   check_device(device);
                   int* h = nullptr;
                   {
                     std::lock_guard<std::mutex> lock(flag_mutex);
                     h = flags[device].host;
                   }
                   *flag = 0;
                   if (h != nullptr) {
                     volatile int* v = h;
                     *flag = *v;
                     if (*flag) *v = 0;
                   }
                 });
}

int gmm_stream_capturing(uint64_t stream, int32_t* capturing, char* msg, size_t msg_len) {
  if (capturing == nullptr) return report("groupmm CUDA: null argument", msg, msg_len);
  return guarded("groupmm CUDA (stream_capturing): ", msg, msg_len, [&] {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    cudaError_t e = cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(stream), &st);
    if (e != cudaSuccess) throw Fail{cuda_fail("cudaStreamIsCapturing", e)};
    *capturing = st != cudaStreamCaptureStatusNone;
  });
}

const char* gmm_cutlass_version(void) {
#define GMM_STR2(x) #x
#define GMM_STR(x) GMM_STR2(x)
  return GMM_STR(CUTLASS_MAJOR) "." GMM_STR(CUTLASS_MINOR) "." GMM_STR(CUTLASS_PATCH);
}

int gmm_has_sm90(void) {
#if defined(GROUPMM_SM90_TMA)
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
