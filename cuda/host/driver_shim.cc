// cuTensorMapEncodeTiled for CUTLASS without linking libcuda. Host only.
//
// build/ defines CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL, so CUTLASS calls the driver
// function by name. This definition (hidden: it never interposes on the real libcuda
// symbol for anyone else) resolves the driver entry point once, through the runtime
// (cudaGetDriverEntryPointByVersion), and caches it; CUTLASS's own wrapper would repeat
// that lookup for every TMA descriptor of every launch. It lives in the same archive as
// the kernels that call it (build/), so the linker always finds it.
#include <cuda.h>
#include <cuda_runtime_api.h>

extern "C" __attribute__((visibility("hidden"))) CUresult CUDAAPI cuTensorMapEncodeTiled(
    CUtensorMap* tensor_map, CUtensorMapDataType dtype, cuuint32_t rank, void* global_address,
    const cuuint64_t* global_dim, const cuuint64_t* global_strides, const cuuint32_t* box_dim,
    const cuuint32_t* element_strides, CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
    CUtensorMapL2promotion l2_promotion, CUtensorMapFloatOOBfill oob_fill) {
  using Fn = CUresult(CUDAAPI*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static const Fn fn = []() -> Fn {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      return nullptr;
    }
    return reinterpret_cast<Fn>(p);
  }();
  if (fn == nullptr) return CUDA_ERROR_NOT_FOUND;
  return fn(tensor_map, dtype, rank, global_address, global_dim, global_strides, box_dim,
            element_strides, interleave, swizzle, l2_promotion, oob_fill);
}
