#!/usr/bin/env bash
# Does the one-step-delay overlap hide communication? Trains DiLoCoX (2 clusters x PP=2, H=10)
# with the outer reduction free and with DELAY seconds added to every reduction, in delay mode
# and in blocking sync mode, and prints tokens/s side by side.
# Usage: bash examples/benchmark/overlap.sh   (after examples/quickstart.sh built the data)
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/setup_env.sh
DATA=${DATA:-data/quickstart}
OUT=${OUT:-runs/overlap}
ITERS=${ITERS:-100}
DELAY=${DELAY:-2.0}
mkdir -p "$OUT"
source examples/quickstart_gpt.sh
COMMON=("${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" "${LAYOUT_ARGS[@]}"
        --log-interval "$ITERS" --eval-interval "$ITERS" --eval-iters 2 --dilocox --dilocox-local-steps 10)
TABLE=()
for run in "delay 0" "delay $DELAY" "sync 0" "sync $DELAY"; do
  set -- $run
  name="$1-slow$2"
  echo "> sync mode $1, reduction slowed by $2 s"
  rm -f "$OUT/$name.jsonl"
  torchrun --nproc-per-node 4 pretrain_gpt.py "${COMMON[@]}" --dilocox-sync-mode "$1" \
    --dilocox-emulated-delay-s "$2" --metrics-file "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1
  TABLE+=("$name=$OUT/$name.jsonl")
done
python tools/compare_runs.py "${TABLE[@]}"
for name in delay-slow0 "delay-slow$DELAY" sync-slow0 "sync-slow$DELAY"; do
  python -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if 'outer_step' in l]; \
print(f'{sys.argv[2]:<14} rounds {len(r)}: comm_s {sum(x[\"comm_s\"] for x in r):6.1f}  wait_s {sum(x[\"wait_s\"] for x in r):6.1f}')" \
    "$OUT/$name.jsonl" "$name"
done
