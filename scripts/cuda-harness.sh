#!/usr/bin/env bash
# Builds the stand-alone CUDA test harness (tests/cuda_harness/harness.cu) into devbin/,
# linked with the groupmm kernels (cuda/*.cu, the same flags as build.rs) and the static
# CUDA runtime. No Rust or Python needed; run devbin/harness on a GPU machine.
#
#   scripts/cuda-harness.sh            build (objects are reused while sources are unchanged)
#   GROUPMM_CUDA_ARCHS="90a" ...       archs (default 80;90a, as build.rs)
#   CUTLASS_DIR=...                    CUTLASS checkout (default: the nvidia-cutlass pip package)
#   GROUPMM_NVCC_FLAGS="-Xptxas -v"    extra nvcc flags
#   GROUPMM_KERNELS_A=<path>/libgroupmm_cuda_kernels.a
#                                      link the kernels archive a cargo build made (OUT_DIR of
#                                      the groupmm build script) instead of compiling them here
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")}
ARCHS=${GROUPMM_CUDA_ARCHS:-80;90a}
if [[ -n "${CUTLASS_DIR:-}" ]]; then
  CUTLASS_INC="$CUTLASS_DIR/include"
else
  CUTLASS_INC="$(python3 -c 'import os, cutlass_library; print(os.path.dirname(cutlass_library.__file__))')/source/include"
fi
[[ -f "$CUTLASS_INC/cutlass/version.h" ]] || { echo "CUTLASS headers not found at $CUTLASS_INC" >&2; exit 1; }
grep -qx '/devbin/' .git/info/exclude 2>/dev/null || echo '/devbin/' >> .git/info/exclude
mkdir -p devbin/obj

COMMON=(-O3 -std=c++17 --expt-relaxed-constexpr -DNDEBUG -Xcompiler=-fPIC "-Xcudafe=--diag_suppress=177" "-I$CUTLASS_INC" -Icuda)
ALL_GENCODE=()
LOWEST=""
HAS90A=0
IFS=';, ' read -r -a ARCH_LIST <<< "$ARCHS"
for a in "${ARCH_LIST[@]}"; do
  [[ -z "$a" ]] && continue
  ALL_GENCODE+=("-gencode=arch=compute_$a,code=sm_$a")
  [[ "$a" == "90a" ]] && HAS90A=1
  [[ -z "$LOWEST" && "$a" != *a ]] && LOWEST=$a
done
[[ -n "$LOWEST" ]] && ALL_GENCODE+=("-gencode=arch=compute_$LOWEST,code=compute_$LOWEST")
[[ $HAS90A == 1 ]] && COMMON+=(-DGROUPMM_SM90_TMA=1)
# shellcheck disable=SC2206
EXTRA=(${GROUPMM_NVCC_FLAGS:-})
STAMP="$(echo "$ARCHS ${EXTRA[*]} $CUTLASS_INC" | md5sum | cut -c1-8)"

SOURCES=(cuda/dispatch.cu cuda/sm80_bf16_grouped.cu cuda/sm80_f16_grouped.cu cuda/sm80_f32_f64_grouped.cu)
[[ $HAS90A == 1 ]] && SOURCES=(cuda/sm90_*.cu "${SOURCES[@]}")  # every sm90 config family
HEADERS=(cuda/*.h cuda/*.cuh)

build_one() {
  local src=$1 obj gencode
  obj="devbin/obj/$(basename "${src%.cu}")-$STAMP.o"
  if [[ -f "$obj" ]]; then
    local newer=0
    for f in "$src" "${HEADERS[@]}"; do [[ "$f" -nt "$obj" ]] && newer=1; done
    [[ $newer == 0 ]] && { echo "up to date: $obj"; return 0; }
  fi
  if [[ "$src" == cuda/sm90_* ]]; then gencode=(-gencode=arch=compute_90a,code=sm_90a); else gencode=("${ALL_GENCODE[@]}"); fi
  local t0=$SECONDS
  "$NVCC" "${COMMON[@]}" "${gencode[@]}" "${EXTRA[@]}" -c "$src" -o "$obj.tmp" > "devbin/obj/$(basename "$src").log" 2>&1 \
    || { cat "devbin/obj/$(basename "$src").log" >&2; echo "FAILED: $src" >&2; return 1; }
  if grep -qE 'C7504|C7509' "devbin/obj/$(basename "$src").log"; then
    cat "devbin/obj/$(basename "$src").log" >&2; echo "FAILED: $src: setmaxnreg/wgmma serialisation warning" >&2; return 1
  fi
  mv "$obj.tmp" "$obj"
  echo "compiled $src in $((SECONDS - t0)) s"
}
export -f build_one
export NVCC STAMP
export COMMON_STR="${COMMON[*]}"
T0=$SECONDS
if [[ -n "${GROUPMM_KERNELS_A:-}" ]]; then
  "$NVCC" "${COMMON[@]}" "${ALL_GENCODE[@]}" -c tests/cuda_harness/harness.cu -o devbin/obj/harness.o
  "$NVCC" -o devbin/harness devbin/obj/harness.o "$GROUPMM_KERNELS_A" -cudart static -ldl -lrt -lpthread
  echo "built devbin/harness (kernels from $GROUPMM_KERNELS_A) in $((SECONDS - T0)) s"
  exit 0
fi
PIDS=()
JOBS=${NUM_JOBS:-2}
# simple job pool
running=0
for s in "${SOURCES[@]}"; do
  build_one "$s" &
  PIDS+=($!)
  running=$((running + 1))
  if (( running >= JOBS )); then wait -n; running=$((running - 1)); fi
done
fail=0
for p in "${PIDS[@]}"; do wait "$p" || fail=1; done
[[ $fail == 0 ]] || { echo "kernel build failed" >&2; exit 1; }
OBJS=()
for s in "${SOURCES[@]}"; do OBJS+=("devbin/obj/$(basename "${s%.cu}")-$STAMP.o"); done
"$NVCC" "${COMMON[@]}" "${ALL_GENCODE[@]}" -c tests/cuda_harness/harness.cu -o devbin/obj/harness.o
"$NVCC" -o devbin/harness devbin/obj/harness.o "${OBJS[@]}" -cudart static -ldl -lrt -lpthread
echo "built devbin/harness in $((SECONDS - T0)) s"
