#!/usr/bin/env bash
# compute-sanitizer over groupmm's CUDA case list (tests/programs/sanitize_cases.py): memcheck,
# racecheck, synccheck and initcheck, once per kernel path. A product build has one: the
# rule's kernels ("varlen": groupmm's varlen kernels, gathering rows inside the GEMM, and the
# CUTLASS ptr-array kernels for the calls they serve). A development build
# (GROUPMM_DEV_KNOBS=1 at build time: build/main.rs) also forces each other configuration
# through the GROUPMM_SM90_* overrides (cuda/heuristics/choose.h): "varlen-<config>"
# (GROUPMM_SM90_VARLEN_CONFIG: pp128, co128, co192), "gather-first" (rows gathered by the
# row kernel first, GROUPMM_SM90_GATHER=0), "swiglu-pp128", "gather-k-co192",
# "dgated-pp128", and the ptr-array kernels in each sm90 tile configuration for every call
# ("128x256", "128x128", "ping64x128": GROUPMM_SM90_VARLEN=0 / GROUPMM_SM90_CONFIG), every
# form and dtype. PATHS defaults to every path the installed build has.
# Prints one summary line per tool and exits non-zero on any report (or a tool failure).
#
#   bash scripts/sanitize.sh                     # all tools, every path of the build
#   TOOLS="memcheck initcheck" PATHS=varlen bash scripts/sanitize.sh
#
# Every buffer is a fresh allocation (PYTORCH_NO_CUDA_MEMORY_CACHING=1), so initcheck sees
# memory nothing has written. Run it with groupmm importable (e.g. PYTHONPATH=/tmp/site).
#
# initcheck runs with --check-api-memory-access no: the tool does not see bytes written by
# TMA stores, so with host backtraces on it reports every later cudaMemcpy of such an
# output (ours, cuBLAS's and F.grouped_mm's alike: tests/programs/initcheck_tma.py, cuda/NOTES.md).
# Kernel reads are still checked. Whether every output byte is written is checked by the
# "unwritten" tool instead: tests/programs/poison_outputs.py, NaN-poisoned allocator blocks.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sanitize}
mkdir -p "$OUT"
TOOLS=${TOOLS:-memcheck racecheck synccheck initcheck unwritten}
DEV_PATHS="varlen-pp128 varlen-co128 varlen-co192 gather-first swiglu-pp128 gather-k-co192 dgated-pp128 128x256 128x128 ping64x128"
dev=$(python3 -c 'import groupmm; print(int(bool(groupmm.build_info().get("dev_knobs"))))') || exit 2
if [ "$dev" = 1 ]; then PATHS=${PATHS:-varlen $DEV_PATHS}; else PATHS=${PATHS:-varlen}; fi
for path in $PATHS; do
  if [ "$path" != varlen ] && [ "$dev" != 1 ]; then
    echo "sanitize: path $path forces a kernel through GROUPMM_SM90_* overrides, which only a development build (GROUPMM_DEV_KNOBS=1) has" >&2
    exit 2
  fi
done
LIMIT=${SAN_TIMEOUT:-600}
status=0
for tool in $TOOLS; do
  total=0 runs=0 failed=0
  for path in $PATHS; do
    if [ "$path" = varlen ]; then env=(GROUPMM_SM90_VARLEN=auto)
    elif [ "${path#varlen-}" != "$path" ]; then
      env=(GROUPMM_SM90_VARLEN=auto GROUPMM_SM90_VARLEN_CONFIG="${path#varlen-}")
    elif [ "$path" = gather-first ]; then env=(GROUPMM_SM90_VARLEN=auto GROUPMM_SM90_GATHER=0)
    elif [ "$path" = swiglu-pp128 ]; then env=(GROUPMM_SM90_VARLEN=auto GROUPMM_SM90_SWIGLU=pp128)
    elif [ "$path" = gather-k-co192 ]; then env=(GROUPMM_SM90_VARLEN=auto GROUPMM_SM90_GATHER_K=co192)
    elif [ "$path" = dgated-pp128 ]; then env=(GROUPMM_SM90_VARLEN=auto GROUPMM_SM90_DGATED=pp128)
    else env=(GROUPMM_SM90_VARLEN=0 GROUPMM_SM90_CONFIG="$path"); fi
    log="$OUT/$tool-$path.log"
    if [ "$tool" = unwritten ]; then
      env "${env[@]}" timeout "$LIMIT" python3 tests/programs/poison_outputs.py > "$log" 2>&1
      rc=$?
      n=$(grep -Eo '[0-9]+ with unwritten bytes' "$log" | grep -Eo '^[0-9]+')
      done_line="poison outputs:"
    else
      extra=()
      [ "$tool" = initcheck ] && extra=(--check-api-memory-access no)
      env "${env[@]}" SAN_TOOL="$tool" PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$LIMIT" \
        compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 9 --print-limit 20 \
        --show-backtrace yes python3 tests/programs/sanitize_cases.py > "$log" 2>&1
      rc=$?
      n=$(grep -Eo '(ERROR|RACECHECK) SUMMARY: [0-9]+' "$log" | grep -Eo '[0-9]+$' | tail -n 1)
      done_line="sanitize cases:"
    fi
    runs=$((runs + 1))
    total=$((total + ${n:-0}))
    if [ $rc -ne 0 ] || ! grep -q "$done_line" "$log"; then failed=$((failed + 1)); fi
  done
  echo "$tool: $total reports over $runs runs ($PATHS)$([ $failed -gt 0 ] && echo ", $failed runs failed: see $OUT/$tool-*.log")"
  if [ $total -ne 0 ] || [ $failed -ne 0 ]; then status=1; fi
done
exit $status
