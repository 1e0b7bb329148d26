#!/usr/bin/env bash
# On a GPU machine with torch: install a prebuilt groupmm wheel, run the whole test suite
# (CUDA tests included), compute-sanitizer (memcheck, racecheck, synccheck, initcheck over
# every kernel path: scripts/sanitize.sh) and the benchmark; print a summary table last.
# Every step runs even when an earlier one fails; the exit status is 0 only when every step
# that ran exited 0 (1 otherwise; 2 when the wheel does not install).
#   bash scripts/gpu-check.sh [WHEEL_DIR] [--no-bench] [--quick-bench]
set -uo pipefail
cd "$(dirname "$0")/.."
whl_dir=${1:-wheelhouse}
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$whl_dir"/*.whl || exit 2
export PYTHONPATH=/tmp/site
declare -A res
failed=()
STEPS=${STEPS:-info demo pytest sanitize bench}
step() {  # name, command...  (only the names listed in $STEPS run)
  local name=$1; shift
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$(date +%s)
  echo "=== $name: $*"
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  [ "$rc" -eq 0 ] || failed+=("$name")
  tail -n 25 "$OUT/$name.log"
  res[$name]="rc=$rc $(( $(date +%s) - t0 ))s $(grep -E -o '[0-9]+ passed[^=]*|demo: [a-z ]+' "$OUT/$name.log" | tail -n 1)"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step info python3 -c "import groupmm, torch; print(groupmm.build_info(), torch.__version__, torch.cuda.get_device_name())"
step demo python3 -m groupmm.demo
step pytest python3 -m pytest -q -p no:cacheprovider ${PYTEST_TARGETS:-tests/python}
step sanitize env OUT="$OUT/sanitize" bash scripts/sanitize.sh
case " $* " in
  *" --no-bench "*) ;;
  *" --quick-bench "*) step bench python3 benches/bench_gpu.py --quick --json "$OUT/bench.json" --png "$OUT/bench.png" ;;
  *) step bench python3 benches/bench_gpu.py --json "$OUT/bench.json" --png "$OUT/bench.png" ;;
esac
echo
echo "== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"
for k in info demo pytest sanitize bench; do
  [ -n "${res[$k]:-}" ] && printf '%-10s %s\n' "$k" "${res[$k]}"
done
[ -f "$OUT/sanitize.log" ] && grep -E "^(memcheck|racecheck|synccheck|initcheck|unwritten):" "$OUT/sanitize.log"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
exit 0
