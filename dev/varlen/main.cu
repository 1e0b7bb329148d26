// Tuning program for the varlen kernels (development tool, not part of the library): for
// MoE shapes x routings x passes, runs every compiled variant (variant.cu), checks each
// against a float64-accumulated reference on sampled output elements (and every variant
// against the first one bitwise where they share an accumulation order), poisons outputs
// first, and times the variants interleaved round-robin (median of rounds, CUDA events
// around `reps` back-to-back calls). Prints one line per (case, variant), writes JSON lines
// to argv[1] when given.
#include "kernels/varlen/args.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using gmm::varlen::Args;
using gmm::varlen::Mode;

#define NV 10
#define DECL(i) std::string run_v##i(const Args&);
DECL(0) DECL(1) DECL(2) DECL(3) DECL(4) DECL(5) DECL(6) DECL(7) DECL(8) DECL(9)
static std::string (*kRun[NV])(const Args&) = {run_v0, run_v1, run_v2, run_v3, run_v4,
                                              run_v5, run_v6, run_v7, run_v8, run_v9};
static const char* kName[NV] = {"co128", "co192", "co256", "pp128", "pp192",
                                "co192", "co128", "co256", "pp128", "pp192"};
static const Mode kMode[NV] = {Mode::M, Mode::M, Mode::M, Mode::M, Mode::M,
                               Mode::K, Mode::K, Mode::K, Mode::K, Mode::K};

#define CK(x)                                                                       \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "CUDA %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(2);                                                                 \
    }                                                                               \
  } while (0)

__global__ void fill(__nv_bfloat16* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    z ^= z >> 31; z *= 0xBF58476D1CE4E5B9ull; z ^= z >> 29;
    p[i] = __float2bfloat16(float(int(z % 2001) - 1000) / 1000.f);
  }
}
__global__ void poison(uint16_t* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) p[i] = 0x7fc1;
}
// Sampled reference: element (r, c) of the product, accumulated in double.
// M: D[r, c] = sum_k A[r, k] * B[g(r)](k, c) (B N-major [G, K, N] or K-major [G, N, K]);
//    rows past the last group are 0.
// K: D[g](r, c) = sum_{t in span g} X[t, r] * Y[t, c].
__global__ void ref(const __nv_bfloat16* a, const __nv_bfloat16* b, const int* offs, int G, int m, int n, int k,
                    bool kmaj, Mode mode, const int* rows, const int* cols, const int* grp, int ns, double* out) {
  int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= ns) return;
  int r = rows[s], c = cols[s], g = grp[s];
  double acc = 0;
  if (mode == Mode::M) {
    if (g < G) for (int q = 0; q < k; ++q) {
      float bv = kmaj ? __bfloat162float(b[int64_t(g) * n * k + int64_t(c) * k + q])
                      : __bfloat162float(b[int64_t(g) * k * n + int64_t(q) * n + c]);
      acc += double(__bfloat162float(a[int64_t(r) * k + q])) * bv;
    }
  } else {
    int s0 = g == 0 ? 0 : offs[g - 1], s1 = offs[g];
    for (int t = s0; t < s1; ++t)
      acc += double(__bfloat162float(a[int64_t(t) * m + r])) * double(__bfloat162float(b[int64_t(t) * n + c]));
  }
  out[s] = acc;
}

struct Case { const char* name; int E, T, K, N; };

static std::vector<int> route(int E, int T, bool zipf, std::mt19937& rng) {
  std::vector<double> w(E);
  for (int e = 0; e < E; ++e) w[e] = zipf ? 1.0 / std::pow(e + 1.0, 1.2) : 1.0;
  std::shuffle(w.begin(), w.end(), rng);
  double sum = 0; for (double v : w) sum += v;
  std::vector<int> cnt(E); int tot = 0;
  for (int e = 0; e < E; ++e) { cnt[e] = int(std::floor(T * w[e] / sum)); tot += cnt[e]; }
  for (int e = 0; tot < T; e = (e + 1) % E) { cnt[e]++; tot++; }
  std::vector<int> offs(E); int acc = 0;
  for (int e = 0; e < E; ++e) { acc += cnt[e]; offs[e] = acc; }
  return offs;
}

