// The list form: per-group arguments built on the host. plan_list routes each group (a
// kernel and layout combination, aligned or not, or the zero set of k = 0 groups) and
// sizes compact sets; write_list_args fills them into the caller's host block, which the
// caller copies to the device once, asynchronously; launch_list runs one kernel per
// non-empty set (at most 8 GEMM launches + 1 zero fill). Host only.
#include "host/api.h"

#include "device/align.h"
#include "groupmm/src/exec/ffi.rs.h"
#include "heuristics/choose.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

namespace gmm {
namespace {

std::string context(const ListRequest& r, size_t groups) {
  return std::string("groupmm CUDA (list form, dtype ") + dtype_name(r.dtype) + ", out " +
         dtype_name(r.out_dtype) + ", " + std::to_string(groups) + " groups, device " +
         std::to_string(r.device) + "): ";
}

std::unique_ptr<ListPlan> plan(const ListRequest& r, const ListGroup* groups, size_t count,
                               const DevInfo& dev) {
  auto pl = std::make_unique<ListPlan>();
  pl->out = r.out_dtype;
  pl->device = r.device;
  pl->stream = reinterpret_cast<cudaStream_t>(r.stream);
  pl->dev = dev;
  // Whether the engines of this dtype pair have an aligned primary (choose.h).
  const bool aligned_engine = has_aligned_engine(r.dtype, r.out_dtype);
  if (count > size_t(INT32_MAX)) throw std::runtime_error("too many groups");
  const int64_t G = int64_t(count);
  if (G > 0 && groups == nullptr) throw std::runtime_error("null group array");
  const int ei = elem_size(r.dtype), eo = elem_size(r.out_dtype);
  int64_t maxn = 0, maxk = 0, summ = 0, nonempty = 0;
  pl->route.assign(size_t(G), -1);
  // Provisional sets per (aligned?, combo); their kernels are resolved once the sm90
  // configuration is known.
  int idx[2][4];
  for (auto& row : idx)
    for (int& v : row) v = -1;
  std::vector<bool> set_aligned;
  for (int64_t i = 0; i < G; ++i) {
    const ListGroup& g = groups[i];
    const int64_t m = g.a.rows, k = g.a.cols, n = g.b.cols;
    if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) {
      throw std::runtime_error("group " + std::to_string(i) + ": (m, n, k) = (" +
                               std::to_string(m) + ", " + std::to_string(n) + ", " +
                               std::to_string(k) + ") out of range [0, 2^31)");
    }
    const OpDesc a = op_desc(g.a), b = op_desc(g.b), c = op_desc(g.c);
    if (c.major != kRowMajor) {
      throw std::runtime_error("out[" + std::to_string(i) + "] must be row-major");
    }
    pl->dims.insert(pl->dims.end(), {m, n, k});
    pl->a.push_back(a);
    pl->b.push_back(b);
    pl->c.push_back(c);
    maxn = std::max(maxn, n);
    maxk = std::max(maxk, k);
    if (m == 0 || n == 0) continue;
    summ += m;
    nonempty++;
    if (k == 0) {
      pl->route[size_t(i)] = -2;
      pl->zero_count++;
      pl->zero_max_elems = std::max(pl->zero_max_elems, m * n);
      continue;
    }
    const bool fast = aligned_engine && aligned16(a.ptr, a.ld, a.major == kRowMajor ? k : m, ei) &&
                      aligned16(b.ptr, b.ld, b.major == kRowMajor ? n : k, ei) &&
                      aligned16(c.ptr, c.ld, n, eo);
    const int combo = combo_of(a.major, b.major);
    int& s = idx[fast ? 0 : 1][combo];
    if (s < 0) {
      s = int(pl->sets.size());
      pl->sets.push_back(ListSet{nullptr, combo});
      set_aligned.push_back(fast);
    }
    pl->sets[size_t(s)].count++;
    pl->route[size_t(i)] = s;
  }
  ListCall call;
  call.in = r.dtype;
  call.out = r.out_dtype;
  call.allow_tf32 = r.allow_tf32;
  call.groups = std::max<int64_t>(1, nonempty);
  call.avg_m = nonempty > 0 ? summ / nonempty : 0;
  call.max_n = maxn;
  call.max_k = maxk;
  const Kernels ks = choose_list(call, dev);
  size_t off = 0;
  for (size_t j = 0; j < pl->sets.size(); ++j) {
    ListSet& s = pl->sets[j];
    s.kernel = set_aligned[j] ? ks.primary : ks.fallback;
    s.offset = off;
    off += round_up(set_bytes(s.count), 256);
    pl->cutlass_bytes =
        std::max(pl->cutlass_bytes, kernel_workspace(s.kernel, s.combo, s.count, dev.sm_count));
  }
  pl->zero_offset = off;
  off += round_up(set_bytes(pl->zero_count), 256);
  pl->bytes = off;
  return pl;
}

}  // namespace

