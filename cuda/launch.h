// groupmm CUDA launch API: plain C ABI between the host glue (cuda/bridge.cc, the
// test harness) and the nvcc-compiled kernels (cuda/*.cu). No cxx or CUTLASS types here.
//
// Every function returns 0 on success, or a non-zero code with a NUL-terminated
// message written to `msg` (at most `msg_len` bytes) that says which call failed.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Element types (same order as groupmm::DType in Rust).
enum gmm_dtype { GMM_F16 = 0, GMM_BF16 = 1, GMM_F32 = 2, GMM_F64 = 3 };
// Packed forms (same codes as groupmm::Form::code()).
enum gmm_form { GMM_GROUPED_M = 0, GMM_GROUPED_K = 1, GMM_GROUPED_N = 2, GMM_BATCHED = 3 };

// A 2- or 3-D device operand; 2-D operands use batch = 1, batch_stride = 0. Strides in
// elements.
typedef struct gmm_operand {
  uint64_t ptr;
  int64_t batch, rows, cols;
  int64_t batch_stride, row_stride, col_stride;
} gmm_operand;

typedef struct gmm_packed {
  int32_t form, dtype, out_dtype;
  int32_t device;
  int64_t groups, m, n, k;  // the plan's: GroupedM m = T, GroupedK k = T, GroupedN n = N_total
  gmm_operand a, b, c;
  uint64_t offs;    // device int32[groups] (cumulative group ends); 0 for Batched
  uint64_t stream;  // cudaStream_t
  int32_t allow_tf32;
} gmm_packed;

typedef struct gmm_list {
  int32_t dtype, out_dtype;
  int32_t device;
  int32_t allow_tf32;
  int64_t groups;
  const int64_t* dims;     // 3 * groups: (m, n, k) of each group
  const gmm_operand* a;    // groups entries
  const gmm_operand* b;
  const gmm_operand* c;
  uint64_t stream;
} gmm_list;

// Packed forms: workspace size (host only, never syncs) and the launch (async on the
// stream, no host sync, CUDA-graph capturable).
int gmm_packed_workspace_bytes(const gmm_packed* p, size_t* bytes, char* msg, size_t msg_len);
int gmm_launch_packed(const gmm_packed* p, uint64_t workspace, size_t workspace_bytes, char* msg,
                      size_t msg_len);

// List form: the caller asks for the size of the per-group argument block, lets
// gmm_write_list_args fill it in host memory (device_addr = where the block will live on
// the GPU), copies it there on the same stream, then calls gmm_launch_list.
int gmm_list_args_bytes(const gmm_list* l, size_t* bytes, char* msg, size_t msg_len);
int gmm_write_list_args(const gmm_list* l, void* host, size_t host_bytes, uint64_t device_addr,
                        char* msg, size_t msg_len);
int gmm_list_workspace_bytes(const gmm_list* l, size_t* bytes, char* msg, size_t msg_len);
int gmm_launch_list(const gmm_list* l, uint64_t device_args, uint64_t workspace,
                    size_t workspace_bytes, char* msg, size_t msg_len);

// Reads and clears the per-device "invalid offs seen" flag (host-mapped memory, no
// sync). *flag = 1 when a packed launch on `device` saw negative, decreasing or
// out-of-range offs since the last call.
int gmm_take_offs_error(int32_t device, int32_t* flag, char* msg, size_t msg_len);

// *capturing = 1 when `stream` is capturing a CUDA graph (cudaStreamIsCapturing: host
// only, no sync). The bindings reuse a per-stream workspace only outside captures.
int gmm_stream_capturing(uint64_t stream, int32_t* capturing, char* msg, size_t msg_len);

// Build facts: the CUTLASS version the kernels were compiled against, and whether the
// sm_90a kernels are in this build.
const char* gmm_cutlass_version(void);
int gmm_has_sm90(void);

#ifdef __cplusplus
}
#endif
