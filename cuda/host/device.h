// Per-device facts and state of the host code: compute capability and SM count (queried
// once per device), the current device of this library's (static) CUDA runtime, and the
// deferred "invalid offs seen" flag. Host only; nothing here syncs with a device.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace gmm {

struct DevInfo {
  int sm_count = 0, cc_major = 0, cc_minor = 0;
};

// The facts of `device` (validated against the devices visible to the process); throws
// std::runtime_error naming the failed call.
DevInfo device_info(int device);

// Makes `device` current for this thread's CUDA runtime (the static runtime keeps its
// own current device, apart from torch's), clears a stale error so that a later
// cudaGetLastError() reports only our launches, and returns its facts.
DevInfo enter(int device);

// Device address of the error flag of `device` (host-mapped pinned memory, allocated on
// first use, also inside a graph capture).
int* error_flag(int device);

// Reads and clears the error flag of `device`: its value (device/types.h), nonzero when a
// launch there met negative, decreasing or out-of-range offs (kErrOffs) or a routed-row
// index out of range (kErrIndex) since the last read. Only completed work is reflected.
int take_error_flag(int device);

// cudaStreamIsCapturing (host only, no sync).
bool stream_capturing(cudaStream_t stream);

}  // namespace gmm