ListPlanned plan_list(const ListRequest& r, const ListGroup* groups, size_t count) {
  ListPlanned out{};
  try {
    if (const int flag = take_error_flag(r.device)) {
      out.offs_pending = flag != kErrIndex;
      out.index_pending = flag == kErrIndex;
      return out;
    }
    // Planning needs the device's facts only: no cudaSetDevice for this host-only call.
    out.plan = plan(r, groups, count, device_info(r.device));
    out.args_bytes = out.plan->bytes;
    out.workspace_bytes = out.plan->cutlass_bytes;
    return out;
  } catch (const std::exception& e) {
    throw std::runtime_error(context(r, count) + e.what());
  }
}

void write_list_args(const ListPlan& pl, uint8_t* host, size_t bytes) {
  if (bytes < pl.bytes || (pl.bytes > 0 && host == nullptr)) {
    throw std::runtime_error(
        "groupmm CUDA (list form): argument block too small: " + std::to_string(bytes) +
        " bytes given, " + std::to_string(pl.bytes) + " needed");
  }
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
  for (size_t i = 0; i < pl.route.size(); ++i) {
    const int r = pl.route[i];
    const int64_t m = pl.dims[3 * i], n = pl.dims[3 * i + 1], k = pl.dims[3 * i + 2];
    const OpDesc &a = pl.a[i], &b = pl.b[i], &c = pl.c[i];
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
  // The values are device addresses; nothing in the block points into the block.
  if (dst != host) std::memcpy(host, dst, pl.bytes);
}

void launch_list(const ListPlan& pl, uint64_t device_args, uint64_t workspace,
                 size_t workspace_bytes) {
  try {
    enter(pl.device);
    if (pl.bytes > 0 && device_args == 0) throw std::runtime_error("null device argument block");
    if (device_args % 256 != 0) {
      throw std::runtime_error("argument block device address must be 256-byte aligned");
    }
    if (workspace_bytes < pl.cutlass_bytes || (pl.cutlass_bytes > 0 && workspace == 0)) {
      throw std::runtime_error("workspace too small: " + std::to_string(workspace_bytes) +
                               " bytes given, " + std::to_string(pl.cutlass_bytes) + " needed");
    }
    const GemmSet zero = set_at(uintptr_t(device_args) + pl.zero_offset, pl.zero_count);
    if (zero.count > 0 && pl.zero_max_elems > 0) {
      const int es = elem_size(pl.out);
      cudaError_t e = launch_zero_fill(
          zero, es, zero_blocks(pl.zero_max_elems, es, pl.dev.sm_count), pl.stream);
      if (e != cudaSuccess) throw std::runtime_error(cuda_fail("zero-fill kernel launch", e));
    }
    RunCtx ctx;
    ctx.stream = pl.stream;
    ctx.device = pl.device;
    ctx.sm_count = pl.dev.sm_count;
    ctx.workspace = reinterpret_cast<void*>(workspace);
    ctx.workspace_bytes = workspace_bytes;
    for (const ListSet& s : pl.sets) {
      run_kernel(s.kernel, s.combo, set_at(uintptr_t(device_args) + s.offset, s.count), ctx);
    }
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("groupmm CUDA (list form, ") +
                             std::to_string(pl.route.size()) + " groups, device " +
                             std::to_string(pl.device) + "): " + e.what());
  }
}

}  // namespace gmm
