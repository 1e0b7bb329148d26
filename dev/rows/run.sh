#!/usr/bin/env bash
# Builds rows_dev (rows_dev.cu) with one build of the row kernels per variant and runs it.
# Not part of the library: a tuning program for cuda/device/rows.cu.
#
#   dev/rows/run.sh [OLD_ROWS_CU] [--quick]
#     OLD_ROWS_CU: an earlier rows.cu to compare with (e.g. `git show REV:cuda/device/rows.cu
#     > old.cu`), run as the first variant, the reference of the check; "-" for none.
#   VARIANTS="L4=-DGMM_ROWS_LOADS=4 L8=-DGMM_ROWS_LOADS=8" (default): builds of today's rows.cu,
#   NAME=FLAG[,FLAG...] each (the GMM_ROWS_* knobs of the gathering kernels, rows_routed.cuh).
#   NVCC_ARCH (default -gencode=arch=compute_90a,code=sm_90a), OUTDIR (default devbin/rows_dev)
set -euo pipefail
cd "$(dirname "$0")/../.."
OLD=${1:--}
shift || true
OUTDIR=${OUTDIR:-devbin/rows_dev}
ARCH=${NVCC_ARCH:--gencode=arch=compute_90a,code=sm_90a}
mkdir -p "$OUTDIR"
FLAGS=(-std=c++17 -O3 "$ARCH" -Icuda -lineinfo)
decls="" list="" names="" objs=()
build() {  # name, rows.cu, extra flags...
  local name=$1 src=$2
  shift 2
  nvcc "${FLAGS[@]}" -Dgmm="gmm_$name" -DROWS_ENTRY="rows_$name" "$@" -c "$src" \
    -o "$OUTDIR/rows_$name.o" -Xptxas -v 2>"$OUTDIR/ptxas_$name.txt" &
  nvcc "${FLAGS[@]}" -Dgmm="gmm_$name" -DROWS_ENTRY="rows_$name" "$@" -c \
    dev/rows/wrap.cu -o "$OUTDIR/wrap_$name.o" &
  objs+=("$OUTDIR/rows_$name.o" "$OUTDIR/wrap_$name.o")
  decls+="DECL(rows_$name) "
  list+="rows_$name,"
  names+="\"$name\","
}
if [[ "$OLD" != "-" ]]; then build old "$OLD"; fi
for v in ${VARIANTS:-L4=-DGMM_ROWS_LOADS=4 L8=-DGMM_ROWS_LOADS=8}; do
  IFS=, read -r -a vflags <<<"${v#*=}"
  build "${v%%=*}" cuda/device/rows.cu "${vflags[@]}"
done
wait
printf '#define VARIANT_DECLS %s\n#define VARIANT_LIST %s\n#define VARIANT_NAMES %s\n' \
  "$decls" "$list" "$names" >"$OUTDIR/variants.h"
nvcc "${FLAGS[@]}" -include "$OUTDIR/variants.h" dev/rows/rows_dev.cu "${objs[@]}" \
  -o "$OUTDIR/rows_dev"
"$OUTDIR/rows_dev" "$@"
