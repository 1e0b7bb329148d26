// Stand-alone GPU test of the groupmm CUDA launchers (cuda/launch.h), without Rust or
// Python. Built by scripts/cuda-harness.sh into devbin/.
//
//   harness            full case list
//   harness --small    short list (for compute-sanitizer --tool memcheck)
//   harness --filter S only cases whose name contains S
//   harness --bench    throughput on MoE shapes (forward, dX, dW)
//   harness --device N run on device N (launchers called with device 0 current)
//
// For every case: random inputs (values rounded to the input dtype), outputs poisoned
// with NaN, the launch under test, then a float64 reference GEMM on the device and an
// element-wise comparison: |out - ref| <= tol * sum|a||b| (+ tiny), and exact zeros where
// the contract says zero (tails past offs[G-1], k = 0 groups). Prints one line per case
// and "N passed, M failed" last.
#include "launch.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, \
                   __LINE__, #x);                                                          \
      std::exit(2);                                                                        \
    }                                                                                      \
  } while (0)

namespace {

// --device N: data and streams live on device N; the launchers are called with the
// runtime's current device set to another one, to prove they select the device
// themselves (the static CUDA runtime keeps its own current device).
int g_dev = 0;
struct OtherDevice {
  OtherDevice() {
    if (g_dev != 0) CK(cudaSetDevice(0));
  }
  ~OtherDevice() { CK(cudaSetDevice(g_dev)); }
};

int esize(int d) { return d == GMM_F64 ? 8 : d == GMM_F32 ? 4 : 2; }
const char* dname(int d) {
  return d == GMM_F16 ? "f16" : d == GMM_BF16 ? "bf16" : d == GMM_F32 ? "f32" : "f64";
}
const char* fname(int f) {
  return f == GMM_GROUPED_M ? "M" : f == GMM_GROUPED_K ? "K" : f == GMM_GROUPED_N ? "N" : "B";
}

__device__ __host__ inline double load(const void* p, int64_t i, int dt) {
  switch (dt) {
    case GMM_F16: return double(__half2float(static_cast<const __half*>(p)[i]));
    case GMM_BF16: return double(__bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]));
    case GMM_F32: return double(static_cast<const float*>(p)[i]);
    default: return static_cast<const double*>(p)[i];
  }
}

// A strided 3-D view: element (b, r, c) at ptr + b*bs + r*rs + c*cs.
struct View {
  const void* p;
  int64_t bs, rs, cs;
};

// Reference of one "problem list" described per output element by the host:
// out[o] = sum over t in [k0, k1) of A(ga, i, t) * B(gb, t, j), written into ref[o] and
// sum|a||b| into mag[o]. Each output element (bc, i, j) of the contiguous output gets its
// own descriptor through small per-row / per-col / per-batch maps.
struct RefDesc {
  int form;
  int dt;
  int64_t G, m, n, k;  // plan
  View a, b;
  const int* rowgrp;   // GroupedM: group of each row (-1 tail)
  const int* colgrp;   // GroupedN: group of each column (-1 tail)
  const int64_t* span; // GroupedK: [start, end) per group
  int64_t out_batch;   // batches of the output
};

__global__ void ref_kernel(RefDesc d, double* ref, double* mag) {
  const int64_t total = d.out_batch * d.m * d.n;
  for (int64_t o = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; o < total;
       o += int64_t(gridDim.x) * blockDim.x) {
    const int64_t bc = o / (d.m * d.n), rem = o % (d.m * d.n), i = rem / d.n, j = rem % d.n;
    int64_t ga = 0, gb = 0, k0 = 0, k1 = d.k;
    bool zero = false;
    switch (d.form) {
      case GMM_GROUPED_M: {
        int g = d.rowgrp[i];
        if (g < 0) zero = true;
        gb = g;
        break;
      }
      case GMM_GROUPED_N: {
        int g = d.colgrp[j];
        if (g < 0) zero = true;
        ga = g;
        break;
      }
      case GMM_GROUPED_K:
        k0 = d.span[2 * bc];
        k1 = d.span[2 * bc + 1];
        break;
      default:
        ga = gb = bc;
    }
    double s = 0, mg = 0;
    if (!zero) {
      for (int64_t t = k0; t < k1; ++t) {
        double x = load(d.a.p, ga * d.a.bs + i * d.a.rs + t * d.a.cs, d.dt);
        double y = load(d.b.p, gb * d.b.bs + t * d.b.rs + j * d.b.cs, d.dt);
        s += x * y;
        mg += fabs(x * y);
      }
    }
    ref[o] = s;
    mag[o] = mg;
  }
}

struct Counts {
  unsigned long long bad, nan, nonzero;
  double maxerr;
  unsigned long long first;  // 1 + index of the first wrong element seen (0: none)
  double first_out, first_ref, first_mag;
};

__device__ void atomic_max_double(double* a, double v) {
  unsigned long long* p = reinterpret_cast<unsigned long long*>(a);
  unsigned long long old = *p;
  while (__longlong_as_double(old) < v) {
    unsigned long long prev = atomicCAS(p, old, __double_as_longlong(v));
    if (prev == old) break;
    old = prev;
  }
}

