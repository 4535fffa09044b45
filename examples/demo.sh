#!/bin/bash
# The demo (`make demo`): everything megalite does, end to end, on a laptop CPU.
#   1. a real corpus every machine has (the Python standard library's source), a SentencePiece tokenizer
#      trained on it, and Megatron .bin/.idx preprocessing (reused when re-run);
#   2. pretraining a small Llama on 8 gloo ranks: tensor parallel 2 (with sequence parallel) x pipeline
#      parallel 2 (interleaved, 2 virtual stages per rank) x data parallel 2 with the distributed optimizer;
#   3. a checkpoint, its export to Hugging Face (loaded back with transformers), a generated sample,
#      and PNG plots of the loss, learning rate, gradient norm, throughput and memory.
# Every output's path is printed at the end. Sizes can be changed with the variables below.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DATA=${DATA:-data}
RUN=${RUN:-runs/demo}
ITERS=${ITERS:-300}
NPROC=${NPROC:-8}               # TP x PP x DP = 2 x 2 x 2
TP=${TP:-2}
PP=${PP:-2}
export WANDB_MODE=${WANDB_MODE:-offline}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # 8 ranks share the cores: one thread each, no oversubscription

# ---- 1. data ----------------------------------------------------------------------------------------
mkdir -p "$DATA"
[ -s $DATA/stdlib.jsonl ] || $PY tools/stdlib_corpus.py --output $DATA/stdlib.jsonl
[ -s $DATA/stdlib_sp.model ] || $PY tools/train_tokenizer.py --input $DATA/stdlib.jsonl --vocab-size 4096 \
    --output-prefix $DATA/stdlib_sp
[ -s $DATA/stdlib_text_document.idx ] || $PY tools/preprocess_data.py --input $DATA/stdlib.jsonl \
    --output-prefix $DATA/stdlib --tokenizer-type SentencePieceTokenizer --tokenizer-model $DATA/stdlib_sp.model \
    --append-eod --workers 2

# A re-run trains afresh rather than resuming the finished run (its metrics file would be appended to).
rm -rf "$RUN"
mkdir -p "$RUN"
CHECKPOINTS=$RUN/checkpoints

# ---- 2. pretraining, 3D parallel --------------------------------------------------------------------
MODEL_ARGS=(
    --num-layers 4 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 4
    --group-query-attention --num-query-groups 2 --seq-length 128 --max-position-embeddings 128
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP --sequence-parallel
    --pipeline-model-parallel-size $PP --num-layers-per-virtual-pipeline-stage 1
    --use-distributed-optimizer --overlap-grad-reduce
)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 16 --train-iters "$ITERS"
    --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0
)
DATA_ARGS=(
    --data-path $DATA/stdlib_text_document --split 98,2,0
    --tokenizer-type SentencePieceTokenizer --tokenizer-model $DATA/stdlib_sp.model
)
OUTPUT_ARGS=(
    --log-interval 10 --eval-interval 100 --eval-iters 5 --log-throughput --timing-log-level 1
    --save "$CHECKPOINTS" --save-interval 100 --metrics-file "$RUN/metrics.jsonl" --tensorboard-dir "$RUN/tensorboard"
    --wandb-project megalite-demo --wandb-exp-name demo --wandb-save-dir "$RUN"
)
$PY -m torch.distributed.run --standalone --nproc_per_node "$NPROC" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
    2>&1 | tee "$RUN/train.log" || { echo "demo: training failed, see $RUN/train.log" >&2; exit 1; }

# ---- 3. export, sample, plots -----------------------------------------------------------------------
$PY tools/convert_checkpoint.py --from megalite --to hf --input "$CHECKPOINTS" --output "$RUN/hf" | tee "$RUN/export.log"
$PY - "$RUN/hf" <<'EOF' | tee -a "$RUN/export.log"
import sys
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(f"transformers loads {sys.argv[1]}: {type(model).__name__}, {model.num_parameters():,} parameters")
EOF
$PY tools/generate.py --load "$CHECKPOINTS" --prompt "def __init__(self" --max-new-tokens 48 --greedy \
    | tee "$RUN/sample.txt"
$PY tools/plot_metrics.py "$RUN/metrics.jsonl" --output-dir "$RUN/plots" > "$RUN/plots.log"

first=$(grep -m1 -o "lm loss: [0-9.E+-]*" "$RUN/train.log" | awk '{print $3}')
last=$(grep -o "lm loss: [0-9.E+-]*" "$RUN/train.log" | tail -1 | awk '{print $3}')
echo
echo "demo finished: TP=$TP x PP=$PP (interleaved) x DP=$((NPROC / TP / PP)) on $NPROC gloo ranks, $ITERS iterations;" \
     "lm loss $first -> $last"
echo "  training log       : $RUN/train.log"
echo "  metrics (JSONL)    : $RUN/metrics.jsonl"
echo "  loss curves (PNG)  : $RUN/plots/loss.png  (all panels: $RUN/plots/overview.png)"
echo "  checkpoint         : $CHECKPOINTS/$(cat "$CHECKPOINTS/latest_checkpointed_iteration.txt" | xargs printf 'iter_%07d')"
echo "  Hugging Face model : $RUN/hf"
echo "  generated sample   : $RUN/sample.txt"
echo "  tensorboard        : $RUN/tensorboard   (tensorboard --logdir $RUN/tensorboard)"
echo "  wandb (offline)    : $RUN/wandb   (wandb sync $RUN/wandb/offline-run-*)"
