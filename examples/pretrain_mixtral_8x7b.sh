#!/bin/bash
# Mixtral 8x7B (32 layers, 4096 hidden, 32 heads with 8 KV groups, every MLP a Mixture of Experts of 8
# SwiGLU experts of 14336, top-2 routing, RoPE base 1e6, RMSNorm, untied embeddings, 32000-token
# vocabulary, 4096-token sequences) on 8 nodes x 8 GPUs = 64 GPUs, launched with plain torchrun, one
# command per node:
#   TP=2 with sequence parallelism x PP=4 (8 layers per stage) x DP=8 for attention and embeddings;
#   the experts split EP=8 x expert-TP 2 (= TP): each of a stage's 16 ranks holds half of one expert;
#   bf16, the distributed optimizer (ZeRO-1) with overlapped gradient reduction and parameter gather,
#   grouped expert GEMMs, the all-to-all token dispatcher, load-balancing loss 1e-2.
# Run the same command on every node, changing only NODE_RANK:
#
#   NNODES=8 NODE_RANK=0 MASTER_ADDR=node0.cluster MASTER_PORT=6000 \
#   DATA_PATH=/shared/data/my_corpus_text_document TOKENIZER_MODEL=/shared/mixtral/tokenizer.model \
#       bash examples/pretrain_mixtral_8x7b.sh
#
# TOKENIZER_MODEL is Mixtral's SentencePiece tokenizer.model (32000 ids); tokenize the data with it:
# python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/my_corpus \
#     --tokenizer-type SentencePieceTokenizer --tokenizer-model tokenizer.model --append-eod
# Every size below can be overridden from the environment. Re-running the same commands resumes from
# the latest checkpoint in CHECKPOINT_PATH; SIGTERM to the torchruns saves one and stops.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)     # the megalite checkout, the same path on every node

# ---- launch ---------------------------------------------------------------------------------------
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
read -r -a TORCHRUN <<< "${TORCHRUN:-$PYTHON -m torch.distributed.run}"
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-8}
if [ "$NNODES" -gt 1 ]; then
    # a wrong guess here would leave the nodes waiting for each other until the rendezvous times out
    NODE_RANK=${NODE_RANK:?set NODE_RANK (0 .. NNODES-1) on every node}
    MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the address of the NODE_RANK=0 node, the same on every node}
fi
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
# torchrun forwards SIGTERM to its ranks, then kills them after this many seconds (default 30): long
# enough for the checkpoint that --exit-signal-handler writes
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-540}

CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/checkpoints/mixtral_8x7b}   # on a filesystem every node sees
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}
DATA_PATH=${DATA_PATH:?set DATA_PATH to a prefix made by tools/preprocess_data.py with the Mixtral tokenizer, e.g. data/my_corpus_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL:?set TOKENIZER_MODEL to Mixtral tokenizer.model (SentencePiece, 32000 ids)}

# ---- model ----------------------------------------------------------------------------------------
NUM_LAYERS=${NUM_LAYERS:-32}
HIDDEN_SIZE=${HIDDEN_SIZE:-4096}
FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-14336}   # each expert's SwiGLU width
NUM_HEADS=${NUM_HEADS:-32}
NUM_QUERY_GROUPS=${NUM_QUERY_GROUPS:-8}
SEQ_LENGTH=${SEQ_LENGTH:-4096}
ROTARY_BASE=${ROTARY_BASE:-1000000}
NUM_EXPERTS=${NUM_EXPERTS:-8}
TOPK=${TOPK:-2}
AUX_LOSS=${AUX_LOSS:-1e-2}

# ---- parallelism ----------------------------------------------------------------------------------
TP=${TP:-2}                     # attention split in 2 inside a node; 8 KV groups / 2 = 4 per rank
PP=${PP:-4}                     # 8 layers per stage
EP=${EP:-8}                     # a stage's TP x DP = 16 ranks hold 8 experts x ETP 2 halves
ETP=${ETP:-}                    # each expert's tensor-parallel size; empty: the same as TP
RECOMPUTE=${RECOMPUTE:-selective}   # selective | full | none

# ---- batch and schedule ---------------------------------------------------------------------------
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-256}           # 256 x 4096 = 1M tokens per step
TRAIN_ITERS=${TRAIN_ITERS:-250000}          # 262B tokens
WARMUP_ITERS=${WARMUP_ITERS:-2000}
LR=${LR:-1e-4}
MIN_LR=${MIN_LR:-1e-5}
SAVE_INTERVAL=${SAVE_INTERVAL:-500}
EVAL_INTERVAL=${EVAL_INTERVAL:-1000}
EVAL_ITERS=${EVAL_ITERS:-10}
LOG_INTERVAL=${LOG_INTERVAL:-1}
NUM_WORKERS=${NUM_WORKERS:-2}

MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --ffn-hidden-size "$FFN_HIDDEN_SIZE"
    --num-attention-heads "$NUM_HEADS" --group-query-attention --num-query-groups "$NUM_QUERY_GROUPS"
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type rope --rotary-base "$ROTARY_BASE"
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
)
MOE_ARGS=(
    --num-experts "$NUM_EXPERTS" --moe-router-topk "$TOPK"
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff "$AUX_LOSS"
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --sequence-parallel    # MoE with TP needs sequence parallelism
    --pipeline-model-parallel-size "$PP" --expert-model-parallel-size "$EP"
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
if [ -n "$ETP" ]; then PARALLEL_ARGS+=(--expert-tensor-parallel-size "$ETP"); fi
case "$RECOMPUTE" in
    # selective: recompute attention's core in the backward pass (a few % more compute)
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
)
# --load = --save: a restarted job continues from the latest checkpoint; --exit-signal-handler: on
# SIGTERM every rank finishes the current step, the checkpoint is saved and the run exits 0
CHECKPOINT_ARGS=(
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval "$SAVE_INTERVAL"
    --exit-signal-handler --distributed-timeout-minutes 60
)
DATA_ARGS=(
    --data-path "$DATA_PATH" --split "99,1,0"
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
    --num-workers "$NUM_WORKERS"
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval "$LOG_INTERVAL" --log-throughput
    --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
    --tensorboard-dir "$TENSORBOARD_DIR"     # metrics.jsonl lands in CHECKPOINT_PATH (the --save dir)
)
if [ -n "${WANDB_PROJECT:-}" ]; then
    EVAL_AND_LOGGING_ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "${WANDB_EXP_NAME:-mixtral-8x7b}"
                            --wandb-save-dir "$CHECKPOINT_PATH")
fi

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
)

"${TORCHRUN[@]}" "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${RECOMPUTE_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${CHECKPOINT_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}"
