#!/usr/bin/env bash
# From a fresh clone to a DiLoCoX pretraining run on CPU, on data that needs no download:
#   1. install the pinned CPU stack into .venv
#   2. build a corpus from this Python's own standard library docs, train a SentencePiece
#      tokenizer on it and write megatron .bin/.idx files
#   3. pretrain a small GPT with DiLoCoX: 2 clusters, each its own torchrun job of 2 ranks
#      (pipeline-parallel), joined by a torchft Lighthouse: 4 processes
#   4. pretrain the same model on the same tokens with vanilla AllReduce
#   5. print both side by side: validation loss and cross-cluster bytes
# Usage: bash examples/quickstart.sh        (ITERS=300 bash examples/quickstart.sh trains longer)
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_env.sh

DATA=${DATA:-data/quickstart}
OUT=${OUT:-runs/quickstart}
ITERS=${ITERS:-120}
mkdir -p "$DATA" "$OUT"

source examples/quickstart_gpt.sh
build_quickstart_data
LOG_ARGS=(--log-interval 20 --eval-interval 40 --eval-iters 6 --seed 1234)

# Each cluster is its own torchrun job (its own rendezvous and world); the two meet only in the
# outer exchange, through a torchft Lighthouse the launcher starts (docs/reliability.md). Both
# jobs' output goes to $OUT/dilocox.log, prefixed "[cluster K]"; cluster 0's progress is shown.
echo "> DiLoCoX: 2 clusters, each its own job of 2 ranks (PP=2), H ramped from 1 to 10 over 1,000 iterations (this short run: rounds of 1 and 2 steps), one-step-delay overlap landing 1 step in, top-k 2-bit exchange"
python -m megatron_dilocox.launch --clusters 2 --nproc-per-cluster 2 -- pretrain_gpt.py "${MODEL_ARGS[@]}" \
  "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" "${LOG_ARGS[@]}" --pipeline-model-parallel-size 2 \
  --dilocox --metrics-file "$OUT/dilocox.jsonl" 2>&1 \
  | tee "$OUT/dilocox.log" | { grep --line-buffered -E '^\[cluster 0\] +(\[|validation|> )|^> ' || true; }

echo "> AllReduce baseline: the same 2 x (PP=2) ranks, gradients reduced across clusters every step"
torchrun --nproc-per-node 4 pretrain_gpt.py "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" \
  "${LOG_ARGS[@]}" "${LAYOUT_ARGS[@]}" --metrics-file "$OUT/allreduce.jsonl" 2> "$OUT/allreduce.stderr"

echo
python tools/compare_runs.py DiLoCoX="$OUT/dilocox.jsonl" AllReduce="$OUT/allreduce.jsonl"
echo
echo "> metrics (JSON lines): $OUT/dilocox.jsonl (cluster 0; cluster 1: $OUT/dilocox.cluster-1.jsonl) $OUT/allreduce.jsonl"
echo "> logs: $OUT/dilocox.log (both clusters) $OUT/allreduce.stderr"
