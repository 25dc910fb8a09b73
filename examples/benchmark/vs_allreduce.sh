#!/usr/bin/env bash
# DiLoCoX vs vanilla AllReduce vs compute-only over emulated slow links: 2 clusters x 2 ranks
# (pipeline-parallel) on 4 CPU processes, the quickstart model (4.2M parameters) and data, every
# cluster's uplink and downlink shaped to RATE (needs root: network namespaces and tc).
# Usage (from a clean clone):  bash examples/benchmark/vs_allreduce.sh     (RATE=100mbit bash ... for 100 Mbit)
# Writes runs/bench_vs_allreduce/$RATE/{results.json,loss_vs_time.png,loss_vs_bytes.png} and prints the table,
# then the defaults' throughput after the H ramp (AFTER_RAMP iterations at H, default ITERS; 0: not measured).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "$(id -u)" != 0 ]; then
  echo "vs_allreduce.sh: error: needs root (network namespaces and tc shape the links); run it with sudo" >&2
  exit 1
fi
source tools/setup_env.sh
DATA=${DATA:-data/quickstart}
RATE=${RATE:-10mbit}
ITERS=${ITERS:-300}
H=${H:-10}
# The product's defaults unless given: H ramped from 1 over the first 1,000 iterations (the
# projected uncompressed rows run without it), outer SGD lr 2.4 (at 2 clusters) without momentum
# warmed up from 1 over 600 iterations, `delay` with the average landing one step into the next
# round, topk (density 1/32, 2-bit values, error feedback) with the residual flushed at the end
# (docs/convergence.md). OUTER takes more harness flags, e.g. OUTER="--min-local-steps 2" for
# the H ramp from rounds of 2 steps; OVERLAP=eager CODEC="--dilocox-compression quantize
# --dilocox-quant-bits 4 --dilocox-error-feedback" for the setting of the 2026-11-30 runs.
OUTER=${OUTER:-}
OVERLAP=${OVERLAP:-delay}
CODEC=${CODEC:-}
OUT=${OUT:-runs/bench_vs_allreduce/$RATE}
AFTER_RAMP=${AFTER_RAMP:-$ITERS}
if [ "$AFTER_RAMP" != 0 ]; then OUTER="$OUTER --after-ramp-iters $AFTER_RAMP"; fi
# Methods whose full run over the link would take too long: loss from a full unshaped run,
# tokens/s from this many iterations over the shaped link (the table marks them "projected").
case "$RATE" in
  10mbit) SHAPED=${SHAPED:-"allreduce=6 dilocox-sync=30 dilocox-overlap=30"} ;;
  *) SHAPED=${SHAPED:-"allreduce=20"} ;;
esac

source examples/quickstart_gpt.sh
build_quickstart_data
SHAPED_ARGS=()
for item in $SHAPED; do SHAPED_ARGS+=(--shaped-iters "$item"); done
# shellcheck disable=SC2086
python tools/bench_vs_allreduce.py --rate "$RATE" --clusters 2 --ranks-per-cluster 2 --local-steps "$H" --overlap-mode "$OVERLAP" $OUTER \
  --compression-args="$CODEC" "${SHAPED_ARGS[@]}" --eval-interval 50 --eval-iters 8 --out "$OUT" \
  -- "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" --pipeline-model-parallel-size 2
