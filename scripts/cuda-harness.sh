#!/usr/bin/env bash
# Builds the stand-alone CUDA test harness (tests/cuda_harness/harness.cu) into devbin/
# THROUGH the last cargo build: the build script (build/link.rs) records its nvcc command
# line and the archive it made (kernels + host code) in <target>/groupmm-cuda-build.env,
# and this script compiles the harness with those flags and links that archive and the
# static CUDA runtime. No Rust or Python at run time; run devbin/harness on a GPU machine.
#
#   cargo build --release            any cargo build with CUDA (archs: GROUPMM_CUDA_ARCHS)
#   scripts/cuda-harness.sh          then this
#   CARGO_TARGET_DIR=...             where that build was (default: target)
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_FILE="${CARGO_TARGET_DIR:-target}/groupmm-cuda-build.env"
if [[ ! -f "$ENV_FILE" ]]; then
  echo "$ENV_FILE not found: run a cargo build with CUDA first (e.g. cargo build --release)" >&2
  exit 1
fi
# shellcheck source=/dev/null
source "$ENV_FILE"
mkdir -p devbin
T0=$SECONDS
"$GROUPMM_NVCC" "${GROUPMM_NVCC_FLAGS[@]}" -c tests/cuda_harness/harness.cu -o devbin/harness.o
"$GROUPMM_NVCC" -o devbin/harness devbin/harness.o "$GROUPMM_CUDA_ARCHIVE" \
  -L"$GROUPMM_CUDA_LIB_DIR" -cudart static -ldl -lrt -lpthread
echo "built devbin/harness (archive $GROUPMM_CUDA_ARCHIVE) in $((SECONDS - T0)) s"
