// A tuning program for the row kernels (cuda/device/rows.cu), not part of the library: each
// variant (a build of rows.cu behind wrap.cu, see run.sh) runs the gathering ops the fused
// MoE layer runs, on routing-shaped indices (top-k distinct experts per token, rows sorted
// by expert then token), checked against the first variant, timed interleaved with a
// device-to-device copy of the same bytes.
//
//   rows_dev [--quick]      prints a table; one JSON line per (op, shape) to stdout
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using Entry = int (*)(int, int, int, int64_t, int64_t, int64_t, int64_t, const void*, const void*,
                      const int32_t*, const void*, void*, int32_t*, int*, int, cudaStream_t);
#define DECL(name)                                                                             \
  extern "C" int name(int, int, int, int64_t, int64_t, int64_t, int64_t, const void*,          \
                      const void*, const int32_t*, const void*, void*, int32_t*, int*, int, \
                      cudaStream_t);
VARIANT_DECLS
static const Entry kEntries[] = {VARIANT_LIST};
static const char* kNames[] = {VARIANT_NAMES};
constexpr int kVariants = sizeof(kEntries) / sizeof(kEntries[0]);

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)

enum Op { kGatherSum = 2, kScatterRows = 3 };
// dtype codes of device/types.h
enum { F16 = 0, BF16 = 1, F32 = 2, F64 = 3 };
static int esize(int d) { return d == F32 ? 4 : d == F64 ? 8 : 2; }

struct Routing {
  std::vector<int32_t> src, inverse;  // [R], [T, k]
};

static Routing route(int64_t T, int64_t k, int64_t E, std::mt19937& g) {
  std::vector<std::pair<int64_t, int64_t>> keys;  // (expert, t*k + j)
  keys.reserve(T * k);
  std::vector<int> pick(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      int e;
      bool dup;
      do {
        e = int(g() % E);
        dup = false;
        for (int64_t q = 0; q < j; ++q) dup |= pick[q] == e;
      } while (dup);
      pick[j] = e;
      keys.push_back({e, t * k + j});
    }
  }
  std::stable_sort(keys.begin(), keys.end(),
                   [](auto& a, auto& b) { return a.first < b.first; });
  Routing r;
  r.src.resize(T * k);
  r.inverse.resize(T * k);
  for (int64_t i = 0; i < T * k; ++i) {
    r.src[i] = int32_t(keys[i].second / k);
    r.inverse[keys[i].second] = int32_t(i);
  }
  return r;
}

__global__ void fill(uint16_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    const float v = (float(h & 0xffff) / 65536.0f - 0.5f) * 4.0f;
    const __nv_bfloat16 b = __float2bfloat16(v);
    p[i] = *reinterpret_cast<const uint16_t*>(&b);
  }
}