// mustzero[o] = 1: out must be exactly 0. check_values = 0: only NaN is checked
// (overlapping spans of decreasing offs race by contract).
__global__ void compare_kernel(const void* out, int dt, const double* ref, const double* mag,
                               const unsigned char* mustzero, int64_t total, double tol,
                               int check_values, Counts* c) {
  for (int64_t o = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; o < total;
       o += int64_t(gridDim.x) * blockDim.x) {
    double v = load(out, o, dt);
    if (isnan(v)) {
      atomicAdd(&c->nan, 1ull);
      continue;
    }
    if (!check_values) continue;
    if (mustzero[o] && v != 0.0) {
      atomicAdd(&c->nonzero, 1ull);
      continue;
    }
    double err = fabs(v - ref[o]);
    double lim = tol * mag[o] + tol * 1e-3 + (dt == GMM_F64 ? 1e-300 : 1e-30);
    // output rounding of 16-bit outputs
    if (dt == GMM_BF16) lim += fabs(ref[o]) * 0.0079;
    // float16 output cannot resolve below its subnormal step 2^-24
    if (dt == GMM_F16) lim += fabs(ref[o]) * 0.00098 + 5.97e-8;
    if (err > lim) {
      atomicAdd(&c->bad, 1ull);
      if (atomicCAS(&c->first, 0ull, (unsigned long long)(o + 1)) == 0ull) {
        c->first_out = v;
        c->first_ref = ref[o];
        c->first_mag = mag[o];
      }
    }
    atomic_max_double(&c->maxerr, mag[o] > 0 ? err / mag[o] : err);
  }
}

struct Rng {
  std::mt19937_64 g;
  explicit Rng(uint64_t s) : g(s) {}
  int64_t uni(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); }
  double real() { return std::uniform_real_distribution<double>(-1.0, 1.0)(g); }
};

// Device buffer of random values of dtype dt, `elems` elements plus slack.
void* random_buffer(int dt, int64_t elems, Rng& rng) {
  std::vector<unsigned char> host(size_t(elems) * esize(dt));
  for (int64_t i = 0; i < elems; ++i) {
    double v = rng.real();
    switch (dt) {
      case GMM_F16: reinterpret_cast<__half*>(host.data())[i] = __float2half(float(v)); break;
      case GMM_BF16:
        reinterpret_cast<__nv_bfloat16*>(host.data())[i] = __float2bfloat16(float(v));
        break;
      case GMM_F32: reinterpret_cast<float*>(host.data())[i] = float(v); break;
      default: reinterpret_cast<double*>(host.data())[i] = v;
    }
  }
  void* d = nullptr;
  CK(cudaMalloc(&d, std::max<size_t>(host.size(), 16) + 64));
  if (!host.empty()) CK(cudaMemcpy(d, host.data(), host.size(), cudaMemcpyHostToDevice));
  return d;
}

// An operand of extents [B, R, C] in a fresh buffer: row- or column-major with `pad`
// extra elements per leading dimension and `shift` elements of base offset.
struct Operand {
  void* buf = nullptr;
  gmm_operand op{};
  View view{};
};

Operand make_operand(int dt, int64_t B, int64_t R, int64_t C, bool colmajor, int64_t pad,
                     int64_t shift, bool three_d, Rng& rng) {
  Operand o;
  int64_t ld = (colmajor ? R : C) + pad;
  int64_t inner = colmajor ? C : R;  // number of leading-dim lines
  int64_t bs = ld * std::max<int64_t>(inner, 1) + (B > 1 ? pad : 0);
  int64_t elems = shift + bs * std::max<int64_t>(B, 1) + 8;
  o.buf = random_buffer(dt, elems, rng);
  uintptr_t base = uintptr_t(o.buf) + uintptr_t(shift * esize(dt));
  o.op.ptr = base;
  o.op.batch = three_d ? B : 1;
  o.op.rows = R;
  o.op.cols = C;
  o.op.batch_stride = three_d ? bs : 0;
  o.op.row_stride = colmajor ? 1 : ld;
  o.op.col_stride = colmajor ? ld : 1;
  o.view = View{reinterpret_cast<const void*>(base), o.op.batch_stride, o.op.row_stride,
                o.op.col_stride};
  return o;
}

struct Case {
  std::string name;
  int form, dt, out;
  bool tf32;
  bool acol, bcol;
  int64_t G, m, n, k;  // plan sizes
  std::vector<int> offs;
  int64_t pad = 0, shift = 0;
  bool bad_offs = false;  // expect the error flag
  bool racy = false;      // decreasing offs: spans may overlap; check only NaN / flag
  bool graph = false;     // capture in a CUDA graph and replay
};

