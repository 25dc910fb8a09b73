#!/usr/bin/env bash
# Pseudo-gradient compression at equal tokens: 2 clusters x PP2, delay mode, H=20, 200 iterations
# on the quickstart model (hidden 256) and data. Each VARIANT is "name|flags"; prints a table of
# validation loss, cross-cluster bytes and the per-round figures (ratio, rel. error, codec time).
# Usage: bash examples/benchmark/compression.sh   (after examples/quickstart.sh built the data)
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/setup_env.sh
DATA=${DATA:-data/quickstart}
OUT=${OUT:-runs/compression}
ITERS=${ITERS:-200}
SEEDS=${SEEDS:-1234}
mkdir -p "$OUT"
source examples/quickstart_gpt.sh
COMMON=("${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" "${LAYOUT_ARGS[@]}"
        --log-interval 50 --eval-interval "$ITERS" --eval-iters 16 --dilocox --dilocox-local-steps 20)
if [ -z "${VARIANTS:-}" ]; then
  VARIANTS=(
    "none|--dilocox-compression none"
    "q8|--dilocox-compression quantize --dilocox-quant-bits 8"
    "q4|--dilocox-compression quantize --dilocox-quant-bits 4"
    "lr8|--dilocox-compression lowrank --dilocox-rank 8"
    "lr8q4|--dilocox-compression lowrank-quantize --dilocox-rank 8 --dilocox-quant-bits 4"
    "lr8q4-ef|--dilocox-compression lowrank-quantize --dilocox-rank 8 --dilocox-quant-bits 4 --dilocox-error-feedback"
    "lr8q4-adapt|--dilocox-compression lowrank-quantize --dilocox-rank 8 --dilocox-quant-bits 4 --dilocox-adaptive"
  )
else
  IFS=';' read -r -a VARIANTS <<< "$VARIANTS"
fi
TABLE=()
for variant in "${VARIANTS[@]}"; do
  name=${variant%%|*}; flags=${variant#*|}
  for seed in $SEEDS; do
    if [ ! -s "$OUT/$name-$seed.jsonl" ] || ! grep -q val_loss "$OUT/$name-$seed.jsonl"; then
      echo "> $name, seed $seed: $flags"
      rm -f "$OUT/$name-$seed.jsonl"
      # shellcheck disable=SC2086
      torchrun --nproc-per-node 4 pretrain_gpt.py "${COMMON[@]}" $flags --seed "$seed" \
        --metrics-file "$OUT/$name-$seed.jsonl" > "$OUT/$name-$seed.log" 2>&1
    fi
    TABLE+=("$name=$OUT/$name-$seed.jsonl")
  done
done
python tools/compare_runs.py "${TABLE[@]}"
echo
echo "per-round means (rounds that applied a compressed average):"
for entry in "${TABLE[@]}"; do
  python - "${entry%%=*}" "${entry#*=}" <<'PY'
import json, sys
name, path = sys.argv[1:]
rounds = [json.loads(l) for l in open(path) if '"codec_fraction"' in l]
if not rounds:
    print(f"{name:<14} uncompressed"); sys.exit()
mean = lambda k: sum(r[k] for r in rounds) / len(rounds)
print(f"{name:<14} bytes/round {mean('bytes_sent'):>10.0f}  dense {mean('dense_bytes'):>10.0f}  ratio {mean('compression_ratio'):6.1f}x"
      f"  rel.err {mean('rel_error'):.3f}  mean rank {mean('mean_rank'):.2f}  codec {mean('codec_s'):.3f}s"
      f" = {100 * mean('codec_fraction'):.1f}% of a round's compute")
PY
done
