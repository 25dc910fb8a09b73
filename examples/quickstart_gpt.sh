# The quickstart's model, training and data flags, shared by examples/quickstart.sh and the CPU
# benchmarks in examples/benchmark/ (source it; needs DATA, the dataset folder, and ITERS).

# Builds the quickstart dataset in $DATA (stdlib docs corpus, SentencePiece, .bin/.idx) if missing.
build_quickstart_data() {
  [ -f "$DATA/stdlib_text_document.idx" ] && return 0
  echo "> building the corpus, tokenizer and dataset in $DATA"
  mkdir -p "$DATA"
  python tools/make_corpus.py --output "$DATA/stdlib.jsonl"
  python tools/train_tokenizer.py --input "$DATA/stdlib.jsonl" --json-keys text --vocab-size 4096 \
    --model-prefix "$DATA/stdlib_sp"
  python tools/preprocess_data.py --input "$DATA/stdlib.jsonl" --output-prefix "$DATA/stdlib" \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/stdlib_sp.model" --append-eod --workers 2
}

MODEL_ARGS=(--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128
            --max-position-embeddings 128 --hidden-dropout 0 --attention-dropout 0)
TRAIN_ARGS=(--micro-batch-size 4 --global-batch-size 16 --train-iters "$ITERS" --lr 1e-3 --min-lr 1e-4
            --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.1 --clip-grad 1.0)
DATA_ARGS=(--data-path "$DATA/stdlib_text_document" --tokenizer-type SentencePieceTokenizer
           --tokenizer-model "$DATA/stdlib_sp.model" --split 98,2,0 --data-cache-path "$DATA/cache")
# 2 clusters of 2 pipeline stages on 4 processes; without --dilocox the clusters only mark which
# traffic is cross-cluster.
LAYOUT_ARGS=(--pipeline-model-parallel-size 2 --dilocox-clusters 2)
