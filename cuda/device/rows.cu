// The row kernels of the MoE glue (what each op computes: rows.h). Memory-bound: each
// thread moves 16-byte vectors when every row starts 16-byte aligned (else one element),
// grid-stride loops over at most a few blocks per SM, arithmetic in fp32 (fp64 for
// float64), one rounding per output element.
#include "device/rows.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

namespace gmm {
namespace {

template <class T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

__device__ inline float to_acc(__half v) { return __half2float(v); }
__device__ inline float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline float to_acc(float v) { return v; }
__device__ inline double to_acc(double v) { return v; }

template <class T>
__device__ inline T from_acc(Acc<T> v) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(v);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    return T(v);
  }
}

template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <class T, int V>
__device__ inline Pack<T, V> load(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}

template <class T, int V>
__device__ inline void store(T* p, const Pack<T, V>& v) {
  *reinterpret_cast<Pack<T, V>*>(p) = v;
}

__device__ inline int64_t first() { return int64_t(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ inline int64_t step() { return int64_t(gridDim.x) * blockDim.x; }

template <class A>
__device__ inline A sigmoid(A g) {
  if constexpr (std::is_same_v<A, double>) {
    return 1.0 / (1.0 + exp(-g));
  } else {
    return 1.0f / (1.0f + expf(-g));
  }
}

template <class T, int V>
__global__ void swiglu(const T* x, T* out, int64_t rows, int64_t cols) {
  using A = Acc<T>;
  const int64_t cv = cols / V, n = rows * cv;
  for (int64_t i = first(); i < n; i += step()) {
    const int64_t r = i / cv, c = (i - r * cv) * V;
    const T* row = x + r * 2 * cols;
    const Pack<T, V> g = load<T, V>(row + c), u = load<T, V>(row + cols + c);
    Pack<T, V> o;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const A gv = to_acc(g.v[e]);
      o.v[e] = from_acc<T>(gv * sigmoid(gv) * to_acc(u.v[e]));
    }
    store<T, V>(out + r * cols + c, o);
  }
}

template <class T, int V>
__global__ void swiglu_backward(const T* grad, const T* pre, T* out, int64_t rows, int64_t cols) {
  using A = Acc<T>;
  const int64_t cv = cols / V, n = rows * cv;
  for (int64_t i = first(); i < n; i += step()) {
    const int64_t r = i / cv, c = (i - r * cv) * V;
    const T* row = pre + r * 2 * cols;
    const Pack<T, V> dh = load<T, V>(grad + r * cols + c);
    const Pack<T, V> g = load<T, V>(row + c), u = load<T, V>(row + cols + c);
    Pack<T, V> dg, du;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const A d = to_acc(dh.v[e]), gv = to_acc(g.v[e]), uv = to_acc(u.v[e]);
      const A s = sigmoid(gv);
      dg.v[e] = from_acc<T>(d * uv * s * (A(1) + gv * (A(1) - s)));
      du.v[e] = from_acc<T>(d * gv * s);
    }
    T* o = out + r * 2 * cols;
    store<T, V>(o + c, dg);
    store<T, V>(o + cols + c, du);
  }
}

// An index outside [0, rows) contributes nothing and raises the deferred error flag
// (kErrIndex, reported by the device's next grouped GEMM call): never read out of bounds,
// never silently a zero row.
__device__ inline bool in_range(int64_t r, int64_t rows, int* err) {
  if (r >= 0 && r < rows) return true;
  if (err != nullptr) *reinterpret_cast<volatile int*>(err) = kErrIndex;
  return false;
}

template <class T, class W>
__device__ inline Acc<T> weight(const W* w, int64_t i) {
  return w == nullptr ? Acc<T>(1) : Acc<T>(to_acc(w[i]));
}

template <class T, class W, int V>
__global__ void gather_sum(const T* x, const int32_t* inverse, const W* w, T* out, int64_t tokens,
                           int64_t top_k, int64_t rows, int64_t cols, int* err) {
  using A = Acc<T>;
  const int64_t cv = cols / V, n = tokens * cv;
  for (int64_t i = first(); i < n; i += step()) {
    const int64_t t = i / cv, c = (i - t * cv) * V;
    A acc[V];
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = A(0);
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t r = inverse[t * top_k + j];
      if (!in_range(r, rows, err)) continue;
      const A wj = weight<T>(w, t * top_k + j);
      const Pack<T, V> p = load<T, V>(x + r * cols + c);
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] += wj * to_acc(p.v[e]);
    }
    Pack<T, V> o;
#pragma unroll
    for (int e = 0; e < V; ++e) o.v[e] = from_acc<T>(acc[e]);
    store<T, V>(out + t * cols + c, o);
  }
}

