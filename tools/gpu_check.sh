#!/usr/bin/env bash
# CUDA-path check on one GPU, a minute: vanilla bf16 pretraining of a 12-layer, hidden-1024 GPT
# on one rank with NCCL; prints loss, tokens/s and peak memory (mock data: needs no dataset).
# DiLoCoX needs two ranks, and two ranks cannot share one GPU here: NCCL refuses duplicate
# devices, and gloo has no coalesced all-reduce for CUDA tensors (which megatron DDP uses).
# Usage: bash tools/gpu_check.sh [python]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('>', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
MODEL=(--num-layers 12 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024
       --micro-batch-size 8 --global-batch-size 16 --train-iters 60 --lr 3e-4 --lr-warmup-iters 10 --bf16
       --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --log-interval 20 --eval-interval 60 --eval-iters 2)
echo "> vanilla, 1 rank, NCCL, bf16"
"$PY" -m torch.distributed.run --nproc-per-node 1 pretrain_gpt.py "${MODEL[@]}" --metrics-file "$OUT/vanilla.jsonl"
"$PY" tools/compare_runs.py vanilla="$OUT/vanilla.jsonl"
