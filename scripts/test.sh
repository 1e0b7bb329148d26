#!/usr/bin/env bash
# Every test: Rust format/lint/unit+property+doc tests, Python lint and the pytest suite.
# Run after `bash scripts/setup.sh --test`. GPU tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
echo "== cargo fmt --check"; cargo fmt --check
echo "== cargo clippy"; cargo clippy --all-targets -- -D warnings
cargo clippy --all-targets --features python -- -D warnings
echo "== cargo test"; cargo test
echo "== ruff"; "$PY" -m ruff check python tests benches scripts examples
"$PY" -m ruff format --check python tests benches scripts examples
echo "== stubtest (python/groupmm/_native.pyi against the built extension)"
if "$PY" -c "import mypy.stubtest" 2>/dev/null; then
  "$PY" -m mypy.stubtest --mypy-config-file tests/stubtest/mypy.ini groupmm._native
else
  echo "skipped: mypy is not installed (pip install mypy)"
fi
echo "== pytest"; "$PY" -m pytest -q -p no:cacheprovider tests/python