int main(int argc, char** argv) {
  FILE* js = argc > 1 ? std::fopen(argv[1], "w") : nullptr;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 10, rounds = argc > 3 ? std::atoi(argv[3]) : 5;
  const char* only = argc > 4 ? argv[4] : "";
  // Filters for profiling one kernel (ncu): VDEV_PASS=fwd|dX|dW, VDEV_VARIANT=<name>,
  // VDEV_ROUTING=unif|zipf, VDEV_NOTIME=1 (checks only).
  const char* fpass = std::getenv("VDEV_PASS");
  const char* fvar = std::getenv("VDEV_VARIANT");
  const char* froute = std::getenv("VDEV_ROUTING");
  const bool notime = std::getenv("VDEV_NOTIME") != nullptr;
  int sms = 0; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs\n", prop.name, sms);
  const Case cases[] = {
      {"qwen3-up", 128, 32768, 2048, 1536}, {"qwen3-down", 128, 32768, 768, 2048},
      {"olmoe-up", 64, 32768, 2048, 2048},   {"small64", 64, 8192, 1024, 1024},
      {"decode-qwen3-up", 128, 512, 2048, 1536}, {"qwen3-up-16k", 128, 131072, 2048, 1536},
      {"gptoss-up", 32, 16384, 2880, 5760},  {"dsv3-up", 32, 32768, 7168, 4096},
  };
  std::mt19937 rng(1234);
  for (const Case& cs : cases) {
    if (*only && !std::strstr(cs.name, only)) continue;
    for (int zipf = 0; zipf < 2; ++zipf) {
      if (froute && std::strcmp(froute, zipf ? "zipf" : "unif") != 0) continue;
      std::vector<int> offs = route(cs.E, cs.T, zipf, rng);
      const int E = cs.E, T = cs.T, K = cs.K, N = cs.N;
      __nv_bfloat16 *x, *w, *dy; int* doffs;
      const int64_t maxo = std::max<int64_t>({int64_t(T) * N, int64_t(T) * K, int64_t(E) * K * N});
      CK(cudaMalloc(&x, int64_t(T) * K * 2)); CK(cudaMalloc(&w, int64_t(E) * K * N * 2));
      CK(cudaMalloc(&dy, int64_t(T) * N * 2));
      CK(cudaMalloc(&doffs, E * 4));
      fill<<<1024, 256>>>(x, int64_t(T) * K, 1); fill<<<1024, 256>>>(w, int64_t(E) * K * N, 2);
      fill<<<1024, 256>>>(dy, int64_t(T) * N, 3);
      CK(cudaMemcpy(doffs, offs.data(), E * 4, cudaMemcpyHostToDevice));
      std::vector<__nv_bfloat16*> outs(NV);
      for (int v = 0; v < NV; ++v) CK(cudaMalloc(&outs[v], maxo * 2));
      for (int pass = 0; pass < 3; ++pass) {  // fwd, dX, dW
        const char* pname = pass == 0 ? "fwd" : pass == 1 ? "dX" : "dW";
        if (fpass && std::strcmp(fpass, pname) != 0) continue;
        const Mode mode = pass == 2 ? Mode::K : Mode::M;
        Args a;
        a.mode = mode; a.offs = doffs; a.groups = E; a.sm_count = sms; a.device = 0; a.stream = 0;
        if (pass == 0) { a.a = x; a.lda = K; a.b = w; a.ldb = N; a.ldb_batch = int64_t(K) * N; a.b_k_major = false;
                         a.m = T; a.n = N; a.k = K; a.ldd = N; }
        if (pass == 1) { a.a = dy; a.lda = N; a.b = w; a.ldb = N; a.ldb_batch = int64_t(K) * N; a.b_k_major = true;
                         a.m = T; a.n = K; a.k = N; a.ldd = K; }
        if (pass == 2) { a.a = x; a.lda = K; a.b = dy; a.ldb = N; a.m = K; a.n = N; a.k = T; a.ldd = N;
                         a.ldd_batch = int64_t(K) * N; }
        const int64_t osz = pass == 2 ? int64_t(E) * K * N : pass == 0 ? int64_t(T) * N : int64_t(T) * K;
        const double flops = 2.0 * T * K * N;
        // sampled reference
        const int ns = 2048;
        std::vector<int> rows(ns), cols(ns), grp(ns);
        std::uniform_int_distribution<int> ur(0, a.m - 1), uc(0, a.n - 1), ug(0, E - 1);
        for (int s = 0; s < ns; ++s) {
          rows[s] = ur(rng); cols[s] = uc(rng);
          if (mode == Mode::M) { int g = 0; while (g < E && offs[g] <= rows[s]) ++g; grp[s] = g; }
          else grp[s] = ug(rng);
        }
        int *drows, *dcols, *dgrp; double* dref;
        CK(cudaMalloc(&drows, ns * 4)); CK(cudaMalloc(&dcols, ns * 4)); CK(cudaMalloc(&dgrp, ns * 4));
        CK(cudaMalloc(&dref, ns * 8));
        CK(cudaMemcpy(drows, rows.data(), ns * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dcols, cols.data(), ns * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dgrp, grp.data(), ns * 4, cudaMemcpyHostToDevice));
        ref<<<(ns + 127) / 128, 128>>>((const __nv_bfloat16*)a.a, (const __nv_bfloat16*)a.b, doffs, E, a.m, a.n, a.k,
                                       a.b_k_major, mode, drows, dcols, dgrp, ns, dref);
        CK(cudaGetLastError());
        std::vector<double> hr(ns); CK(cudaMemcpy(hr.data(), dref, ns * 8, cudaMemcpyDeviceToHost));
        std::vector<int> vs;
        for (int v = 0; v < NV; ++v)
          if (kMode[v] == mode && (!fvar || std::strcmp(fvar, kName[v]) == 0)) vs.push_back(v);
        // correctness
        std::vector<uint16_t> first;
        for (int v : vs) {
          poison<<<1024, 256>>>((uint16_t*)outs[v], osz);
          a.d = outs[v];
          std::string err = kRun[v](a);
          CK(cudaDeviceSynchronize());
          if (!err.empty()) { std::printf("%s %s: %s\n", cs.name, kName[v], err.c_str()); continue; }
          std::vector<uint16_t> h(osz);
          CK(cudaMemcpy(h.data(), outs[v], osz * 2, cudaMemcpyDeviceToHost));
          int64_t nan = 0; for (uint16_t u : h) nan += (u == 0x7fc1);
          double maxrel = 0;
          for (int s = 0; s < ns; ++s) {
            int64_t idx = mode == Mode::M ? int64_t(rows[s]) * a.n + cols[s]
                                          : int64_t(grp[s]) * a.m * a.n + int64_t(rows[s]) * a.n + cols[s];
            uint32_t bits = uint32_t(h[idx]) << 16; float f; std::memcpy(&f, &bits, 4);
            double e = std::fabs(f - hr[s]) / (std::sqrt(double(a.k)) * 0.6 + 1e-3);
            maxrel = std::max(maxrel, e);
          }
          int64_t diff = -1;
          if (first.empty()) first = h; else { diff = 0; for (int64_t i = 0; i < osz; ++i) diff += first[i] != h[i]; }
          std::printf("check %s %s %s %s: unwritten %lld, max err/scale %.2e, differs from first %lld %s\n", cs.name,
                      zipf ? "zipf" : "unif", pname, kName[v], (long long)nan, maxrel, (long long)diff,
                      (nan || maxrel > 2e-2) ? "FAIL" : "ok");
        }
        // timing: rounds x variants (rotated), events around reps calls
        std::vector<std::vector<float>> ms(NV);
        cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
        if (!notime) for (int v : vs) { a.d = outs[v]; kRun[v](a); }
        for (int r = 0; r < (notime ? 0 : rounds); ++r) {
          for (size_t j = 0; j < vs.size(); ++j) {
            int v = vs[(j + r) % vs.size()];
            a.d = outs[v];
            CK(cudaEventRecord(e0));
            for (int i = 0; i < reps; ++i) kRun[v](a);
            CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
            float t; CK(cudaEventElapsedTime(&t, e0, e1)); ms[v].push_back(t / reps);
          }
        }
        for (int v : (notime ? std::vector<int>() : vs)) {
          auto s = ms[v]; std::sort(s.begin(), s.end());
          float med = s[s.size() / 2];
          std::printf("time %-16s %s %-3s %s: %8.1f us  %6.0f TFLOP/s  (min %.1f max %.1f)\n", cs.name,
                      zipf ? "zipf" : "unif", pname, kName[v], med * 1e3, flops / (med * 1e-3) / 1e12, s.front() * 1e3,
                      s.back() * 1e3);
          if (js) std::fprintf(js, "{\"case\":\"%s\",\"routing\":\"%s\",\"pass\":\"%s\",\"variant\":\"%s\",\"us\":%.2f,\"tflops\":%.1f,\"min_us\":%.2f,\"max_us\":%.2f}\n",
                               cs.name, zipf ? "zipf12" : "uniform", pname, kName[v], med * 1e3, flops / (med * 1e-3) / 1e12,
                               s.front() * 1e3, s.back() * 1e3);
        }
        std::fflush(stdout); if (js) std::fflush(js);
        cudaFree(drows); cudaFree(dcols); cudaFree(dgrp); cudaFree(dref);
      }
      for (auto p : outs) cudaFree(p);
      cudaFree(x); cudaFree(w); cudaFree(dy); cudaFree(doffs);
    }
  }
  if (js) std::fclose(js);
  return 0;
}
