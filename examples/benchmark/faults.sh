#!/usr/bin/env bash
# Fault soak: 3 DiLoCoX clusters as independent jobs (the defaults: delay, topk), a random live
# cluster killed every KILL_EVERY rounds and restarted by torchrun, against the same run without
# faults and as one torch.distributed world (tools/fault_soak.py; figures in docs/reliability.md).
# Usage (from a clean clone):  bash examples/benchmark/faults.sh
# Writes runs/faults/{world,jobs,faults}/ and runs/faults/results.json, and prints the table.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/setup_env.sh
DATA=${DATA:-data/quickstart}
ITERS=${ITERS:-300}            # 60 rounds of H=5
KILL_EVERY=${KILL_EVERY:-10}   # rounds between kills
DELAY=${DELAY:-1}              # seconds every exchange takes (an emulated slow link)
source examples/quickstart_gpt.sh
build_quickstart_data
python tools/fault_soak.py --out "${OUT:-runs/faults}" --clusters 3 --kill-every "$KILL_EVERY" -- \
  --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
  --hidden-dropout 0 --attention-dropout 0 --micro-batch-size 4 --global-batch-size 12 --train-iters "$ITERS" \
  --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0 \
  "${DATA_ARGS[@]}" --log-interval 5 --eval-interval 100 --eval-iters 8 \
  --dilocox --dilocox-local-steps 5 --dilocox-emulated-delay-s "$DELAY" --dilocox-failure-timeout-s 60 "$@"
