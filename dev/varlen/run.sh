#!/usr/bin/env bash
# Builds and runs the varlen tuning program on a GPU machine (16 cores: the variants
# compile in parallel). Needs CUTLASS headers: CUTLASS_INC (default .devcarry/cutlass/include).
#   bash dev/varlen/run.sh [OUT_DIR] [reps] [rounds] [case filter]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUTD=${1:-/tmp/varlen_dev}; mkdir -p "$OUTD" /tmp/vdev
INC=${CUTLASS_INC:-.devcarry/cutlass/include}
FLAGS=(-O3 -std=c++17 --expt-relaxed-constexpr -DNDEBUG -Xcudafe=--diag_suppress=177
       -I"$INC" -Icuda -gencode=arch=compute_90a,code=sm_90a ${VDEV_FLAGS:-})
T0=$SECONDS
for i in 0 1 2 3 4 5 6 7 8 9; do
  nvcc "${FLAGS[@]}" -Xptxas -v -DVARIANT=$i -c dev/varlen/variant.cu -o /tmp/vdev/v$i.o \
    >> "$OUTD/ptxas.txt" 2>&1 &
done
nvcc "${FLAGS[@]}" -c dev/varlen/main.cu -o /tmp/vdev/main.o 2> "$OUTD/main_build.txt" &
wait
echo "built in $((SECONDS - T0)) s"
grep -h -E "error|Used [0-9]+ registers|spill|C75" "$OUTD"/ptxas.txt | grep -v "0 bytes spill" | sort | uniq -c | head -40
nvcc -o /tmp/vdev/vdev /tmp/vdev/*.o -lcuda || { cat "$OUTD"/*.txt | grep -i error | head -30; exit 1; }
/tmp/vdev/vdev "$OUTD/varlen_dev.jsonl" "${2:-10}" "${3:-5}" "${4:-}"
