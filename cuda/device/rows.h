// The row kernels of the MoE glue (kernels in rows.cu): the memory-bound steps around the
// grouped GEMMs of a routed expert block, each one pass over its rows, fp32 (fp64 for
// float64) arithmetic, deterministic (fixed summation order, no atomics). What each op
// computes (rows row-major and contiguous; `inverse` int32 [tokens, k]: the row of token
// t's j-th choice; `weights` [tokens, k], optional, of the rows' dtype or float32):
//
//   Swiglu          out[r, c]  = silu(x[r, c]) * x[r, F + c]          x [R, 2F], out [R, F]
//   SwigluBackward  out[r, c]  = x[r, c] * u * s * (1 + g * (1 - s)),  out[r, F + c] =
//                   x[r, c] * g * s  with g = y[r, c], u = y[r, F + c], s = sigmoid(g)
//                                                    x [R, F] (grad), y [R, 2F], out [R, 2F]
//   GatherSum       out[t, :]  = sum_j w[t, j] * x[inverse[t, j], :]   x [R, D], out [T, D]
//   ScatterRows     out[inverse[t, j], :] = w[t, j] * x[t, :]         x [T, D], out [R, D]
//                   written row by row (every row once; rows no index names are zeros)
//                   through the inverse permutation, which a first kernel writes into
//                   `scratch` (int32 [R], zeroed by the caller) as assignment + 1
//   RowDots         out[t, j]  = <x[t, :], y[inverse[t, j], :]>       x [T, D], y [R, D],
//                                                                     out [T, k] (w's dtype)
//   TopK            out[t, j]  = the column of the j-th best of the k largest values of x[t]
//                   (int64; a greater value first, NaN greater than every number, equal
//                   values lower column first: src/shape/rows.rs, topk_before)
//                                  x [T, E] (E = cols <= kTopKMaxCols), out [T, k] (k = top_k)
//
// An index outside [0, R) contributes nothing (GatherSum, RowDots: zero) and writes
// nothing (ScatterRows): never an access out of bounds; it sets the deferred error flag
// (err_flag = kErrIndex), which the device's next call reports. Plain C++ (host code includes it).
#pragma once
#include "device/types.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace gmm {

// The row ops. The Rust bridge (src/exec/ffi.rs) declares this enum as an extern C++ enum:
// this is the definition, and cxx checks at compile time that the Rust variants match. It
// lives here, not in device/types.h, because every kernel includes types.h: only the row
// kernels and the bridge include this header.
enum class RowsOp : uint8_t {
  Swiglu = 0,
  SwigluBackward = 1,
  GatherSum = 2,
  ScatterRows = 3,
  RowDots = 4,
  TopK = 5
};

// TopK's widest rows: one warp holds a row, at most 32 values a lane. The Rust rule
// (src/shape/rows.rs, TOPK_CUDA_MAX_COLS) refuses wider rows before the launch.
constexpr int64_t kTopKMaxCols = 32 * 32;

struct RowsArgs {
  RowsOp op = RowsOp::Swiglu;
  DType dtype = DType::BF16;   // of x, y and (but RowDots; TopK's is int64) out
  DType w_dtype = DType::F32;  // of weights (and RowDots' out): dtype or F32
  int64_t tokens = 0, top_k = 0, rows = 0, cols = 0;
  const void* x = nullptr;
  const void* y = nullptr;
  const int32_t* inverse = nullptr;
  const void* weights = nullptr;  // may be null: weight 1
  void* out = nullptr;
  int32_t* scratch = nullptr;  // ScatterRows: int32 [rows], zeroed
  int* err_flag = nullptr;     // the deferred error flag: set to kErrIndex by an index out of range
  int sm_count = 1;
  cudaStream_t stream = nullptr;
};

// Enqueues the op on a.stream (the caller made a's device current): "" on success, else a
// message naming the failed call.
std::string launch_rows(const RowsArgs& a);

}  // namespace gmm