// assign[inverse[tj]] = tj + 1 (0 stays for rows no index names).
__global__ void invert(const int32_t* inverse, int32_t* assign, int64_t n, int64_t rows, int* err) {
  for (int64_t i = first(); i < n; i += step()) {
    const int64_t r = inverse[i];
    if (in_range(r, rows, err)) assign[r] = int32_t(i + 1);
  }
}

// Row by row, so that writes stream in row order and every row is written once:
// out[r] = w[a] * x[a / k] for the assignment a of row r, zeros for rows without one.
template <class T, class W, int V>
__global__ void scatter_rows(const T* x, const int32_t* assign, const W* w, T* out, int64_t top_k,
                             int64_t rows, int64_t cols) {
  using A = Acc<T>;
  const int64_t cv = cols / V, n = rows * cv;
  for (int64_t i = first(); i < n; i += step()) {
    const int64_t r = i / cv, c = (i - r * cv) * V;
    const int64_t a = int64_t(assign[r]) - 1;
    Pack<T, V> o;
    if (a < 0) {
#pragma unroll
      for (int e = 0; e < V; ++e) o.v[e] = from_acc<T>(A(0));
    } else {
      const A wa = weight<T>(w, a);
      const Pack<T, V> p = load<T, V>(x + (a / top_k) * cols + c);
#pragma unroll
      for (int e = 0; e < V; ++e) o.v[e] = from_acc<T>(wa * to_acc(p.v[e]));
    }
    store<T, V>(out + r * cols + c, o);
  }
}

// One warp per (token, j): lanes stride over the columns, then a fixed xor tree.
template <class T, class W, int V>
__global__ void row_dots(const T* x, const T* y, const int32_t* inverse, W* out, int64_t tokens,
                         int64_t top_k, int64_t rows, int64_t cols, int* err) {
  using A = Acc<T>;
  const int lane = threadIdx.x % 32;
  const int64_t n = tokens * top_k;
  for (int64_t wi = first() / 32; wi < n; wi += step() / 32) {
    const int64_t r = inverse[wi];
    A s = A(0);
    if (in_range(r, rows, err)) {
      const T* xr = x + (wi / top_k) * cols;
      const T* yr = y + r * cols;
      for (int64_t c = int64_t(lane) * V; c < cols; c += 32 * V) {
        const Pack<T, V> p = load<T, V>(xr + c), q = load<T, V>(yr + c);
#pragma unroll
        for (int e = 0; e < V; ++e) s += to_acc(p.v[e]) * to_acc(q.v[e]);
      }
    }
#pragma unroll
    for (int d = 16; d > 0; d /= 2) s += __shfl_xor_sync(0xffffffffu, s, d);
    if (lane == 0) out[wi] = from_acc<W>(Acc<W>(s));
  }
}

constexpr int kThreads = 256;

unsigned blocks_for(int64_t threads, int sm_count) {
  const int64_t want = (threads + kThreads - 1) / kThreads;
  const int64_t cap = int64_t(std::max(sm_count, 1)) * 8;
  return unsigned(std::max<int64_t>(1, std::min(want, cap)));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

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
    case RowsOp::GatherSum:
      gather_sum<T, W, V><<<blocks_for(a.tokens * cv, a.sm_count), kThreads, 0, a.stream>>>(
          x, a.inverse, w, static_cast<T*>(a.out), a.tokens, a.top_k, a.rows, a.cols, a.err_flag);
      break;
    case RowsOp::ScatterRows:
      invert<<<blocks_for(a.tokens * a.top_k, a.sm_count), kThreads, 0, a.stream>>>(
          a.inverse, a.scratch, a.tokens * a.top_k, a.rows, a.err_flag);
      scatter_rows<T, W, V><<<blocks_for(a.rows * cv, a.sm_count), kThreads, 0, a.stream>>>(
          x, a.scratch, w, static_cast<T*>(a.out), a.top_k, a.rows, a.cols);
      break;
    case RowsOp::RowDots:
      row_dots<T, W, V><<<blocks_for(a.tokens * a.top_k * 32, a.sm_count), kThreads, 0, a.stream>>>(
          x, y, a.inverse, static_cast<W*>(a.out), a.tokens, a.top_k, a.rows, a.cols, a.err_flag);
      break;
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
  }
  switch (a.dtype) {
    case DType::F16: launch_elem<__half>(a); break;
    case DType::BF16: launch_elem<__nv_bfloat16>(a); break;
    case DType::F32: launch_elem<float>(a); break;
    case DType::F64: launch_elem<double>(a); break;
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return std::string("groupmm row kernel launch: ") + cudaGetErrorString(e);
  }
  return "";
}

}  // namespace gmm