// Relative to sum|a||b|: fp32 accumulation error grows like sqrt(k) * 2^-24 for random
// signs; TF32 rounds inputs to 10 mantissa bits. 16-bit inputs are exact in fp32
// products.
double tol_for(int dt, bool tf32, int64_t k) {
  const double rk = std::sqrt(double(std::max<int64_t>(k, 1)));
  if (dt == GMM_F64) return 1e-14 * rk + 1e-15;
  if (dt == GMM_F32 && tf32) return 3e-3;
  return 4e-6 * rk + 1e-6;
}
double tol_of(const Case& c) { return tol_for(c.dt, c.tf32, c.k); }

int64_t clampv(int64_t v, int64_t lo, int64_t hi) { return std::min(std::max(v, lo), hi); }

bool run_packed(const Case& c, Rng& rng, std::string& why) {
  const int64_t G = c.G, m = c.m, n = c.n, k = c.k;
  Operand A, B, C;
  int64_t ext = 0;
  int64_t outB = 1;
  switch (c.form) {
    case GMM_GROUPED_M:
      A = make_operand(c.dt, 1, m, k, c.acol, c.pad, c.shift, false, rng);
      B = make_operand(c.dt, G, k, n, c.bcol, c.pad, c.shift, true, rng);
      ext = m;
      break;
    case GMM_GROUPED_K:
      A = make_operand(c.dt, 1, m, k, c.acol, c.pad, c.shift, false, rng);
      B = make_operand(c.dt, 1, k, n, c.bcol, c.pad, c.shift, false, rng);
      ext = k;
      outB = G;
      break;
    case GMM_GROUPED_N:
      A = make_operand(c.dt, G, m, k, c.acol, c.pad, c.shift, true, rng);
      B = make_operand(c.dt, 1, k, n, c.bcol, c.pad, c.shift, false, rng);
      ext = n;
      break;
    default:
      A = make_operand(c.dt, G, m, k, c.acol, c.pad, c.shift, true, rng);
      B = make_operand(c.dt, G, k, n, c.bcol, c.pad, c.shift, true, rng);
      outB = G;
  }
  const int64_t total = outB * m * n;
  void* out = nullptr;
  CK(cudaMalloc(&out, std::max<int64_t>(total, 1) * esize(c.out) + 16));
  C.op.ptr = uint64_t(out);
  C.op.batch = outB;
  C.op.rows = m;
  C.op.cols = n;
  C.op.batch_stride = (outB > 1 || c.form == GMM_GROUPED_K || c.form == GMM_BATCHED) ? m * n : 0;
  C.op.row_stride = n;
  C.op.col_stride = 1;

  // spans (host, clamp rule of shape::clamp_group)
  std::vector<int64_t> span(2 * std::max<int64_t>(G, 1), 0);
  std::vector<int> rowgrp(std::max<int64_t>(m, 1), -1), colgrp(std::max<int64_t>(n, 1), -1);
  std::vector<unsigned char> mustzero(std::max<int64_t>(total, 1), 0);
  int* doffs = nullptr;
  if (c.form != GMM_BATCHED) {
    for (int64_t g = 0; g < G; ++g) {
      int64_t s = g == 0 ? 0 : clampv(c.offs[g - 1], 0, ext);
      int64_t e = std::max(clampv(c.offs[g], 0, ext), s);
      span[2 * g] = s;
      span[2 * g + 1] = e;
      for (int64_t t = s; t < e; ++t) {
        if (c.form == GMM_GROUPED_M) rowgrp[t] = int(g);
        if (c.form == GMM_GROUPED_N) colgrp[t] = int(g);
      }
    }
    CK(cudaMalloc(&doffs, std::max<size_t>(c.offs.size(), 1) * 4));
    if (!c.offs.empty()) CK(cudaMemcpy(doffs, c.offs.data(), c.offs.size() * 4, cudaMemcpyHostToDevice));
    // exact-zero regions
    for (int64_t o = 0; o < total; ++o) {
      int64_t bc = o / std::max<int64_t>(m * n, 1), rem = o % std::max<int64_t>(m * n, 1);
      int64_t i = rem / std::max<int64_t>(n, 1), j = rem % std::max<int64_t>(n, 1);
      bool z = false;
      if (c.form == GMM_GROUPED_M) z = rowgrp[i] < 0 || k == 0;
      if (c.form == GMM_GROUPED_N) z = colgrp[j] < 0 || k == 0;
      if (c.form == GMM_GROUPED_K) z = span[2 * bc] == span[2 * bc + 1];
      mustzero[o] = z;
    }
  } else if (k == 0) {
    std::fill(mustzero.begin(), mustzero.end(), 1);
  }

  gmm_packed p{};
  p.form = c.form;
  p.dtype = c.dt;
  p.out_dtype = c.out;
  p.device = g_dev;
  p.groups = G;
  p.m = m;
  p.n = n;
  p.k = k;
  p.a = A.op;
  p.b = B.op;
  p.c = C.op;
  p.offs = uint64_t(doffs);
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  p.stream = uint64_t(stream);
  p.allow_tf32 = c.tf32;
  char msg[2048];
  size_t ws = 0;
  bool ok = true;
  if (gmm_packed_workspace_bytes(&p, &ws, msg, sizeof msg) != 0) {
    why = std::string("workspace query failed: ") + msg;
    ok = false;
  }
  void* dws = nullptr;
  if (ok) CK(cudaMalloc(&dws, std::max<size_t>(ws, 256)));
  int32_t flag = 0;
  if (ok) {
    gmm_take_offs_error(g_dev, &flag, msg, sizeof msg);  // clear
    CK(cudaMemsetAsync(out, 0xFF, std::max<int64_t>(total, 1) * esize(c.out), stream));
    int rc = 0;
    if (c.graph) {
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      {
        OtherDevice other;
        rc = gmm_launch_packed(&p, uint64_t(dws), ws, msg, sizeof msg);
      }
      cudaError_t e = cudaStreamEndCapture(stream, &graph);
      if (rc == 0 && e != cudaSuccess) {
        why = std::string("capture failed: ") + cudaGetErrorString(e);
        ok = false;
      }
      if (ok && rc == 0) {
        CK(cudaGraphInstantiate(&exec, graph, 0));
        // replay twice (poison in between) to prove the graph redoes everything
        CK(cudaGraphLaunch(exec, stream));
        CK(cudaMemsetAsync(out, 0xFF, std::max<int64_t>(total, 1) * esize(c.out), stream));
        CK(cudaGraphLaunch(exec, stream));
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
      }
    } else {
      OtherDevice other;
      rc = gmm_launch_packed(&p, uint64_t(dws), ws, msg, sizeof msg);
    }
    if (rc != 0) {
      why = std::string("launch failed: ") + msg;
      ok = false;
    }
    cudaError_t e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess) {
      std::printf("FATAL %s: %s\n", c.name.c_str(), cudaGetErrorString(e));
      std::exit(3);
    }
    gmm_take_offs_error(g_dev, &flag, msg, sizeof msg);
    if (ok && bool(flag) != c.bad_offs) {
      why = std::string("offs error flag ") + (flag ? "set" : "not set");
      ok = false;
    }
  }
  if (ok && total > 0) {
    double *ref, *mag;
    unsigned char* dz;
    int *drg, *dcg;
    int64_t* dspan;
    Counts* dc;
    CK(cudaMalloc(&ref, total * 8));
    CK(cudaMalloc(&mag, total * 8));
    CK(cudaMalloc(&dz, total));
    CK(cudaMalloc(&drg, rowgrp.size() * 4));
    CK(cudaMalloc(&dcg, colgrp.size() * 4));
    CK(cudaMalloc(&dspan, span.size() * 8));
    CK(cudaMalloc(&dc, sizeof(Counts)));
    CK(cudaMemcpy(dz, mustzero.data(), total, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(drg, rowgrp.data(), rowgrp.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dcg, colgrp.data(), colgrp.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dspan, span.data(), span.size() * 8, cudaMemcpyHostToDevice));
    CK(cudaMemset(dc, 0, sizeof(Counts)));
    RefDesc d{c.form, c.dt, G, m, n, k, A.view, B.view, drg, dcg, dspan, outB};
    ref_kernel<<<1024, 256>>>(d, ref, mag);
    CK(cudaGetLastError());
    compare_kernel<<<1024, 256>>>(out, c.out, ref, mag, dz, total, tol_of(c), c.racy ? 0 : 1, dc);
    CK(cudaGetLastError());
    Counts h;
    CK(cudaMemcpy(&h, dc, sizeof h, cudaMemcpyDeviceToHost));
    if (h.nan || h.bad || h.nonzero) {
      char buf[512];
      std::snprintf(buf, sizeof buf, "%llu NaN (unwritten), %llu wrong, %llu non-zero in zero regions, max rel err %.3g; first wrong [%lld] = %.9g, ref %.9g, sum|ab| %.3g",
                    h.nan, h.bad, h.nonzero, h.maxerr, (long long)h.first - 1, h.first_out, h.first_ref, h.first_mag);
      why = buf;
      ok = false;
    } else {
      char buf[64];
      std::snprintf(buf, sizeof buf, "max rel err %.3g", h.maxerr);
      why = buf;
    }
    cudaFree(ref); cudaFree(mag); cudaFree(dz); cudaFree(drg); cudaFree(dcg); cudaFree(dspan); cudaFree(dc);
  }
  cudaFree(A.buf); cudaFree(B.buf); cudaFree(out); cudaFree(doffs); cudaFree(dws);
  CK(cudaStreamDestroy(stream));
  return ok;
}

