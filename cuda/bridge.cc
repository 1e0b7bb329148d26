// cxx bridge glue (host compiler): converts the shared structs of src/cuda.rs into the
// C structs of launch.h and every non-zero launcher status into std::runtime_error.
#include "bridge.h"

#include "groupmm/src/cuda.rs.h"
#include "launch.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace groupmm {
namespace {

constexpr size_t kMsgLen = 2048;

void check(int rc, const char* msg) {
  if (rc != 0) throw std::runtime_error(msg[0] ? msg : "groupmm CUDA: unknown error");
}

gmm_operand op(const FfiOperand& o) {
  gmm_operand r;
  r.ptr = o.ptr;
  r.batch = o.batch;
  r.rows = o.rows;
  r.cols = o.cols;
  r.batch_stride = o.batch_stride;
  r.row_stride = o.row_stride;
  r.col_stride = o.col_stride;
  return r;
}

gmm_packed packed(const FfiPacked& p) {
  gmm_packed r;
  r.form = p.form;
  r.dtype = p.dtype;
  r.out_dtype = p.out_dtype;
  r.device = p.device;
  r.groups = p.groups;
  r.m = p.m;
  r.n = p.n;
  r.k = p.k;
  r.a = op(p.a);
  r.b = op(p.b);
  r.c = op(p.c);
  r.offs = p.offs;
  r.stream = p.stream;
  r.allow_tf32 = p.allow_tf32 ? 1 : 0;
  return r;
}

// Owns the converted per-group arrays of a list launch.
struct List {
  gmm_list l{};
  std::vector<gmm_operand> a, b, c;

  List(const FfiList& h, rust::Slice<const int64_t> dims, rust::Slice<const FfiOperand> as,
       rust::Slice<const FfiOperand> bs, rust::Slice<const FfiOperand> cs) {
    const size_t g = as.size();
    if (bs.size() != g || cs.size() != g || dims.size() != 3 * g) {
      throw std::runtime_error("groupmm CUDA (list form): inconsistent group counts");
    }
    for (const auto& o : as) a.push_back(op(o));
    for (const auto& o : bs) b.push_back(op(o));
    for (const auto& o : cs) c.push_back(op(o));
    l.dtype = h.dtype;
    l.out_dtype = h.out_dtype;
    l.device = h.device;
    l.allow_tf32 = h.allow_tf32 ? 1 : 0;
    l.groups = int64_t(g);
    l.dims = dims.data();
    l.a = a.data();
    l.b = b.data();
    l.c = c.data();
    l.stream = h.stream;
  }
};

}  // namespace

size_t packed_workspace_bytes(const FfiPacked& p) {
  gmm_packed q = packed(p);
  char msg[kMsgLen] = {0};
  size_t bytes = 0;
  check(gmm_packed_workspace_bytes(&q, &bytes, msg, kMsgLen), msg);
  return bytes;
}

void launch_packed(const FfiPacked& p, uint64_t workspace, size_t workspace_bytes) {
  gmm_packed q = packed(p);
  char msg[kMsgLen] = {0};
  check(gmm_launch_packed(&q, workspace, workspace_bytes, msg, kMsgLen), msg);
}

size_t list_args_bytes(const FfiList& l, rust::Slice<const int64_t> dims,
                       rust::Slice<const FfiOperand> a, rust::Slice<const FfiOperand> b,
                       rust::Slice<const FfiOperand> c) {
  List x(l, dims, a, b, c);
  char msg[kMsgLen] = {0};
  size_t bytes = 0;
  check(gmm_list_args_bytes(&x.l, &bytes, msg, kMsgLen), msg);
  return bytes;
}

void write_list_args(const FfiList& l, rust::Slice<const int64_t> dims,
                     rust::Slice<const FfiOperand> a, rust::Slice<const FfiOperand> b,
                     rust::Slice<const FfiOperand> c, rust::Slice<uint8_t> host,
                     uint64_t device_addr) {
  List x(l, dims, a, b, c);
  char msg[kMsgLen] = {0};
  check(gmm_write_list_args(&x.l, host.data(), host.size(), device_addr, msg, kMsgLen), msg);
}

size_t list_workspace_bytes(const FfiList& l, rust::Slice<const int64_t> dims,
                            rust::Slice<const FfiOperand> a, rust::Slice<const FfiOperand> b,
                            rust::Slice<const FfiOperand> c) {
  List x(l, dims, a, b, c);
  char msg[kMsgLen] = {0};
  size_t bytes = 0;
  check(gmm_list_workspace_bytes(&x.l, &bytes, msg, kMsgLen), msg);
  return bytes;
}

void launch_list(const FfiList& l, rust::Slice<const int64_t> dims,
                 rust::Slice<const FfiOperand> a, rust::Slice<const FfiOperand> b,
                 rust::Slice<const FfiOperand> c, uint64_t device_args, uint64_t workspace,
                 size_t workspace_bytes) {
  List x(l, dims, a, b, c);
  char msg[kMsgLen] = {0};
  check(gmm_launch_list(&x.l, device_args, workspace, workspace_bytes, msg, kMsgLen), msg);
}

bool take_offs_error(int32_t device) {
  char msg[kMsgLen] = {0};
  int32_t flag = 0;
  check(gmm_take_offs_error(device, &flag, msg, kMsgLen), msg);
  return flag != 0;
}

bool stream_capturing(uint64_t stream) {
  char msg[kMsgLen] = {0};
  int32_t capturing = 0;
  check(gmm_stream_capturing(stream, &capturing, msg, kMsgLen), msg);
  return capturing != 0;
}

rust::String cutlass_version() { return rust::String(gmm_cutlass_version()); }

}  // namespace groupmm
