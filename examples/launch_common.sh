# Shared launch logic of the multi-node examples (source it, then call `launch "$@"`).
#
# The sourcing script defines PRETRAIN_ARGS (every pretrain_gpt.py flag, built from Megatron-style
# arrays), NAME (a title), and NNODES, GPUS_PER_NODE, CLUSTERS, DATA_PATH, TOKENIZER_MODEL,
# VOCAB_SIZE. launch then
#   - checks the layout (NNODES splits into CLUSTERS, NODE_RANK in range) and the environment
#     (torchrun, GPUs on this node, data and tokenizer files, flags known to pretrain_gpt.py);
#   - runs the planner (tools/plan.py) on exactly PRETRAIN_ARGS and stops if it does not fit;
#   - with --dry-run prints the torchrun command of every node, one line each, and exits;
#     otherwise runs this node's command.
# One torchrun world spans all nodes of all clusters. The static rendezvous gives node r the
# ranks [r*GPUS_PER_NODE, (r+1)*GPUS_PER_NODE), so cluster k is the contiguous block of nodes
# [k*NNODES/CLUSTERS, (k+1)*NNODES/CLUSTERS), as DiLoCoX requires (c10d would order nodes by arrival).

MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NODE_RANK=${NODE_RANK:-0}
RDZV_ID=${RDZV_ID:-$NAME}
PYTHON=${PYTHON:-python}
# What the planner assumes of the machine (tools/plan.py --help): GPU memory and achievable dense
# bf16 TFLOP/s, per-GPU bandwidth inside a cluster (data-parallel, pipeline) and of NVLink (tensor
# parallel), and the link between clusters.
GPU_MEMORY_GIB=${GPU_MEMORY_GIB:-80}
GPU_TFLOPS=${GPU_TFLOPS:-400}
INTRA_BANDWIDTH_GBPS=${INTRA_BANDWIDTH_GBPS:-400}
TP_BANDWIDTH_GBPS=${TP_BANDWIDTH_GBPS:-3600}
INTER_BANDWIDTH_GBPS=${INTER_BANDWIDTH_GBPS:-1}

_fail() { echo "$NAME: error: $*" >&2; exit 2; }
_note() { echo "$NAME: note: $*" >&2; }

# A problem that stops a real launch but only notes a dry run (which may run anywhere).
_env_problem() { if [ "$DRY_RUN" = 1 ]; then _note "$* (a real launch would stop here)"; else _fail "$*"; fi; }

_node_command() {  # NODE_CMD: the torchrun command of node $1
  NODE_CMD=(torchrun --nnodes "$NNODES" --node-rank "$1" --nproc-per-node "$GPUS_PER_NODE"
            --rdzv-backend static --rdzv-id "$RDZV_ID" --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
            pretrain_gpt.py "${PRETRAIN_ARGS[@]}")
}

_print_command() {  # NODE_CMD on one line, shell-quoted
  local quoted
  quoted=$(printf '%q ' "${NODE_CMD[@]}")
  echo "${quoted% }"
}

_check_layout() {
  [ "$NNODES" -ge 1 ] && [ "$GPUS_PER_NODE" -ge 1 ] && [ "$CLUSTERS" -ge 1 ] \
    || _fail "NNODES, GPUS_PER_NODE and CLUSTERS must be >= 1 (got $NNODES, $GPUS_PER_NODE, $CLUSTERS)"
  [ $((NNODES % CLUSTERS)) -eq 0 ] || _fail "NNODES=$NNODES does not split into CLUSTERS=$CLUSTERS equal clusters"
  [ "$NODE_RANK" -ge 0 ] && [ "$NODE_RANK" -lt "$NNODES" ] || _fail "NODE_RANK=$NODE_RANK not in [0, NNODES=$NNODES)"
}

