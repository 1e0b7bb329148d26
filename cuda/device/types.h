// Element types, packed forms and fused epilogues. The Rust bridge (src/exec/ffi.rs)
// declares the enums as extern C++ enums: this header is the definition, and cxx checks at
// compile time that the Rust variants match. Plain C++: host code and kernels include it.
#pragma once
#include <cstdint>
#include <string_view>

namespace gmm {

enum class DType : uint8_t { F16 = 0, BF16 = 1, F32 = 2, F64 = 3 };

// The packed forms of src/shape/packed.rs (Form).
enum class Form : uint8_t { GroupedM = 0, GroupedK = 1, GroupedN = 2, Batched = 3 };

// What a GroupedM product's epilogue does beyond storing c = a . b, by name: the name of its
// rule (src/shape/product/epilogues.rs), which the bridge carries (src/exec/ffi.rs, Fusion),
// and of its policy (kEpi, kernels/varlen/epilogue/<name>.h); empty: the plain store.
using Epilogue = std::string_view;

// The values of the device's deferred error flag (host/device.h), which kernels raise instead
// of failing: invalid offs, or a routed-row index (Fusion::src) out of range. Any nonzero
// value is an error; a plain store, so the last writer's value is the one reported.
constexpr int kErrOffs = 1;
constexpr int kErrIndex = 2;

inline int elem_size(DType d) {
  switch (d) {
    case DType::F16:
    case DType::BF16: return 2;
    case DType::F32: return 4;
    case DType::F64: return 8;
  }
  return 0;
}

inline bool is_16bit(DType d) { return d == DType::F16 || d == DType::BF16; }

// The PyTorch spelling, for messages.
inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::F16: return "torch.float16";
    case DType::BF16: return "torch.bfloat16";
    case DType::F32: return "torch.float32";
    case DType::F64: return "torch.float64";
  }
  return "unknown dtype";
}

inline const char* form_name(Form f) {
  switch (f) {
    case Form::GroupedM: return "GroupedM [T,K]x[G,K,N]";
    case Form::GroupedK: return "GroupedK [M,T]x[T,N]";
    case Form::GroupedN: return "GroupedN [G,M,K]x[K,N]";
    case Form::Batched: return "Batched [G,M,K]x[G,K,N]";
  }
  return "unknown form";
}

}  // namespace gmm
