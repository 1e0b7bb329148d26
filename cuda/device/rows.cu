// The launchers of the row kernels of the MoE glue (what each op computes: rows.h; the
// kernels, by family: rows_kernels.cuh, rows_routed.cuh, rows_topk.cuh). The gathering
// kernels run over a grid of the blocks resident at once; the elementwise ones (SwiGLU and
// its gradient) and RowDots over at most eight blocks per SM; TopK over one warp per row
// (kThreads / 32 rows a block).
#include "device/rows.h"
#include "device/rows_kernels.cuh"
#include "device/rows_routed.cuh"
#include "device/rows_topk.cuh"

#include <algorithm>
#include <atomic>

namespace gmm {
namespace {

using namespace rows_kernels;

constexpr int kThreads = 256;

unsigned blocks_for(int64_t threads, int sm_count) {
  const int64_t want = (threads + kThreads - 1) / kThreads;
  const int64_t cap = int64_t(std::max(sm_count, 1)) * 8;
  return unsigned(std::max<int64_t>(1, std::min(want, cap)));
}

// The blocks of `kernel` resident on one SM at kThreads threads (its occupancy), read once
// into `per_sm`, a static of the kernel's own launcher.
template <class K>
int resident_per_sm(K* kernel, std::atomic<int>& per_sm) {
  int resident = per_sm.load(std::memory_order_relaxed);
  if (resident == 0) {
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, kThreads, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      b = 1;
    }
    resident = std::max(b, 1);
    per_sm.store(resident, std::memory_order_relaxed);
  }
  return resident;
}

// A grid sized to the GPU for the gathering kernels: enough blocks for `items` work items
// at `per_thread` items a thread, at most as many as are resident at once, so that a
// grid-stride loop runs in one wave.
inline unsigned resident_grid(int resident, int64_t items, int per_thread, int sm_count) {
  const int64_t chunk = int64_t(kThreads) * per_thread;
  const int64_t want = (items + chunk - 1) / chunk;
  const int64_t cap = int64_t(std::max(sm_count, 1)) * resident;
  return unsigned(std::max<int64_t>(1, std::min(want, cap)));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// GatherSum with U items of KC rows a thread (launch_gather_k picks U and KC).
template <class T, class W, int V, int U, int KC, int kOne>
void launch_gather(const RowsArgs& a) {
  auto* kernel = gather_sum<T, W, V, U, KC, kOne>;
  static std::atomic<int> per_sm{0};
  const int resident = resident_per_sm(kernel, per_sm);
  const int64_t items = a.tokens * (a.cols / V);
  kernel<<<resident_grid(resident, items, U, a.sm_count), kThreads, 0, a.stream>>>(
      static_cast<const T*>(a.x), a.inverse, static_cast<const W*>(a.weights),
      static_cast<T*>(a.out), a.tokens, a.top_k, a.rows, a.cols, a.err_flag);
}

// The (U, KC) of a GatherSum call: kLoads loads a thread; k = 1 by U items, k = 2 .. 4 by
// U = kLoads / KC items of KC rows; wider k one item at a time in chunks of kLoads rows.
// (Small problems in one chunk of 8 or 16 rows, one index and one row round trip for the
// whole sum, measured no faster on T = 256 and 4096: cuda/NOTES.md.)
template <class T, class W, int V>
void launch_gather_k(const RowsArgs& a) {
  static_assert(kLoads == 4 || kLoads == 8, "kLoads: 4 or 8");
  if (a.top_k == 1 && a.weights == nullptr) {
    launch_gather<T, W, V, kLoads, 1, kCopy>(a);
  } else if (a.top_k == 1) {
    launch_gather<T, W, V, kLoads, 1, kScaled>(a);
  } else if (a.top_k == 2) {
    launch_gather<T, W, V, kLoads / 2, 2, kSum>(a);
  } else if (a.top_k <= 4) {
    launch_gather<T, W, V, kLoads / 4, 4, kSum>(a);
  } else {
    launch_gather<T, W, V, 1, kLoads, kSum>(a);
  }
}

template <class T, class W, int V>
void launch_typed(const RowsArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* y = static_cast<const T*>(a.y);
  const W* w = static_cast<const W*>(a.weights);
  const int64_t cv = a.cols / V;
  switch (a.op) {
    case RowsOp::Swiglu:
      swiglu<T, V><<<blocks_for(a.rows * cv, a.sm_count), kThreads, 0, a.stream>>>(
          x, static_cast<T*>(a.out), a.rows, a.cols);
      break;
    case RowsOp::SwigluBackward:
      swiglu_backward<T, V><<<blocks_for(a.rows * cv, a.sm_count), kThreads, 0, a.stream>>>(
          x, y, static_cast<T*>(a.out), a.rows, a.cols);
      break;
    case RowsOp::GatherSum: launch_gather_k<T, W, V>(a); break;
    case RowsOp::ScatterRows: {
      invert<<<blocks_for(a.tokens * a.top_k, a.sm_count), kThreads, 0, a.stream>>>(
          a.inverse, a.scratch, a.tokens * a.top_k, a.rows, a.err_flag);
      auto* kernel = scatter_rows<T, W, V, kScatterU>;
      static std::atomic<int> per_sm{0};
      const int resident = resident_per_sm(kernel, per_sm);
      kernel<<<resident_grid(resident, a.rows * cv, kScatterU, a.sm_count), kThreads, 0,
               a.stream>>>(x, a.scratch, w, static_cast<T*>(a.out), a.top_k, a.rows, a.cols);
      break;
    }
    case RowsOp::RowDots:
      row_dots<T, W, V><<<blocks_for(a.tokens * a.top_k * 32, a.sm_count), kThreads, 0, a.stream>>>(
          x, y, a.inverse, static_cast<W*>(a.out), a.tokens, a.top_k, a.rows, a.cols, a.err_flag);
      break;
    case RowsOp::TopK: break;  // launch_topk: no vectors, no weights
  }
}

// TopK with N values a lane: one warp per row, a grid of one block per kThreads / 32 rows
// (a grid-stride loop past 2^30 blocks).
template <class T, int N>
void launch_topk_n(const RowsArgs& a) {
  constexpr int64_t kRowsPerBlock = kThreads / 32;
  const int64_t want = (a.tokens + kRowsPerBlock - 1) / kRowsPerBlock;
  const unsigned grid = unsigned(std::min<int64_t>(want, int64_t(1) << 30));
  topk_ids<T, N><<<grid, kThreads, 0, a.stream>>>(static_cast<const T*>(a.x),
                                                  static_cast<int64_t*>(a.out), a.tokens,
                                                  int(a.cols), int(a.top_k));
}

// The fewest values a lane that hold the row: 32 N >= cols (cols <= kTopKMaxCols).
template <class T>
void launch_topk(const RowsArgs& a) {
  if (a.cols <= 32) {
    launch_topk_n<T, 1>(a);
  } else if (a.cols <= 64) {
    launch_topk_n<T, 2>(a);
  } else if (a.cols <= 128) {
    launch_topk_n<T, 4>(a);
  } else if (a.cols <= 256) {
    launch_topk_n<T, 8>(a);
  } else if (a.cols <= 512) {
    launch_topk_n<T, 16>(a);
  } else {
    launch_topk_n<T, 32>(a);
  }
}

template <class T, class W>
void launch_vec(const RowsArgs& a) {
  constexpr int V = 16 / int(sizeof(T));
  const bool vec =
      a.cols % V == 0 && aligned16(a.x) && aligned16(a.out) && (a.y == nullptr || aligned16(a.y));
  if (vec) {
    launch_typed<T, W, V>(a);
  } else {
    launch_typed<T, W, 1>(a);
  }
}

template <class T>
void launch_elem(const RowsArgs& a) {
  if (a.w_dtype == DType::F32 && !std::is_same_v<T, float>) {
    launch_vec<T, float>(a);
  } else {
    launch_vec<T, T>(a);
  }
}

}  // namespace

std::string launch_rows(const RowsArgs& a) {
  // Nothing to write (RowDots writes its zeros even when cols == 0; ScatterRows writes
  // all R rows, zeros when no token names them).
  switch (a.op) {
    case RowsOp::Swiglu:
    case RowsOp::SwigluBackward:
    case RowsOp::ScatterRows:
      if (a.rows == 0 || a.cols == 0) return "";
      break;
    case RowsOp::GatherSum:
      if (a.tokens == 0 || a.cols == 0) return "";
      break;
    case RowsOp::RowDots:
      if (a.tokens == 0 || a.top_k == 0) return "";
      break;
    case RowsOp::TopK:
      // The Rust rules hold these (src/shape/rows.rs: plan_topk, check_topk_cuda).
      if (a.cols < 1 || a.cols > kTopKMaxCols || a.top_k < 1 || a.top_k > a.cols) {
        return "groupmm top-k launch: internal: expected 1 <= k <= E <= " +
               std::to_string(kTopKMaxCols) + ", found k = " + std::to_string(a.top_k) +
               ", E = " + std::to_string(a.cols);
      }
      if (a.tokens == 0) return "";
      break;
  }
  if (a.op == RowsOp::TopK) {
    switch (a.dtype) {
      case DType::F16: launch_topk<__half>(a); break;
      case DType::BF16: launch_topk<__nv_bfloat16>(a); break;
      case DType::F32: launch_topk<float>(a); break;
      case DType::F64: launch_topk<double>(a); break;
    }
  } else {
    switch (a.dtype) {
      case DType::F16: launch_elem<__half>(a); break;
      case DType::BF16: launch_elem<__nv_bfloat16>(a); break;
      case DType::F32: launch_elem<float>(a); break;
      case DType::F64: launch_elem<double>(a); break;
    }
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return std::string("groupmm row kernel launch: ") + cudaGetErrorString(e);
  }
  return "";
}

}  // namespace gmm