_check_environment() {
  command -v torchrun >/dev/null || _env_problem "torchrun not found (source tools/setup_env.sh or install torch)"
  if [ "$DRY_RUN" = 0 ]; then
    local gpus
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [ "$gpus" -ge "$GPUS_PER_NODE" ] || _fail "GPUS_PER_NODE=$GPUS_PER_NODE but nvidia-smi lists $gpus GPUs on this node"
  fi
  for f in "$DATA_PATH.bin" "$DATA_PATH.idx"; do
    [ -f "$f" ] || _env_problem "DATA_PATH: $f not found (make it with tools/preprocess_data.py)"
  done
  if [ -f "$TOKENIZER_MODEL" ]; then
    VOCAB_SIZE=$("$PYTHON" -c 'import sys, sentencepiece as s; print(s.SentencePieceProcessor(model_file=sys.argv[1]).vocab_size())' "$TOKENIZER_MODEL")
  else
    _env_problem "TOKENIZER_MODEL: $TOKENIZER_MODEL not found; planning with VOCAB_SIZE=$VOCAB_SIZE"
  fi
  local known unknown=()
  known=" $("$PYTHON" pretrain_gpt.py --help | grep -oE -- '--[a-z0-9][a-z0-9-]*' | sort -u | tr '\n' ' ') "
  for arg in "${PRETRAIN_ARGS[@]}"; do
    case "$arg" in --*) [[ "$known" == *" $arg "* ]] || unknown+=("$arg") ;; esac
  done
  [ ${#unknown[@]} -eq 0 ] || _env_problem "pretrain_gpt.py does not know ${unknown[*]}"
}

_plan() {  # the planner on exactly the launch flags; exits non-zero when it does not fit
  echo "> planner: tools/plan.py on the same flags ($CLUSTERS clusters x $((NNODES / CLUSTERS)) nodes x $GPUS_PER_NODE GPUs)"
  local status=0
  "$PYTHON" tools/plan.py --gpus-per-cluster $((NNODES / CLUSTERS * GPUS_PER_NODE)) --vocab-size "$VOCAB_SIZE" \
    --gpu-memory-gib "$GPU_MEMORY_GIB" --gpu-tflops "$GPU_TFLOPS" --intra-bandwidth-gbps "$INTRA_BANDWIDTH_GBPS" \
    --tp-bandwidth-gbps "$TP_BANDWIDTH_GBPS" --inter-bandwidth-gbps "$INTER_BANDWIDTH_GBPS" --check-fits \
    -- "${PRETRAIN_ARGS[@]}" || status=$?
  case $status in
    0) ;;
    3) _fail "the planner says this layout does not fit $GPU_MEMORY_GIB GiB per GPU: see the plan above" ;;
    *) _fail "tools/plan.py failed (exit status $status): see its error above" ;;
  esac
}

launch() {
  DRY_RUN=0
  for arg in "$@"; do
    case "$arg" in
      --dry-run) DRY_RUN=1 ;;
      -h|--help) sed -n '2,/^set -/p' "$0" | sed '$d'; exit 0 ;;
      *) _fail "unknown argument $arg (expected --dry-run or --help)" ;;
    esac
  done
  cd "$(dirname "$0")/../.."
  _check_layout
  _check_environment
  echo "> $NAME: $CLUSTERS clusters x $((NNODES / CLUSTERS)) nodes x $GPUS_PER_NODE GPUs, rendezvous $MASTER_ADDR:$MASTER_PORT"
  _plan
  local per_cluster=$((NNODES / CLUSTERS))
  if [ "$DRY_RUN" = 1 ]; then
    echo "> dry run: the command of every node (run node r's line there; cluster k = nodes k*$per_cluster .. (k+1)*$per_cluster-1)"
    for ((r = 0; r < NNODES; r++)); do
      _node_command "$r"
      _print_command
    done
    return 0
  fi
  _node_command "$NODE_RANK"
  echo "> node $NODE_RANK of $NNODES (cluster $((NODE_RANK / per_cluster))):"
  _print_command
  mkdir -p "$CHECKPOINT_PATH" "$LOG_DIR"
  exec "${NODE_CMD[@]}"
}
