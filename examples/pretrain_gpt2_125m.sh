#!/bin/bash
# GPT-2 small (125M: 12 layers, 768 hidden, 12 heads, 1024 tokens, learned positions, GELU, tied
# embeddings) on one GPU node: data parallel over GPUS_PER_NODE GPUs, bf16, the distributed optimizer
# (ZeRO-1) and gradient reduction overlapped with the backward pass. Hyperparameters follow GPT-3
# Small / Megatron's GPT recipes: 0.5M-token batches, lr 6e-4 cosine to 6e-5, AdamW beta2 0.95.
#
#   DATA_PATH=data/my_corpus_text_document VOCAB_FILE=gpt2-vocab.json MERGE_FILE=gpt2-merges.txt \
#       bash examples/pretrain_gpt2_125m.sh
#
# The data: python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/my_corpus \
#     --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --append-eod
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

CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/checkpoints/gpt2_125m}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}
DATA_PATH=${DATA_PATH:?set DATA_PATH to a prefix made by tools/preprocess_data.py with the GPT-2 tokenizer, e.g. data/my_corpus_text_document}
VOCAB_FILE=${VOCAB_FILE:?set VOCAB_FILE to the GPT-2 vocabulary (gpt2-vocab.json / vocab.json)}
MERGE_FILE=${MERGE_FILE:?set MERGE_FILE to the GPT-2 merges (gpt2-merges.txt / merges.txt)}

# ---- model ----------------------------------------------------------------------------------------
NUM_LAYERS=${NUM_LAYERS:-12}
HIDDEN_SIZE=${HIDDEN_SIZE:-768}
FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-$((4 * HIDDEN_SIZE))}
NUM_HEADS=${NUM_HEADS:-12}
SEQ_LENGTH=${SEQ_LENGTH:-1024}
MAX_POSITION_EMBEDDINGS=${MAX_POSITION_EMBEDDINGS:-$SEQ_LENGTH}

# ---- batch and schedule ---------------------------------------------------------------------------
MICRO_BATCH=${MICRO_BATCH:-16}
GLOBAL_BATCH=${GLOBAL_BATCH:-512}            # 512 x 1024 = 0.5M tokens, as GPT-3 Small
TRAIN_ITERS=${TRAIN_ITERS:-19073}            # 10B tokens at 0.5M tokens per step
WARMUP_ITERS=${WARMUP_ITERS:-700}
LR=${LR:-6e-4}
MIN_LR=${MIN_LR:-6e-5}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}
EVAL_INTERVAL=${EVAL_INTERVAL:-1000}
EVAL_ITERS=${EVAL_ITERS:-10}
LOG_INTERVAL=${LOG_INTERVAL:-10}
# Data-loader worker processes per rank (they ignore SIGTERM, so --exit-signal-handler still saves).
NUM_WORKERS=${NUM_WORKERS:-2}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
)
MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --ffn-hidden-size "$FFN_HIDDEN_SIZE"
    --num-attention-heads "$NUM_HEADS" --seq-length "$SEQ_LENGTH" --max-position-embeddings "$MAX_POSITION_EMBEDDINGS"
    --position-embedding-type learned_absolute --normalization LayerNorm
    --openai-gelu                            # GPT-2's tanh-approximated GELU
    --attention-dropout 0.1 --hidden-dropout 0.1 --init-method-std 0.02
)
# 125M parameters fit on every GPU many times over: pure data parallelism is fastest. The distributed
# optimizer shards the fp32 master weights and Adam moments over the data-parallel ranks; bucketed
# gradient reduction overlaps the backward pass, the parameter all-gather the next forward pass.
PARALLEL_ARGS=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
TRAINING_ARGS=(
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
    --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS"
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0
    --bf16
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval "$SAVE_INTERVAL"
    --exit-signal-handler                    # SIGTERM/Ctrl-C: finish the step, save, exit 0
)
DATA_ARGS=(
    --data-path "$DATA_PATH" --split "949,50,1"
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
    --num-workers "$NUM_WORKERS"
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval "$LOG_INTERVAL" --log-throughput --timing-log-level 1
    --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
    --tensorboard-dir "$TENSORBOARD_DIR"     # metrics.jsonl lands in CHECKPOINT_PATH (the --save dir)
)
if [ -n "${WANDB_PROJECT:-}" ]; then
    EVAL_AND_LOGGING_ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "${WANDB_EXP_NAME:-gpt2-125m}"
                            --wandb-save-dir "$CHECKPOINT_PATH")
fi

"${TORCHRUN[@]}" "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}"
