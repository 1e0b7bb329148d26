// Per-device facts, the current device, the deferred error flag. Host only.
#include "host/device.h"

#include "device/gemm_set.h"
#include "host/api.h"

#include <atomic>

#include <mutex>
#include <stdexcept>
#include <string>

namespace gmm {
namespace {

constexpr int kMaxDevices = 64;

[[noreturn]] void fail(const char* what, cudaError_t e) {
  throw std::runtime_error(cuda_fail(what, e));
}

// Devices visible to the process (fixed for its lifetime), counted once.
int device_count() {
  static int count = -1;
  static cudaError_t err = cudaSuccess;
  static std::once_flag once;
  std::call_once(once, [] { err = cudaGetDeviceCount(&count); });
  if (err != cudaSuccess) fail("cudaGetDeviceCount", err);
  return count;
}

void check_device(int device) {
  const int count = device_count();
  if (device < 0 || device >= count || device >= kMaxDevices) {
    throw std::runtime_error("device index " + std::to_string(device) + " out of range (" +
                             std::to_string(count) + " CUDA devices visible)");
  }
}

std::atomic<int> sm_limit_value{0};  // set_sm_limit: 0 = every SM

struct Flag {
  int* host = nullptr;
  int* dev = nullptr;
};
std::mutex flag_mutex;
Flag flags[kMaxDevices];

}  // namespace

DevInfo device_info(int device) {
  check_device(device);
  static std::once_flag once[kMaxDevices];
  static DevInfo info[kMaxDevices];
  static cudaError_t err[kMaxDevices];
  std::call_once(once[device], [&] {
    DevInfo d;
    cudaError_t e = cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, device);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&d.cc_major, cudaDevAttrComputeCapabilityMajor, device);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&d.cc_minor, cudaDevAttrComputeCapabilityMinor, device);
    info[device] = d;
    err[device] = e;
  });
  if (err[device] != cudaSuccess) fail("cudaDeviceGetAttribute", err[device]);
  DevInfo d = info[device];
  const int limit = sm_limit_value.load(std::memory_order_relaxed);
  if (limit > 0 && limit < d.sm_count) d.sm_count = limit;
  return d;
}

void set_sm_limit(int32_t sms) {
  if (sms < 0) throw std::runtime_error("sm limit " + std::to_string(sms) + " is negative");
  sm_limit_value.store(sms, std::memory_order_relaxed);
}

int32_t sm_limit() { return sm_limit_value.load(std::memory_order_relaxed); }

DevInfo enter(int device) {
  DevInfo d = device_info(device);
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) fail("cudaSetDevice", e);
  (void)cudaGetLastError();
  return d;
}

int* error_flag(int device) {
  check_device(device);
  std::lock_guard<std::mutex> lock(flag_mutex);
  Flag& f = flags[device];
  if (f.host != nullptr) return f.dev;
  // Allowed during stream capture: switch this thread to relaxed capture mode for the
  // allocation (a one-time, non-stream call).
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaError_t e = cudaThreadExchangeStreamCaptureMode(&mode);
  if (e != cudaSuccess) fail("cudaThreadExchangeStreamCaptureMode", e);
  void* h = nullptr;
  e = cudaHostAlloc(&h, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable);
  cudaError_t e2 = cudaThreadExchangeStreamCaptureMode(&mode);
  if (e != cudaSuccess) fail("cudaHostAlloc (offs error flag)", e);
  if (e2 != cudaSuccess) fail("cudaThreadExchangeStreamCaptureMode", e2);
  *static_cast<volatile int*>(h) = 0;
  void* d = nullptr;
  e = cudaHostGetDevicePointer(&d, h, 0);
  if (e != cudaSuccess) {
    cudaFreeHost(h);
    fail("cudaHostGetDevicePointer (offs error flag)", e);
  }
  f.host = static_cast<int*>(h);
  f.dev = static_cast<int*>(d);
  return f.dev;
}

int take_error_flag(int device) {
  check_device(device);
  int* h = nullptr;
  {
    std::lock_guard<std::mutex> lock(flag_mutex);
    h = flags[device].host;
  }
  if (h == nullptr) return 0;
  volatile int* v = h;
  const int set = *v;
  if (set != 0) *v = 0;
  return set;
}

bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(stream, &st);
  if (e != cudaSuccess) fail("cudaStreamIsCapturing", e);
  return st != cudaStreamCaptureStatusNone;
}

}  // namespace gmm
