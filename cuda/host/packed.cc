// The packed forms: plan once from the request (kernel choice, alignment routing,
// workspace size), then launch the argument builder and the kernels on the caller's
// stream. No host sync, no device reads, no allocation: capturable. Host only.
#include "host/api.h"

#include "device/align.h"
#include "groupmm/src/exec/ffi.rs.h"
#include "heuristics/choose.h"

#include <algorithm>
#include <climits>
#include <memory>
#include <stdexcept>
#include <string>

namespace gmm {
namespace {

void check_dim(const char* what, int64_t v) {
  if (v < 0 || v > INT32_MAX) {
    throw std::runtime_error(std::string(what) + " = " + std::to_string(v) +
                             " is out of range [0, 2^31) of the kernels' problem sizes");
  }
}

std::string context(const PackedRequest& r) {
  return std::string("groupmm CUDA (") + form_name(r.form) + ", dtype " + dtype_name(r.dtype) +
         ", out " + dtype_name(r.out_dtype) + ", " + std::to_string(r.groups) + " groups, device " +
         std::to_string(r.device) + "): ";
}

// The fusion's epilogue name (the bridge's &str, valid for the call).
Epilogue epilogue_of(const Fusion& f) { return Epilogue(f.epilogue.data(), f.epilogue.size()); }

// The fusion's epilogue operands as the varlen kernels read them: by position, in the order
// of the epilogue's rule (its policy's argument block reads them, epilogue/<name>.h).
varlen::EpiOperands epi_operands(const Fusion& f) {
  varlen::EpiOperands o;
  static_assert(varlen::kEpiOperands == sizeof(f.operands) / sizeof(f.operands[0]),
                "the bridge's Fusion::operands and varlen::kEpiOperands disagree");
  for (int i = 0; i < varlen::kEpiOperands; ++i) o.at[i] = f.operands[i];
  return o;
}

// The call as the varlen kernels would read it (kernels/varlen/args.h): a GroupedM call with
// row-major activations, or a GroupedK call with M-major A (x^T of row-major x) and row-major
// B (dY); false for any other layout.
bool varlen_args(const PackedRequest& r, const PackedDesc& d, const PackedPlan& pl,
                 varlen::Args& x) {
  if (r.form == Form::GroupedM && d.a.major == kRowMajor) {
    x.mode = varlen::Mode::M;
    x.b_k_major = d.b.major == kColMajor;
    x.ldd_batch = 0;
  } else if (r.form == Form::GroupedK && d.a.major == kColMajor && d.b.major == kRowMajor) {
    x.mode = varlen::Mode::K;
    x.ldd_batch = d.c.bs;
  } else {
    return false;
  }
  x.a = reinterpret_cast<const void*>(d.a.ptr);
  x.lda = d.a.ld;
  x.src = reinterpret_cast<const int*>(r.fusion.src);
  if (r.fusion.src != 0) {
    // The gathered operand's source rows: a's rows (GroupedM: x [rows, K]), the columns of
    // a = x^T (GroupedK, A gathered) or b's rows (GroupedK, B = dY gathered).
    x.gather_op = r.fusion.src_b ? varlen::Gather::B : varlen::Gather::A;
    x.gathered_rows = r.fusion.src_b ? r.b.rows : x.mode == varlen::Mode::M ? r.a.rows : r.a.cols;
  }
  x.epi = epi_operands(r.fusion);
  x.b = reinterpret_cast<const void*>(d.b.ptr);
  x.ldb = d.b.ld;
  x.ldb_batch = d.b.bs;
  x.d = reinterpret_cast<void*>(d.c.ptr);
  x.ldd = d.c.ld;
  x.offs = d.offs;
  x.groups = int(d.groups);
  x.m = int(d.m);
  x.n = int(d.n);
  x.k = int(d.k);
  x.sm_count = pl.dev.sm_count;
  x.device = pl.device;
  x.stream = pl.stream;
  return true;
}

PackedPlan plan_packed(const PackedRequest& r, const DevInfo& dev) {
  PackedPlan pl;
  pl.dev = dev;
  pl.device = r.device;
  pl.stream = reinterpret_cast<cudaStream_t>(r.stream);
  check_dim("groups", r.groups);
  check_dim("m", r.m);
  check_dim("n", r.n);
  check_dim("k", r.k);
  const int64_t G = r.groups, m = r.m, n = r.n, k = r.k;
  PackedDesc& d = pl.d;
  d.form = r.form;
  d.es_in = elem_size(r.dtype);
  d.es_out = elem_size(r.out_dtype);
  d.groups = G;
  d.m = m;
  d.n = n;
  d.k = k;
  d.a = op_desc(r.a);
  d.b = op_desc(r.b);
  d.c = op_desc(r.c);
  d.extent = r.form == Form::GroupedM   ? m
             : r.form == Form::GroupedK ? k
             : r.form == Form::GroupedN ? n
                                        : 0;
  if (d.c.major != kRowMajor) throw std::runtime_error("out must be row-major");
  d.offs = reinterpret_cast<const int*>(r.offs);
  if (r.form != Form::Batched && d.offs == nullptr && G > 0) {
    throw std::runtime_error("offs: null device pointer");
  }
  pl.combo = combo_of(d.a.major, d.b.major);
  PackedCall call;
  call.form = r.form;
  call.in = r.dtype;
  call.out = r.out_dtype;
  call.allow_tf32 = r.allow_tf32;
  call.groups = G;
  call.m = m;
  call.n = n;
  call.k = k;
  call.gather = r.fusion.src == 0 ? varlen::Gather::None
                : r.fusion.src_b  ? varlen::Gather::B
                                  : varlen::Gather::A;
  call.epi = epilogue_of(r.fusion);
  if (varlen_args(r, d, pl, pl.va)) call.varlen = &pl.va;
  const PackedChoice choice = choose_packed(call, dev);
  pl.unsupported = choice.unsupported;
  pl.varlen = choice.varlen;
  if (pl.unsupported || pl.varlen != nullptr) return pl;
  pl.k = choice.kernels;
  d.primary_on = pl.k.primary != nullptr;

  // Can the host prove every group 16-byte aligned (device/align.h)? The bases, leading
  // dims and batch strides must be, every stride that offs multiplies, and the contiguous
  // extents (a group-dependent one is not provable).
  if (d.primary_on) {
    const bool gm = r.form == Form::GroupedM, gk = r.form == Form::GroupedK,
               gn = r.form == Form::GroupedN;
    // Operand o of `rows` x `cols` whose rows (columns) are grouped when rows_grouped
    // (cols_grouped): its contiguous extent, or -1 when it varies by group.
    auto provable = [](const OpDesc& o, int64_t rows, int64_t cols, int es, bool rows_grouped,
                       bool cols_grouped) {
      const bool row_major = o.major == kRowMajor;
      if (row_major ? cols_grouped : rows_grouped) return false;  // contiguous extent varies
      const int64_t contig = row_major ? cols : rows;
      const int64_t grouped_stride = rows_grouped ? o.rs : cols_grouped ? o.cs : 0;
      return aligned16(o.ptr, o.ld, contig, es) && is16(o.bs * es) && is16(grouped_stride * es);
    };
    const bool proven = provable(d.a, m, k, d.es_in, gm, gk) &&
                        provable(d.b, k, n, d.es_in, gk, gn) &&
                        provable(d.c, m, n, d.es_out, gm, gn);
    pl.need_fallback = !proven;
  }
  const size_t set = round_up(set_bytes(G), 256);
  pl.args_bytes = 2 * set;
  pl.cutlass_bytes = kernel_workspace(pl.k.primary, pl.combo, G, dev.sm_count);
  // The most the builder may zero: every group's output when k = 0 or for GroupedK
  // (empty groups), else the tail; nothing for a batched product with k > 0.
  int64_t max_zero = m * n;  // < 2^62
  if (r.form == Form::GroupedK || (r.form == Form::Batched && k == 0)) {
    max_zero = G > 0 && max_zero > INT64_MAX / G ? INT64_MAX : max_zero * G;
  }
  if (r.form == Form::Batched && k != 0) max_zero = 0;
  pl.max_zero = max_zero;
  return pl;
}

void launch(const PackedPlan& pl, uint64_t workspace, size_t workspace_bytes) {
  const size_t need = pl.workspace_bytes();
  if (workspace_bytes < need || (need > 0 && workspace == 0)) {
    throw std::runtime_error("workspace too small: " + std::to_string(workspace_bytes) +
                             " bytes given, " + std::to_string(need) + " needed");
  }
  if (workspace % 256 != 0) throw std::runtime_error("workspace must be 256-byte aligned");
  if (pl.varlen != nullptr) {  // one launch: the kernel reads offs itself
    varlen::Args x = pl.va;
    x.err_flag = error_flag(pl.device);
    const std::string err = pl.varlen->run_varlen(x);
    if (!err.empty()) throw std::runtime_error(err);
    return;
  }
  const int64_t G = pl.d.groups;
  PackedDesc d = pl.d;
  const size_t set = round_up(set_bytes(G), 256);
  d.primary = set_at(uintptr_t(workspace), G);
  d.fallback = set_at(uintptr_t(workspace) + set, G);
  if (d.form != Form::Batched) d.err_flag = error_flag(pl.device);

  // Arguments and zero fill in one launch (device/args.cu).
  cudaError_t e =
      launch_packed_args(d, zero_blocks(pl.max_zero, d.es_out, pl.dev.sm_count), pl.stream);
  if (e != cudaSuccess) throw std::runtime_error(cuda_fail("argument-builder kernel launch", e));

  RunCtx ctx;
  ctx.stream = pl.stream;
  ctx.device = pl.device;
  ctx.sm_count = pl.dev.sm_count;
  ctx.workspace = reinterpret_cast<void*>(workspace + pl.args_bytes);
  ctx.workspace_bytes = workspace_bytes - pl.args_bytes;
  if (pl.k.primary != nullptr) run_kernel(pl.k.primary, pl.combo, d.primary, ctx);
  if (pl.need_fallback || pl.k.primary == nullptr) {
    run_kernel(pl.k.fallback, pl.combo, d.fallback, ctx);
  }
}

}  // namespace

OpDesc op_desc(const Operand& o) {
  OpDesc d;
  d.ptr = uintptr_t(o.ptr);
  d.major = o.col_major ? kColMajor : kRowMajor;
  d.ld = o.ld;
  d.rs = o.col_major ? 1 : o.ld;
  d.cs = o.col_major ? o.ld : 1;
  d.bs = o.batch_stride;
  return d;
}

PackedSubmit submit_packed(const PackedRequest& r, uint64_t workspace, size_t workspace_bytes) {
  PackedSubmit out{};
  try {
    if (r.fusion.src != 0 && r.form != Form::GroupedM && r.form != Form::GroupedK) {
      throw std::runtime_error(
          "internal: gathered rows (fusion.src) need a GroupedM or GroupedK form");
    }
    if (r.fusion.src_b && r.form != Form::GroupedK) {
      throw std::runtime_error("internal: gathered B rows (fusion.src_b) need the GroupedK form");
    }
    if (!epilogue_of(r.fusion).empty() && r.form != Form::GroupedM) {
      throw std::runtime_error("internal: a fused epilogue needs the GroupedM form");
    }
    // The deferred error flag, once per call: a retry on rows the call gathered itself
    // (flag_taken) leaves that gather's index error for the next call.
    if (!r.flag_taken) {
      if (const int flag = take_error_flag(r.device)) {
        out.status = flag == kErrIndex ? Submitted::IndexPending : Submitted::OffsPending;
        return out;
      }
    }
    // In-GEMM gathering off (a development build's GROUPMM_SM90_GATHER=0,
    // heuristics/choose.h): answer before
    // any device work, so that the caller's composed path plans the product once.
    if (r.fusion.src != 0 && !gather_in_gemm()) {
      out.status = Submitted::Unsupported;
      return out;
    }
    PackedPlan pl = plan_packed(r, enter(r.device));
    if (pl.unsupported) {
      out.status = Submitted::Unsupported;
      return out;
    }
    const size_t need = pl.workspace_bytes();
    const bool capturing = need > 0 && stream_capturing(pl.stream);
    if (!capturing && workspace_bytes >= need && (need == 0 || workspace != 0)) {
      launch(pl, workspace, workspace_bytes);
      out.status = Submitted::Launched;
      return out;
    }
    out.status = Submitted::NeedWorkspace;
    out.workspace_bytes = need;
    out.capturing = capturing;
    out.plan = std::make_unique<PackedPlan>(std::move(pl));
    return out;
  } catch (const std::exception& e) {
    throw std::runtime_error(context(r) + e.what());
  }
}

void launch_planned(const PackedPlan& plan, uint64_t workspace, size_t workspace_bytes) {
  try {
    enter(plan.device);
    launch(plan, workspace, workspace_bytes);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("groupmm CUDA (") + form_name(plan.d.form) + ", " +
                             std::to_string(plan.d.groups) + " groups, device " +
                             std::to_string(plan.device) + "): " + e.what());
  }
}

bool gathers_in_gemm(int32_t device, DType dtype) {
  try {
    return gathers_rows(dtype, device_info(device));
  } catch (const std::exception& e) {
    throw std::runtime_error("groupmm CUDA (gathers_in_gemm, device " + std::to_string(device) +
                             "): " + e.what());
  }
}

bool take_deferred_error(int32_t device) {
  try {
    return take_error_flag(device) != 0;
  } catch (const std::exception& e) {
    throw std::runtime_error("groupmm CUDA (take_deferred_error, device " + std::to_string(device) +
                             "): " + e.what());
  }
}

}  // namespace gmm