// List form: group i has its own dims and layouts.
struct ListCase {
  std::string name;
  int dt, out;
  bool tf32;
  std::vector<int64_t> dims;  // m, n, k per group
  std::vector<int> acol, bcol;
  int64_t pad = 0, shift = 0;
};

bool run_list(const ListCase& c, Rng& rng, std::string& why) {
  const int64_t G = int64_t(c.dims.size() / 3);
  std::vector<Operand> A(G), B(G);
  std::vector<void*> outs(G);
  std::vector<gmm_operand> ao(G), bo(G), co(G);
  for (int64_t i = 0; i < G; ++i) {
    int64_t m = c.dims[3 * i], n = c.dims[3 * i + 1], k = c.dims[3 * i + 2];
    A[i] = make_operand(c.dt, 1, m, k, c.acol[i], c.pad, c.shift * (i % 2), false, rng);
    B[i] = make_operand(c.dt, 1, k, n, c.bcol[i], c.pad, c.shift * (i % 3 == 1), false, rng);
    CK(cudaMalloc(&outs[i], std::max<int64_t>(m * n, 1) * esize(c.out) + 16));
    ao[i] = A[i].op;
    bo[i] = B[i].op;
    co[i] = gmm_operand{uint64_t(outs[i]), 1, m, n, 0, n, 1};
  }
  gmm_list l{};
  l.dtype = c.dt;
  l.out_dtype = c.out;
  l.device = g_dev;
  l.allow_tf32 = c.tf32;
  l.groups = G;
  l.dims = c.dims.data();
  l.a = ao.data();
  l.b = bo.data();
  l.c = co.data();
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  l.stream = uint64_t(stream);
  char msg[2048];
  size_t nb = 0, ws = 0;
  bool ok = gmm_list_args_bytes(&l, &nb, msg, sizeof msg) == 0 &&
            gmm_list_workspace_bytes(&l, &ws, msg, sizeof msg) == 0;
  if (!ok) why = std::string("size query failed: ") + msg;
  void *dargs = nullptr, *dws = nullptr, *host = nullptr;
  if (ok) {
    CK(cudaMalloc(&dargs, std::max<size_t>(nb, 256)));
    CK(cudaMalloc(&dws, std::max<size_t>(ws, 256)));
    CK(cudaMallocHost(&host, std::max<size_t>(nb, 256) + 16));
  }
  // lists with shifted operands also hand over a host block that is not 16-byte aligned
  void* hblock = (c.shift && host) ? static_cast<void*>(static_cast<char*>(host) + 8) : host;
  if (ok) {
    if (gmm_write_list_args(&l, hblock, nb, uint64_t(dargs), msg, sizeof msg) != 0) {
      why = std::string("write_list_args failed: ") + msg;
      ok = false;
    }
  }
  if (ok) {
    for (int64_t i = 0; i < G; ++i)
      CK(cudaMemsetAsync(outs[i], 0xFF, std::max<int64_t>(c.dims[3 * i] * c.dims[3 * i + 1], 1) * esize(c.out), stream));
    CK(cudaMemcpyAsync(dargs, hblock, nb, cudaMemcpyHostToDevice, stream));
    int rc;
    {
      OtherDevice other;
      rc = gmm_launch_list(&l, uint64_t(dargs), uint64_t(dws), ws, msg, sizeof msg);
    }
    if (rc != 0) {
      why = std::string("launch failed: ") + msg;
      ok = false;
    }
    cudaError_t e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess) {
      std::printf("FATAL %s: %s\n", c.name.c_str(), cudaGetErrorString(e));
      std::exit(3);
    }
  }
  Counts total{};
  if (ok) {
    Counts* dc;
    CK(cudaMalloc(&dc, sizeof(Counts)));
    CK(cudaMemset(dc, 0, sizeof(Counts)));
    for (int64_t i = 0; i < G; ++i) {
      int64_t m = c.dims[3 * i], n = c.dims[3 * i + 1], k = c.dims[3 * i + 2];
      if (m * n == 0) continue;
      double *ref, *mag;
      unsigned char* dz;
      CK(cudaMalloc(&ref, m * n * 8));
      CK(cudaMalloc(&mag, m * n * 8));
      CK(cudaMalloc(&dz, m * n));
      CK(cudaMemset(dz, k == 0 ? 1 : 0, m * n));
      RefDesc d{GMM_BATCHED, c.dt, 1, m, n, k, A[i].view, B[i].view, nullptr, nullptr, nullptr, 1};
      ref_kernel<<<256, 256>>>(d, ref, mag);
      compare_kernel<<<256, 256>>>(outs[i], c.out, ref, mag, dz, m * n,
                                   tol_for(c.dt, c.tf32, k), 1, dc);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      cudaFree(ref); cudaFree(mag); cudaFree(dz);
    }
    CK(cudaMemcpy(&total, dc, sizeof total, cudaMemcpyDeviceToHost));
    cudaFree(dc);
    char buf[512];
    std::snprintf(buf, sizeof buf, "%llu NaN, %llu wrong, %llu non-zero, max rel err %.3g; first wrong (some group) = %.9g, ref %.9g, sum|ab| %.3g", total.nan,
                  total.bad, total.nonzero, total.maxerr, total.first_out, total.first_ref, total.first_mag);
    why = buf;
    ok = !(total.nan || total.bad || total.nonzero);
  }
  for (int64_t i = 0; i < G; ++i) {
    cudaFree(A[i].buf); cudaFree(B[i].buf); cudaFree(outs[i]);
  }
  cudaFree(dargs); cudaFree(dws); cudaFreeHost(host);
  CK(cudaStreamDestroy(stream));
  return ok;
}

