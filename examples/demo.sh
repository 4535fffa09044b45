#!/bin/bash
# The demo: a real corpus every machine has (the Python standard library's source), a SentencePiece
# tokenizer trained on it, Megatron .bin/.idx preprocessing, and a short CPU pretraining run of a
# small Llama-style model with a validation split. Re-running reuses the prepared data.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DATA=data
RUN=${RUN:-runs/demo}
ITERS=${ITERS:-300}
export WANDB_MODE=${WANDB_MODE:-offline}
mkdir -p "$DATA" "$RUN"

[ -s $DATA/stdlib.jsonl ] || $PY tools/stdlib_corpus.py --output $DATA/stdlib.jsonl
[ -s $DATA/stdlib_sp.model ] || $PY tools/train_tokenizer.py --input $DATA/stdlib.jsonl --vocab-size 4096 \
    --output-prefix $DATA/stdlib_sp
[ -s $DATA/stdlib_text_document.idx ] || $PY tools/preprocess_data.py --input $DATA/stdlib.jsonl \
    --output-prefix $DATA/stdlib --tokenizer-type SentencePieceTokenizer --tokenizer-model $DATA/stdlib_sp.model \
    --append-eod --workers 2

$PY pretrain_gpt.py \
    --num-layers 4 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 4 \
    --group-query-attention --num-query-groups 2 --seq-length 128 --max-position-embeddings 128 \
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
    --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0 \
    --micro-batch-size 8 --global-batch-size 16 --train-iters "$ITERS" \
    --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0 \
    --data-path $DATA/stdlib_text_document --split 98,2,0 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model $DATA/stdlib_sp.model \
    --log-interval 10 --eval-interval 100 --eval-iters 5 --log-throughput \
    --metrics-file "$RUN/metrics.jsonl" --wandb-project megalite-demo --wandb-exp-name demo --wandb-save-dir "$RUN" \
    2>&1 | tee "$RUN/train.log"

echo
echo "demo finished:"
echo "  training log : $RUN/train.log"
echo "  metrics      : $RUN/metrics.jsonl"
echo "  wandb (offline) : $RUN/wandb"
