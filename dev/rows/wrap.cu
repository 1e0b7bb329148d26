// One variant of the row kernels behind a C entry for rows_dev.cu: compiled once per
// variant with -Dgmm=<namespace> -DROWS_ENTRY=<name> (and the variant's own -D flags), beside
// that variant's rows.cu compiled with the same flags. Not part of the library.
#include "device/rows.h"

extern "C" int ROWS_ENTRY(int op, int dtype, int w_dtype, int64_t tokens, int64_t top_k,
                          int64_t rows, int64_t cols, const void* x, const void* y,
                          const int32_t* inverse, const void* w, void* out, int32_t* scratch,
                          int* err, int sms, cudaStream_t stream) {
  gmm::RowsArgs a;
  a.op = static_cast<gmm::RowsOp>(op);
  a.dtype = static_cast<gmm::DType>(dtype);
  a.w_dtype = static_cast<gmm::DType>(w_dtype);
  a.tokens = tokens;
  a.top_k = top_k;
  a.rows = rows;
  a.cols = cols;
  a.x = x;
  a.y = y;
  a.inverse = inverse;
  a.weights = w;
  a.out = out;
  a.scratch = scratch;
  a.err_flag = err;
  a.sm_count = sms;
  a.stream = stream;
  return gmm::launch_rows(a).empty() ? 0 : 1;
}