// Random non-decreasing offs over [0, ext] with some empty groups; `align` rounds the
// ends to a multiple (1 = misaligned allowed); `tail` leaves room past the last group.
std::vector<int> make_offs(int64_t G, int64_t ext, int64_t align, bool tail, Rng& rng) {
  std::vector<int> o(G);
  int64_t limit = tail ? ext - ext / 5 : ext;
  for (int64_t g = 0; g < G; ++g) o[g] = int(rng.uni(0, limit) / align * align);
  std::sort(o.begin(), o.end());
  if (G > 2) o[1] = o[0];  // an empty group
  if (!tail && G > 0) o[G - 1] = int(ext);
  return o;
}


// ---------------------------------------------------------------------------------
// --bench: throughput of the packed kernels on MoE shapes (forward, dA, dB), equal
// group split, device-filled data. Not a correctness check.

__global__ void fill_kernel(void* p, int64_t n, int dt) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float v = float((uint64_t(i) * 2654435761ull) % 1024) / 1024.0f - 0.5f;
    switch (dt) {
      case GMM_F16: static_cast<__half*>(p)[i] = __float2half(v); break;
      case GMM_BF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(v); break;
      case GMM_F32: static_cast<float*>(p)[i] = v; break;
      default: static_cast<double*>(p)[i] = v;
    }
  }
}

