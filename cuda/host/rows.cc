// The row kernels of the MoE glue (device/rows.h) behind the bridge: the request as Rust
// validated it, made current on its device and launched on its stream. Host only.
#include "host/api.h"

#include "device/rows.h"
#include "groupmm/src/exec/ffi.rs.h"
#include "host/device.h"

#include <stdexcept>
#include <string>

namespace gmm {

void launch_rows(const RowsRequest& r) {
  const DevInfo d = enter(r.device);
  RowsArgs a;
  a.op = r.op;
  a.dtype = r.dtype;
  a.w_dtype = r.w_dtype;
  a.tokens = r.tokens;
  a.top_k = r.top_k;
  a.rows = r.rows;
  a.cols = r.cols;
  a.x = reinterpret_cast<const void*>(r.x);
  a.y = reinterpret_cast<const void*>(r.y);
  a.inverse = reinterpret_cast<const int32_t*>(r.inverse);
  a.weights = reinterpret_cast<const void*>(r.weights);
  a.out = reinterpret_cast<void*>(r.out);
  a.scratch = reinterpret_cast<int32_t*>(r.scratch);
  a.sm_count = d.sm_count;
  a.err_flag = error_flag(r.device);
  a.stream = reinterpret_cast<cudaStream_t>(r.stream);
  const std::string err = launch_rows(a);
  if (!err.empty()) throw std::runtime_error(err + " (device " + std::to_string(r.device) + ")");
}

}  // namespace gmm