struct Case {
  const char* name;  // combine (weighted sum over k), sum (dx), gather (x[src]), scatter (dy)
  int op;
  int64_t T, D, k;
};

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  fprintf(stderr, "device %s, %d SMs, variants:", prop.name, sms);
  for (int v = 0; v < kVariants; ++v) fprintf(stderr, " %s", kNames[v]);
  fprintf(stderr, "\n");
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  int* err;
  CK(cudaMalloc(&err, sizeof(int)));
  CK(cudaMemset(err, 0, sizeof(int)));

  std::vector<Case> cases;
  const int64_t Ts[] = {256, 4096, 16384, 65536};
  const int64_t Ds[] = {768, 2048, 4096, 7168};
  const int64_t Ks[] = {1, 2, 4, 8, 16};
  for (int64_t T : Ts)
    for (int64_t D : Ds)
      for (int64_t k : Ks) {
        if (T * k * D * 2 > (int64_t(3) << 30)) continue;  // [R, D] bf16 over 3 GiB
        if ((k == 2 || k == 4) && D != 2048) continue;
        if (quick && !(D == 2048 && (k == 8 || k == 1) && T >= 4096)) continue;
        cases.push_back({"combine", kGatherSum, T, D, k});
        cases.push_back({"sum", kGatherSum, T, D, k});
        if (k > 1) cases.push_back({"gather", kGatherSum, T, D, k});
        cases.push_back({"scatter", kScatterRows, T, D, k});
      }

  std::mt19937 g(1234);
  printf("%-8s %6s %5s %3s | %9s", "op", "T", "D", "k", "copy GB/s");
  for (int v = 0; v < kVariants; ++v) printf(" | %10s GB/s  frac", kNames[v]);
  printf(" | ok\n");
  for (const Case& c : cases) {
    const int64_t T = c.T, D = c.D, k = c.k, R = T * k, E = std::max<int64_t>(k, 128);
    Routing rt = route(T, k, E, g);
    // operands (bf16): x and out by op
    int64_t x_rows, out_rows, tokens, top_k, rows;
    const std::vector<int32_t>* index;
    bool weighted = false;
    if (c.op == kScatterRows) {
      x_rows = T, out_rows = R, tokens = T, top_k = k, rows = R, index = &rt.inverse;
    } else if (std::string(c.name) == "gather") {
      x_rows = T, out_rows = R, tokens = R, top_k = 1, rows = T, index = &rt.src;
    } else {
      x_rows = R, out_rows = T, tokens = T, top_k = k, rows = R, index = &rt.inverse;
      weighted = std::string(c.name) == "combine";
    }
    const int64_t es = 2;
    // bytes each op must move: every named row read once, every output row written once,
    // the index (and weights) read once
    const int64_t bytes = (tokens * top_k + out_rows) * D * es + int64_t(index->size()) * 4 +
                          (weighted ? tokens * top_k * 4 : 0);
    uint16_t *x, *copy_dst;
    std::vector<uint16_t*> outs(kVariants);
    int32_t *idx, *scratch;
    float* w = nullptr;
    CK(cudaMalloc(&x, x_rows * D * es));
    for (auto& o : outs) CK(cudaMalloc(&o, out_rows * D * es));
    CK(cudaMalloc(&copy_dst, bytes / 2 + 16));
    uint16_t* copy_src = nullptr;
    CK(cudaMalloc(&copy_src, bytes / 2 + 16));
    CK(cudaMalloc(&idx, index->size() * 4));
    CK(cudaMalloc(&scratch, R * 4));
    CK(cudaMemcpy(idx, index->data(), index->size() * 4, cudaMemcpyHostToDevice));
    fill<<<1024, 256>>>(x, x_rows * D, 7);
    if (weighted) {
      std::vector<float> hw(tokens * top_k);
      for (auto& v : hw) v = float(g() % 1000) / 1000.0f;
      CK(cudaMalloc(&w, hw.size() * 4));
      CK(cudaMemcpy(w, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));
    }
    auto run = [&](int v) {
      if (c.op == kScatterRows) CK(cudaMemsetAsync(scratch, 0, R * 4, s));
      if (kEntries[v](c.op, BF16, F32, tokens, top_k, rows, D, x, nullptr, idx, w, outs[v],
                      scratch, err, sms, s) != 0) {
        fprintf(stderr, "launch failed\n");
        exit(1);
      }
    };
    // warm-up and check: every variant equal to the first (value equality: +0 == -0)
    for (int v = 0; v < kVariants; ++v) run(v);
    CK(cudaStreamSynchronize(s));
    CK(cudaGetLastError());
    bool ok = true;
    if (out_rows * D <= (int64_t(64) << 20)) {
      const int64_t n = out_rows * D;
      std::vector<uint16_t> ref(n), got(n);
      CK(cudaMemcpy(ref.data(), outs[0], n * 2, cudaMemcpyDeviceToHost));
      for (int v = 1; v < kVariants; ++v) {
        CK(cudaMemcpy(got.data(), outs[v], n * 2, cudaMemcpyDeviceToHost));
        for (int64_t i = 0; i < n; ++i) {
          if (ref[i] != got[i] && !((ref[i] | got[i]) == 0x8000)) {
            ok = false;
            fprintf(stderr, "%s %s T=%ld D=%ld k=%ld: mismatch at %ld: %04x vs %04x\n", c.name,
                    kNames[v], long(T), long(D), long(k), long(i), ref[i], got[i]);
            break;
          }
        }
      }
    }
    // timing: rounds of (copy, each variant), each sample `reps` launches between events
    const int reps = bytes > (int64_t(256) << 20) ? 5 : bytes > (int64_t(16) << 20) ? 20 : 100;
    const int rounds = 7;
    std::vector<std::vector<float>> ms(kVariants + 1);
    for (int r = 0; r < rounds; ++r) {
      for (int q = 0; q <= kVariants; ++q) {
        const int v = (q + r) % (kVariants + 1);
        CK(cudaEventRecord(e0, s));
        for (int i = 0; i < reps; ++i) {
          if (v == kVariants) {
            CK(cudaMemcpyAsync(copy_dst, copy_src, bytes / 2, cudaMemcpyDeviceToDevice, s));
          } else {
            run(v);
          }
        }
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        ms[v].push_back(t / reps);
      }
    }
    auto median = [](std::vector<float> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double copy_ms = median(ms[kVariants]);
    const double copy_gbs = bytes / copy_ms / 1e6;
    printf("%-8s %6ld %5ld %3ld | %9.0f", c.name, long(T), long(D), long(k), copy_gbs);
    std::string json = "{\"op\":\"" + std::string(c.name) + "\",\"T\":" + std::to_string(T) +
                       ",\"D\":" + std::to_string(D) + ",\"k\":" + std::to_string(k) +
                       ",\"bytes\":" + std::to_string(bytes) +
                       ",\"copy_ms\":" + std::to_string(copy_ms);
    for (int v = 0; v < kVariants; ++v) {
      const double m = median(ms[v]);
      // the scatter's time includes its memset of the index scratch (as the library's does)
      printf(" | %15.0f %5.2f", bytes / m / 1e6, copy_ms / m);
      json += ",\"" + std::string(kNames[v]) + "_ms\":" + std::to_string(m);
    }
    printf(" | %s\n", ok ? "ok" : "MISMATCH");
    fprintf(stderr, "JSON %s,\"ok\":%s}\n", json.c_str(), ok ? "true" : "false");
    fflush(stdout);
    cudaFree(x);
    for (auto& o : outs) cudaFree(o);
    cudaFree(copy_dst);
    cudaFree(copy_src);
    cudaFree(idx);
    cudaFree(scratch);
    if (w) cudaFree(w);
  }
  int h_err = 0;
  CK(cudaMemcpy(&h_err, err, 4, cudaMemcpyDeviceToHost));
  printf("error flag after all cases: %d (0 expected)\n", h_err);
  return 0;
}