void* device_fill(int dt, int64_t n) {
  void* p = nullptr;
  CK(cudaMalloc(&p, std::max<int64_t>(n, 1) * esize(dt)));
  fill_kernel<<<1024, 256>>>(p, n, dt);
  CK(cudaGetLastError());
  return p;
}

void bench_one(const char* name, int dt, int64_t G, int64_t T, int64_t K, int64_t N) {
  // storage: x [T, K], w [G, K, N], grad [T, N]
  void* x = device_fill(dt, T * K);
  void* w = device_fill(dt, G * K * N);
  void* gr = device_fill(dt, T * N);
  void* out = nullptr;
  CK(cudaMalloc(&out, std::max(std::max(T * N, T * K), G * K * N) * esize(dt)));
  std::vector<int> offs(G);
  for (int64_t g = 0; g < G; ++g) offs[g] = int((g + 1) * T / G);
  int* doffs;
  CK(cudaMalloc(&doffs, G * 4));
  CK(cudaMemcpy(doffs, offs.data(), G * 4, cudaMemcpyHostToDevice));
  struct P { const char* what; gmm_packed p; };
  auto packed = [&](int form, int64_t m, int64_t n, int64_t k, gmm_operand a, gmm_operand b, gmm_operand c) {
    gmm_packed p{};
    p.form = form; p.dtype = dt; p.out_dtype = dt; p.device = 0; p.groups = G;
    p.m = m; p.n = n; p.k = k; p.a = a; p.b = b; p.c = c; p.offs = uint64_t(doffs);
    return p;
  };
  std::vector<P> runs = {
      {"fwd  x[T,K] w[G,K,N]", packed(GMM_GROUPED_M, T, N, K, {uint64_t(x), 1, T, K, 0, K, 1},
                                       {uint64_t(w), G, K, N, K * N, N, 1}, {uint64_t(out), 1, T, N, 0, N, 1})},
      {"dX   g[T,N] wT[G,N,K]", packed(GMM_GROUPED_M, T, K, N, {uint64_t(gr), 1, T, N, 0, N, 1},
                                        {uint64_t(w), G, N, K, K * N, 1, N}, {uint64_t(out), 1, T, K, 0, K, 1})},
      {"dW   xT[K,T] g[T,N]", packed(GMM_GROUPED_K, K, N, T, {uint64_t(x), 1, K, T, 0, 1, K},
                                      {uint64_t(gr), 1, T, N, 0, N, 1}, {uint64_t(out), G, K, N, K * N, N, 1})},
  };
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (P& r : runs) {
    char msg[1024];
    size_t ws = 0;
    if (gmm_packed_workspace_bytes(&r.p, &ws, msg, sizeof msg)) { std::printf("bench %s: %s\n", r.what, msg); continue; }
    void* dws;
    CK(cudaMalloc(&dws, std::max<size_t>(ws, 256)));
    bool ok = true;
    for (int i = 0; i < 3 && ok; ++i) ok = gmm_launch_packed(&r.p, uint64_t(dws), ws, msg, sizeof msg) == 0;
    const int iters = 10;
    CK(cudaEventRecord(e0));
    for (int i = 0; i < iters && ok; ++i) ok = gmm_launch_packed(&r.p, uint64_t(dws), ws, msg, sizeof msg) == 0;
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    double flops = 2.0 * double(T) * double(K) * double(N);
    if (ok) std::printf("bench %-6s %-10s %-24s G=%lld T=%lld K=%lld N=%lld: %.3f ms, %.0f TFLOP/s\n", dname(dt), name, r.what,
                        (long long)G, (long long)T, (long long)K, (long long)N, ms / iters, flops / (ms / iters * 1e-3) / 1e12);
    else std::printf("bench %s: launch failed: %s\n", r.what, msg);
    cudaFree(dws);
  }
  CK(cudaDeviceSynchronize());
  cudaFree(x); cudaFree(w); cudaFree(gr); cudaFree(out); cudaFree(doffs);
}

}  // namespace

