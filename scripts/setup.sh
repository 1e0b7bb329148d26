#!/usr/bin/env bash
# One-command set-up on a fresh machine: Rust crates, Python build/test needs, then
# build and install groupmm (with the CUDA kernels when nvcc is found).
#   bash scripts/setup.sh          # install groupmm and what the demo needs
#   bash scripts/setup.sh --test   # ... plus what the tests need
# Env: PYTHON (default python3), GROUPMM_CUDA=0|1, GROUPMM_CUDA_ARCHS (default 80;90a),
#      GROUPMM_TORCH (pip spec used only when torch is missing; default torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
command -v cargo >/dev/null || { echo "setup: cargo (a Rust toolchain >= 1.80) is required" >&2; exit 1; }
bash scripts/fetch-crates.sh
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "${GROUPMM_TORCH:-torch==2.13.0}"
fi
"$PY" -m pip install -q "maturin>=1.7,<2" "nvidia-cutlass==4.2.0.0" "numpy>=1.21"
if [ "${1:-}" = "--test" ]; then
  "$PY" -m pip install -q "pytest>=7" "hypothesis>=6" "ruff>=0.5" "mypy>=1.10" matplotlib \
    "clang-format==23.1.5"
  "$PY" -m pip install -q "transformers>=5.0,<6"
fi
echo "setup: building groupmm (release; CUDA kernels too when nvcc is found — minutes)"
"$PY" -m pip install -q --no-build-isolation --force-reinstall --no-deps .
"$PY" -c "import groupmm; print('setup: installed', groupmm.build_info())"
