#!/usr/bin/env bash
# Every test: Rust format/lint/unit+property+doc tests, Python lint and the pytest suite.
# Run after `bash scripts/setup.sh --test`. GPU tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
echo "== cargo fmt --check"; cargo fmt --check
# Cargo.lock is resolved against Debian's packaged crates (scripts/fetch-crates.sh): hold
# cargo to it there; where cargo reaches the Rust package registry itself, it may add the
# platform crates Debian's packages leave out, so the lock is not enforced.
locked=()
[ -f vendor/crates/.complete ] && locked=(--locked)
echo "== cargo clippy"; cargo clippy "${locked[@]}" --all-targets -- -D warnings
cargo clippy "${locked[@]}" --all-targets --features python -- -D warnings
echo "== cargo test"; cargo test "${locked[@]}"
echo "== ruff"; "$PY" -m ruff check python tests benches scripts examples dev
"$PY" -m ruff format --check python tests benches scripts examples dev
echo "== mypy (python/groupmm; settings: pyproject.toml)"; "$PY" -m mypy python/groupmm
echo "== stubtest (python/groupmm/_native.pyi against the built extension)"
"$PY" -m mypy.stubtest --mypy-config-file tests/stubtest/mypy.ini groupmm._native
echo "== clang-format (cuda/, .clang-format)"
find cuda -regex '.*\.\(cu\|cuh\|cc\|h\)' -print0 | xargs -0 clang-format --dry-run --Werror
echo "== pytest"; "$PY" -m pytest -q -p no:cacheprovider tests/python
