#!/bin/bash
# Llama-3 8B (32 layers, 4096 hidden, 32 heads with 8 KV groups, SwiGLU 14336, RoPE base 500000,
# 128256-token vocabulary, 8192-token context) on one node of 8 GPUs:
# TP=2 with sequence parallelism x PP=2 (interleaved, 2 virtual stages per rank) x DP=2, bf16, the
# distributed optimizer. Hyperparameters follow the Llama 2/3 papers (AdamW 0.9/0.95, eps 1e-5,
# weight decay 0.1, cosine to 10 % of the peak lr, 2000 warm-up steps).
#
#   DATA_PATH=data/my_corpus_text_document TOKENIZER_MODEL=path/to/Meta-Llama-3-8B \
#       bash examples/pretrain_llama3_8b.sh
#
# TOKENIZER_MODEL is a local folder with the Llama-3 tokenizer files (tokenizer.json, ...); tokenize
# the data with the same one: python tools/preprocess_data.py --input corpus.jsonl \
#     --output-prefix data/my_corpus --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR --append-eod
# Every size below can be overridden from the environment. Re-running the same command resumes from
# the latest checkpoint in CHECKPOINT_PATH.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)     # the megalite checkout

# ---- launch ---------------------------------------------------------------------------------------
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
read -r -a TORCHRUN <<< "${TORCHRUN:-$PYTHON -m torch.distributed.run}"
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}

CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/checkpoints/llama3_8b}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}
DATA_PATH=${DATA_PATH:?set DATA_PATH to a prefix made by tools/preprocess_data.py with the Llama-3 tokenizer, e.g. data/my_corpus_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a local folder with the Llama-3 tokenizer (tokenizer.json, tokenizer_config.json)}

# ---- model (the vocabulary, 128256 ids, comes from the tokenizer) ----------------------------------
NUM_LAYERS=${NUM_LAYERS:-32}
HIDDEN_SIZE=${HIDDEN_SIZE:-4096}
FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-14336}
NUM_HEADS=${NUM_HEADS:-32}
NUM_QUERY_GROUPS=${NUM_QUERY_GROUPS:-8}
SEQ_LENGTH=${SEQ_LENGTH:-8192}
ROTARY_BASE=${ROTARY_BASE:-500000}

# ---- parallelism ----------------------------------------------------------------------------------
TP=${TP:-2}                     # TP stays inside a node (NVLink); 2 keeps the GEMMs large
PP=${PP:-2}                     # 16 layers per stage; DP = GPUS / (TP x PP) = 2 shards the optimizer
VPP_LAYERS=${VPP_LAYERS-8}      # layers per virtual stage: 2 chunks per rank halve the pipeline bubble; VPP_LAYERS= turns interleaving off
RECOMPUTE=${RECOMPUTE:-selective}   # selective | full | none

# ---- batch and schedule ---------------------------------------------------------------------------
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-128}           # 128 x 8192 = 1M tokens per step
TRAIN_ITERS=${TRAIN_ITERS:-100000}          # 100B tokens
WARMUP_ITERS=${WARMUP_ITERS:-2000}
LR=${LR:-3e-4}
MIN_LR=${MIN_LR:-3e-5}
SAVE_INTERVAL=${SAVE_INTERVAL:-500}
EVAL_INTERVAL=${EVAL_INTERVAL:-1000}
EVAL_ITERS=${EVAL_ITERS:-10}
LOG_INTERVAL=${LOG_INTERVAL:-1}
# Data-loader worker processes per rank (they ignore SIGTERM, so --exit-signal-handler still saves).
NUM_WORKERS=${NUM_WORKERS:-2}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
)
MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --ffn-hidden-size "$FFN_HIDDEN_SIZE"
    --num-attention-heads "$NUM_HEADS" --group-query-attention --num-query-groups "$NUM_QUERY_GROUPS"
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type rope --rotary-base "$ROTARY_BASE"
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --sequence-parallel
    --pipeline-model-parallel-size "$PP"
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
if [ -n "$VPP_LAYERS" ]; then
    # interleaving needs the number of micro-batches (GLOBAL_BATCH / (MICRO_BATCH x DP)) to be a multiple of PP
    PARALLEL_ARGS+=(--num-layers-per-virtual-pipeline-stage "$VPP_LAYERS")
fi
case "$RECOMPUTE" in
    # selective: recompute attention's core in the backward pass (a few % more compute; frees the
    # attention activations, the seq x seq scores too where no flash kernel runs)
    selective) RECOMPUTE_ARGS=(--recompute-granularity selective) ;;
    # full: keep only each layer's input; ~1/3 more compute, for when selective still runs out of memory
    full) RECOMPUTE_ARGS=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1) ;;
    none) RECOMPUTE_ARGS=() ;;
    *) echo "error: RECOMPUTE must be selective, full or none, got $RECOMPUTE" >&2; exit 1 ;;
esac
TRAINING_ARGS=(
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
    --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS"
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --clip-grad 1.0
    --bf16
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval "$SAVE_INTERVAL"
    --exit-signal-handler                    # SIGTERM/Ctrl-C: finish the step, save, exit 0
)
DATA_ARGS=(
    --data-path "$DATA_PATH" --split "99,1,0"
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
    --num-workers "$NUM_WORKERS"
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval "$LOG_INTERVAL" --log-throughput
    --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
    --tensorboard-dir "$TENSORBOARD_DIR"     # metrics.jsonl lands in CHECKPOINT_PATH (the --save dir)
)
if [ -n "${WANDB_PROJECT:-}" ]; then
    EVAL_AND_LOGGING_ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "${WANDB_EXP_NAME:-llama3-8b}"
                            --wandb-save-dir "$CHECKPOINT_PATH")
fi

"${TORCHRUN[@]}" "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${RECOMPUTE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"
