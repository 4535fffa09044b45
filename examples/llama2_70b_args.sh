# shellcheck shell=bash disable=SC2034
# Llama-2 70B: model, parallel layout, hyperparameters, data, checkpointing and logging flags for
# pretrain_gpt.py, shared by examples/pretrain_llama2_70b_slurm.sh and pretrain_llama2_70b_torchrun.sh
# (sourced, not run). One copy, because a run started under one launcher must resume under the other
# with exactly the same model and schedule. Every size can be overridden from the environment.
#
# Defaults: 8 nodes x 8 GPUs = 64 GPUs as TP=8 (with sequence parallelism) x PP=4 (interleaved, 4
# virtual stages of 5 layers per rank) x DP=2, bf16, the distributed optimizer; Llama 2's recipe
# (4M-token batches, lr 1.5e-4 cosine to 1.5e-5, 2000 warm-up steps, AdamW 0.9/0.95, eps 1e-5,
# weight decay 0.1, gradient clipping 1.0).
#
# Expects ROOT (the megalite checkout) to be set by the script that sources it.

CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/checkpoints/llama2_70b}   # on a filesystem every node sees
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}
DATA_PATH=${DATA_PATH:?set DATA_PATH to a prefix made by tools/preprocess_data.py with the Llama-2 tokenizer, e.g. data/my_corpus_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL:?set TOKENIZER_MODEL to Llama-2 tokenizer.model (SentencePiece, 32000 ids)}

# ---- model ----------------------------------------------------------------------------------------
NUM_LAYERS=${NUM_LAYERS:-80}
HIDDEN_SIZE=${HIDDEN_SIZE:-8192}
FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-28672}
NUM_HEADS=${NUM_HEADS:-64}
NUM_QUERY_GROUPS=${NUM_QUERY_GROUPS:-8}
SEQ_LENGTH=${SEQ_LENGTH:-4096}
ROTARY_BASE=${ROTARY_BASE:-10000}

# ---- parallelism ----------------------------------------------------------------------------------
TP=${TP:-8}                     # one node's NVLink domain; 8 KV groups / TP 8 = one KV head per rank
PP=${PP:-4}                     # 20 layers per stage: ~2.2B parameters per GPU with TP=8
VPP_LAYERS=${VPP_LAYERS-5}      # layers per virtual stage: 4 chunks per rank cut the bubble 4x; VPP_LAYERS= turns interleaving off
RECOMPUTE=${RECOMPUTE:-selective}   # selective | full | none

# ---- batch and schedule ---------------------------------------------------------------------------
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-1024}          # 1024 x 4096 = 4M tokens per step, as Llama 2
TRAIN_ITERS=${TRAIN_ITERS:-500000}          # 2T tokens, as Llama 2
WARMUP_ITERS=${WARMUP_ITERS:-2000}
LR=${LR:-1.5e-4}
MIN_LR=${MIN_LR:-1.5e-5}
SAVE_INTERVAL=${SAVE_INTERVAL:-250}
EVAL_INTERVAL=${EVAL_INTERVAL:-1000}
EVAL_ITERS=${EVAL_ITERS:-10}
LOG_INTERVAL=${LOG_INTERVAL:-1}
# Data-loader worker processes per rank (they ignore SIGTERM, so --exit-signal-handler still saves).
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
# --load = --save: a resubmitted or restarted job continues from the latest checkpoint.
# --exit-signal-handler: on SIGTERM (SLURM before the time limit or on preemption) every rank finishes
# the current step, the checkpoint is saved and the run exits 0.
# A 70B save (weights, fp32 master weights and Adam moments: ~1 TB) can keep ranks at a barrier for
# many minutes: a generous collective timeout.
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
    EVAL_AND_LOGGING_ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "${WANDB_EXP_NAME:-llama2-70b}"
                            --wandb-save-dir "$CHECKPOINT_PATH")
fi

PRETRAIN_ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${RECOMPUTE_ARGS[@]}" "${TRAINING_ARGS[@]}"
               "${CHECKPOINT_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}")
