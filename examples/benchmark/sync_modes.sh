#!/usr/bin/env bash
# Convergence of the DiLoCoX sync modes against AllReduce at equal tokens, two seeds each:
# 2 clusters x (PP=2) on 4 CPU processes, H=20, on the quickstart's stdlib dataset.
# Usage: bash examples/benchmark/sync_modes.sh   (after examples/quickstart.sh built the data)
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/setup_env.sh
DATA=${DATA:-data/quickstart}
OUT=${OUT:-runs/sync_modes}
ITERS=${ITERS:-200}
H=${H:-20}
SEEDS=${SEEDS:-"1234 4321"}
mkdir -p "$OUT"
source examples/quickstart_gpt.sh
COMMON=("${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" "${LAYOUT_ARGS[@]}"
        --log-interval 50 --eval-interval "$ITERS" --eval-iters 16)
declare -A MODE_ARGS=(
  [allreduce]=""
  [sync]="--dilocox --dilocox-local-steps $H --dilocox-sync-mode sync"
  [delay]="--dilocox --dilocox-local-steps $H --dilocox-sync-mode delay"
  [eager]="--dilocox --dilocox-local-steps $H --dilocox-sync-mode eager"
)
TABLE=()
for mode in sync delay eager allreduce; do
  for seed in $SEEDS; do
    echo "> $mode, seed $seed"
    rm -f "$OUT/$mode-$seed.jsonl"
    # shellcheck disable=SC2086
    torchrun --nproc-per-node 4 pretrain_gpt.py "${COMMON[@]}" ${MODE_ARGS[$mode]} --seed "$seed" \
      --metrics-file "$OUT/$mode-$seed.jsonl" > "$OUT/$mode-$seed.log" 2>&1
    TABLE+=("$mode=$OUT/$mode-$seed.jsonl")
  done
done
python tools/compare_runs.py "${TABLE[@]}"
