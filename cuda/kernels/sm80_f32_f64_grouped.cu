// CUTLASS 2.x grouped GEMM for float32 (full-precision SIMT, or TF32 tensor cores when
// the caller allows TF32) and float64 (fp64 tensor cores, sm_80+). Any alignment.
#include "kernels/grouped_sm80.cuh"

namespace gmm {
namespace {

using Simt = cutlass::arch::OpClassSimt;
using Tensor = cutlass::arch::OpClassTensorOp;
using MulAdd = cutlass::arch::OpMultiplyAdd;

template <class LA, class LB>
using F32Simt = Grouped2x<float, float, float, LA, LB, Simt, Shape2x<128, 128, 8>,
                          Shape2x<32, 64, 8>, Shape2x<1, 1, 1>, 2, 1, 1, MulAdd>;
template <class LA, class LB>
using F32Tf32 = Grouped2x<float, float, float, LA, LB, Tensor, Shape2x<128, 128, 16>,
                          Shape2x<64, 64, 16>, Shape2x<16, 8, 8>, 3, 1, 1, MulAdd>;
template <class LA, class LB>
using F64Tensor = Grouped2x<double, double, double, LA, LB, Tensor, Shape2x<64, 64, 16>,
                            Shape2x<32, 32, 16>, Shape2x<8, 8, 4>, 3, 1, 1, MulAdd>;

std::string f32_simt(int combo, const GemmSet& s, const RunCtx& ctx) {
  return run_combo2x<F32Simt>(combo, s, ctx, "CUTLASS 2.x grouped (fp32, SIMT)");
}

std::string f32_tf32(int combo, const GemmSet& s, const RunCtx& ctx) {
  return run_combo2x<F32Tf32>(combo, s, ctx, "CUTLASS 2.x grouped (fp32, TF32 tensor cores)");
}

std::string f64_tensor(int combo, const GemmSet& s, const RunCtx& ctx) {
  return run_combo2x<F64Tensor>(combo, s, ctx, "CUTLASS 2.x grouped (fp64 tensor cores)");
}

}  // namespace

GMM_KERNEL_LIST(sm80_f32_f64_grouped,
                {Engine::kF32Simt, DType::F32, DType::F32, Sm90Tile::kNone, nullptr, &f32_simt},
                {Engine::kTf32, DType::F32, DType::F32, Sm90Tile::kNone, nullptr, &f32_tf32},
                {Engine::kF64, DType::F64, DType::F64, Sm90Tile::kNone, nullptr, &f64_tensor})

}  // namespace gmm
