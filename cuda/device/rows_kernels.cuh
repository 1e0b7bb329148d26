// The row kernels of the MoE glue (what each op computes: rows.h; their launchers: rows.cu,
// the only file that includes the row kernel headers), by family: this header holds what
// they all use (the accumulator type, 16-byte packs, grid-stride indices) and the elementwise
// kernels (SwiGLU and its gradient, grid-stride); rows_routed.cuh the kernels that read rows
// through the routing index (GatherSum, ScatterRows, RowDots); rows_topk.cuh TopK.
// Memory-bound: each thread moves 16-byte vectors when every row starts 16-byte aligned (else
// one element), arithmetic in fp32 (fp64 for float64), one rounding per output element.
// Device code (nvcc only).
#pragma once
#include "device/rows.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace gmm::rows_kernels {

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

}  // namespace gmm::rows_kernels