int main(int argc, char** argv) {
  bool small = false, bench = false;
  std::string filter;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--small")) small = true;
    else if (!std::strcmp(argv[i], "--bench")) bench = true;
    else if (!std::strcmp(argv[i], "--filter") && i + 1 < argc) filter = argv[++i];
    else if (!std::strcmp(argv[i], "--device") && i + 1 < argc) g_dev = std::atoi(argv[++i]);
  }
  CK(cudaSetDevice(g_dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, g_dev));
  std::printf("device: %s (sm_%d%d, %d SMs), CUTLASS %s, sm90 kernels %s\n", prop.name,
              prop.major, prop.minor, prop.multiProcessorCount, gmm_cutlass_version(),
              gmm_has_sm90() ? "built" : "absent");
  if (bench) {
    for (int dt : {GMM_BF16, GMM_F16}) {
      bench_one("mixtral", dt, 8, 16384, 4096, 14336);
      bench_one("64-small", dt, 64, 32768, 2048, 1536);
    }
    return 0;
  }
  Rng rng(12345);
  struct DT { int dt, out; bool tf32; const char* name; };
  std::vector<DT> dts = {{GMM_BF16, GMM_BF16, false, "bf16"}, {GMM_F16, GMM_F16, false, "f16"},
                         {GMM_BF16, GMM_F32, false, "bf16>f32"}, {GMM_F16, GMM_F32, false, "f16>f32"},
                         {GMM_F32, GMM_F32, false, "f32"}, {GMM_F32, GMM_F32, true, "tf32"},
                         {GMM_F64, GMM_F64, false, "f64"}};
  std::vector<Case> cases;
  auto add = [&](Case c) {
    char buf[512];
    std::snprintf(buf, sizeof buf, "%s form=%s %s A%c B%c G=%lld m=%lld n=%lld k=%lld pad=%lld shift=%lld",
                  c.name.c_str(), fname(c.form), c.tf32 ? "tf32" : dname(c.dt) , c.acol ? 'c' : 'r', c.bcol ? 'c' : 'r',
                  (long long)c.G, (long long)c.m, (long long)c.n, (long long)c.k, (long long)c.pad,
                  (long long)c.shift);
    c.name = std::string(buf) + (c.out != c.dt ? " out=f32" : "");
    cases.push_back(c);
  };
  auto base = [&](const char* nm, int form, const DT& d, bool ac, bool bc, int64_t G, int64_t m,
                  int64_t n, int64_t k, int64_t align, bool tail) {
    Case c;
    c.name = nm;
    c.form = form; c.dt = d.dt; c.out = d.out; c.tf32 = d.tf32; c.acol = ac; c.bcol = bc;
    c.G = G; c.m = m; c.n = n; c.k = k;
    int64_t ext = form == GMM_GROUPED_M ? m : form == GMM_GROUPED_K ? k : form == GMM_GROUPED_N ? n : 0;
    if (form != GMM_BATCHED) c.offs = make_offs(G, ext, align, tail, rng);
    return c;
  };
  const int forms[4] = {GMM_GROUPED_M, GMM_GROUPED_K, GMM_GROUPED_N, GMM_BATCHED};
  if (small) {
    for (const DT& d : dts) {
      for (int f : forms) {
        add(base("aligned", f, d, false, true, 3, 64, 48, 40, 8, true));
        add(base("odd", f, d, true, false, 3, 33, 17, 9, 1, true));
      }
    }
    Case bad = base("bad-offs", GMM_GROUPED_M, dts[0], false, false, 4, 40, 16, 16, 1, false);
    bad.offs = {10, -3, 50, 20};
    bad.bad_offs = true;
    bad.racy = true;
    add(bad);
  } else {
    for (const DT& d : dts) {
      for (int f : forms) {
        for (int combo = 0; combo < 4; ++combo) {
          bool ac = combo >> 1, bc = combo & 1;
          // aligned sizes and group starts: the TMA / vectorised path on Hopper
          add(base("aligned", f, d, ac, bc, 5, 256, 192, 136, 8, true));
          // odd sizes, misaligned group starts: the any-alignment fallback
          add(base("odd", f, d, ac, bc, 4, 77, 45, 23, 1, true));
        }
        // padded leading dims and misaligned bases
        Case c = base("padded", f, d, false, false, 3, 64, 64, 64, 8, true);
        c.pad = 3; c.shift = 1;
        add(c);
        Case c2 = base("padded8", f, d, true, true, 3, 64, 64, 64, 8, false);
        c2.pad = 8; c2.shift = 8;
        add(c2);
        // K = 0 (every group zero) and all groups empty
        add(base("k0", f, d, false, false, 3, 32, 24, 0, 1, true));
        if (f != GMM_BATCHED) {
          Case e = base("all-empty", f, d, false, false, 4, 32, 24, 16, 1, true);
          std::fill(e.offs.begin(), e.offs.end(), 0);
          add(e);
        }
        // more than 1024 groups
        add(base("many", f, d, false, f == GMM_GROUPED_K, 1500, f == GMM_GROUPED_M ? 6000 : 16,
                 f == GMM_GROUPED_N ? 6000 : 24, f == GMM_GROUPED_K ? 6000 : 16, 1, true));
      }
    }
    // larger shapes on the fast paths
    for (int i = 0; i < 2; ++i) {
      const DT& d = dts[i];
      add(base("large", GMM_GROUPED_M, d, false, false, 8, 4096, 1024, 512, 8, true));
      add(base("large-dA", GMM_GROUPED_M, d, false, true, 8, 4096, 512, 1024, 8, true));
      add(base("large-dB", GMM_GROUPED_K, d, true, false, 8, 512, 1024, 4096, 8, true));
    }
    // bad offs: decreasing, negative, past the end
    for (int f : {GMM_GROUPED_M, GMM_GROUPED_K, GMM_GROUPED_N}) {
      Case b1 = base("bad-decreasing", f, dts[0], false, false, 4, 48, 40, 32, 1, false);
      b1.offs = {20, 8, 30, int(f == GMM_GROUPED_M ? 48 : f == GMM_GROUPED_K ? 32 : 40)};
      b1.bad_offs = true;
      b1.racy = f != GMM_GROUPED_K;  // overlapping row/column spans race by contract
      add(b1);
      Case b2 = base("bad-negative-past-end", f, dts[0], false, false, 4, 48, 40, 32, 1, false);
      b2.offs = {-5, 4, 12, 1000};
      b2.bad_offs = true;
      add(b2);
    }
    // CUDA graph capture of packed launches
    for (int i = 0; i < 2; ++i) {
      Case g = base("graph", GMM_GROUPED_M, dts[i], false, false, 6, 512, 256, 128, 1, true);
      g.graph = true;
      add(g);
      Case g2 = base("graph", GMM_GROUPED_K, dts[i], true, false, 6, 128, 256, 512, 1, true);
      g2.graph = true;
      add(g2);
    }
  }
  int passed = 0, failed = 0;
  for (const Case& c : cases) {
    if (!filter.empty() && c.name.find(filter) == std::string::npos) continue;
    std::string why;
    bool ok = run_packed(c, rng, why);
    std::printf("%s packed %s: %s\n", ok ? "PASS" : "FAIL", c.name.c_str(), why.c_str());
    std::fflush(stdout);
    (ok ? passed : failed)++;
  }
  // list form
  std::vector<ListCase> lists;
  for (const DT& d : dts) {
    for (int variant = 0; variant < (small ? 1 : 3); ++variant) {
      ListCase l;
      l.dt = d.dt; l.out = d.out; l.tf32 = d.tf32;
      int64_t G = small ? 5 : (variant == 2 ? 1100 : 9);
      for (int64_t i = 0; i < G; ++i) {
        int64_t align = variant == 0 ? 8 : 1;
        int64_t mx = G > 100 ? 24 : 130;
        l.dims.push_back(rng.uni(0, mx) / align * align);
        l.dims.push_back(rng.uni(1, mx) / align * align);
        l.dims.push_back(i % 4 == 3 ? 0 : rng.uni(1, mx) / align * align);
        l.acol.push_back(int(rng.uni(0, 1)));
        l.bcol.push_back(int(rng.uni(0, 1)));
      }
      l.pad = variant == 1 ? 1 : 0;
      l.shift = variant == 1 ? 1 : 0;
      char buf[128];
      std::snprintf(buf, sizeof buf, "list %s variant=%d G=%lld", d.name, variant, (long long)G);
      l.name = buf;
      lists.push_back(l);
    }
  }
  for (const ListCase& l : lists) {
    if (!filter.empty() && l.name.find(filter) == std::string::npos) continue;
    std::string why;
    bool ok = run_list(l, rng, why);
    std::printf("%s %s: %s\n", ok ? "PASS" : "FAIL", l.name.c_str(), why.c_str());
    std::fflush(stdout);
    (ok ? passed : failed)++;
  }
  // error reporting: a bad operand must come back as an error, not a crash
  {
    gmm_packed p{};
    p.form = GMM_GROUPED_M; p.dtype = GMM_BF16; p.out_dtype = GMM_F64; p.groups = 1; p.m = 8; p.n = 8; p.k = 8;
    char msg[512];
    size_t ws;
    int rc = gmm_packed_workspace_bytes(&p, &ws, msg, sizeof msg);
    bool ok = rc != 0 && std::strstr(msg, "unsupported dtype") != nullptr;
    std::printf("%s error-path bad dtype combination: %s\n", ok ? "PASS" : "FAIL", msg);
    (ok ? passed : failed)++;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
