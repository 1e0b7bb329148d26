#!/usr/bin/env bash
# One device call that checks and times every sm90 tile configuration of a wheel:
#   bash dev/tune_sm90.sh [configs] [shapes]
# The wheel must be a development build (GROUPMM_DEV_KNOBS=1, docs/cuda.md): a product
# build ignores GROUPMM_SM90_CONFIG and every configuration would time the rule's choice.
# Installs wheelhouse/*.whl into /tmp/site, runs the CUDA tests once per forced
# configuration (GROUPMM_SM90_CONFIG), then benches/bench_gpu.py per configuration
# (CALLS back-to-back calls per sample, default 20).
# Writes $OUT/tune.tgz (all logs and JSON) and $OUT/summary.txt.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
CFGS=${1:-"128x256 128x128 ping64x128 auto"}
SHAPES=${2:-mixtral-up,mixtral-down,dsv3-up,dsv3-down,qwen3-up,qwen3-down,small64}
R=/tmp/tune; mkdir -p "$R" "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site wheelhouse/*.whl || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$R/gpu.txt"
for c in $CFGS; do
  if [ "$c" != auto ] || [ "${TESTS_AUTO:-1}" = 1 ]; then
    GROUPMM_SM90_CONFIG=$c timeout 200 python3 -m pytest -q -p no:cacheprovider tests/python/test_cuda.py > "$R/tests_$c.txt" 2>&1
    echo "tests $c: $(tail -1 "$R/tests_$c.txt")" >> "$R/summary.txt"
  fi
done
for c in $CFGS; do
  GROUPMM_SM90_CONFIG=$c python3 benches/bench_gpu.py --calls ${CALLS:-20} --shapes "$SHAPES" \
    --json "$R/bench_$c.json" > "$R/bench_$c.txt" 2>&1
  echo "== $c" >> "$R/summary.txt"; grep -E "min ratio|geomean" "$R/bench_$c.txt" >> "$R/summary.txt"
done
if [ -n "${FP16:-}" ]; then
  python3 benches/bench_gpu.py --dtype fp16 --calls ${CALLS:-20} --shapes "$SHAPES" \
    --json "$R/bench_fp16.json" > "$R/bench_fp16.txt" 2>&1
  echo "== fp16 auto" >> "$R/summary.txt"; grep -E "min ratio|geomean" "$R/bench_fp16.txt" >> "$R/summary.txt"
fi
cp "$R/summary.txt" "$OUT/"
tar czf "$OUT/tune.tgz" -C "$R" .
cat "$R/summary.txt"
