#!/bin/bash
# Continue pretraining a Hugging Face model (Llama 1/2/3, Mistral, Qwen2, Qwen3, Phi-3, GPT-2, or the
# Mixture-of-Experts Mixtral, Qwen2-MoE, Qwen3-MoE) and export the result back to Hugging Face:
#   1. tools/convert_checkpoint.py --from hf --to megalite      HF_MODEL -> BASE_CHECKPOINT
#   2. (when DATA_PATH does not exist yet) tokenize CORPUS with the model's own tokenizer
#   3. pretrain_gpt.py --load BASE_CHECKPOINT --use-checkpoint-args --finetune: no model flags, the
#      architecture and tokenizer come from the checkpoint; --finetune loads the weights only and
#      starts at iteration 0 with a fresh optimizer and the schedule below
#   4. tools/convert_checkpoint.py --from megalite --to hf     CHECKPOINT_PATH -> HF_OUTPUT
#
#   HF_MODEL=path/to/Meta-Llama-3-8B DATA_PATH=data/my_corpus_text_document \
#       bash examples/continue_pretraining_from_hf.sh
#   HF_MODEL=... CORPUS=my_corpus.jsonl DATA_PATH=data/my_corpus_text_document bash ...   # tokenizes first
#   HF_MODEL=path/to/Mixtral-8x7B-v0.1 EP=8 TP=1 PP=4 DATA_PATH=... bash ...   # experts over 8 ranks
#
# Re-running continues from the latest checkpoint in CHECKPOINT_PATH (not from the HF weights again).
# With NNODES > 1 the conversions and tokenization run on NODE_RANK 0 only; torchrun's rendezvous
# holds the other nodes back until node 0 starts training, so they see the converted checkpoint.
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

# ---- paths ----------------------------------------------------------------------------------------
HF_MODEL=${HF_MODEL:?set HF_MODEL to a local Hugging Face model folder (config.json, *.safetensors, tokenizer files)}
WORK_DIR=${WORK_DIR:-$ROOT/checkpoints/continued_$(basename "$HF_MODEL")}
BASE_CHECKPOINT=${BASE_CHECKPOINT:-$WORK_DIR/base}        # HF weights converted to megalite
CHECKPOINT_PATH=${CHECKPOINT_PATH:-$WORK_DIR/checkpoints} # the continued run
HF_OUTPUT=${HF_OUTPUT:-$WORK_DIR/hf}                      # the continued model, as Hugging Face
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}
DATA_PATH=${DATA_PATH:?set DATA_PATH to a .bin/.idx prefix tokenized with HF_MODEL tokenizer (or also set CORPUS to make it)}
CORPUS=${CORPUS:-}                   # JSONL/Parquet text to tokenize into DATA_PATH when DATA_PATH is missing

# ---- parallelism ----------------------------------------------------------------------------------
TP=${TP:-2}                          # 2 for 7-8B models on 80 GB GPUs, 1 for smaller ones, more for larger
PP=${PP:-1}
# MoE models only: EP ranks split each MoE layer's experts (a divisor of the expert count); they come
# out of the data-parallel ranks, so EP x TP x PP must divide the world size
EP=${EP:-1}
# MoE models only: the load-balancing loss coefficient; empty: the HF config's router_aux_loss_coef when
# its output_router_logits is true (HF trains with the loss then), else 0. Megatron adds one loss per MoE
# layer where HF pools all layers into one: set it explicitly to tune the balancing strength
MOE_AUX_LOSS_COEFF=${MOE_AUX_LOSS_COEFF:-}

# ---- batch and schedule: gentler than pretraining from scratch -------------------------------------
SEQ_LENGTH=${SEQ_LENGTH:-}           # empty: the model's own context length (from the checkpoint)
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-256}
TRAIN_ITERS=${TRAIN_ITERS:-5000}
WARMUP_ITERS=${WARMUP_ITERS:-100}
LR=${LR:-2e-5}                       # ~1/10 of the peak lr the model was pretrained with
MIN_LR=${MIN_LR:-2e-6}
SAVE_INTERVAL=${SAVE_INTERVAL:-500}
EVAL_INTERVAL=${EVAL_INTERVAL:-500}
EVAL_ITERS=${EVAL_ITERS:-10}
LOG_INTERVAL=${LOG_INTERVAL:-1}
# Data-loader worker processes per rank (they ignore SIGTERM, so --exit-signal-handler still saves).
NUM_WORKERS=${NUM_WORKERS:-2}

# ---- 1-2: convert the model, tokenize the data (node 0 only) --------------------------------------
if [ "$NODE_RANK" -eq 0 ]; then
    if [ ! -f "$BASE_CHECKPOINT/latest_checkpointed_iteration.txt" ]; then
        "$PYTHON" "$ROOT/tools/convert_checkpoint.py" --from hf --to megalite --input "$HF_MODEL" --output "$BASE_CHECKPOINT"
    fi
    if [ ! -s "$DATA_PATH.idx" ]; then
        if [ -z "$CORPUS" ] || [ "${DATA_PATH%_text_document}" = "$DATA_PATH" ]; then
            echo "error: $DATA_PATH.idx does not exist; set CORPUS (text to tokenize) and a DATA_PATH ending in" \
                 "_text_document, or point DATA_PATH at an existing prefix" >&2
            exit 1
        fi
        # the model's own tokenizer: token ids must mean what the pretrained embeddings learned
        "$PYTHON" "$ROOT/tools/preprocess_data.py" --input "$CORPUS" --output-prefix "${DATA_PATH%_text_document}" \
            --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_MODEL" --append-eod --workers "$(nproc)"
    fi
fi

# ---- 3: continue pretraining -----------------------------------------------------------------------
if [ -f "$CHECKPOINT_PATH/latest_checkpointed_iteration.txt" ]; then
    # a previous run of this script saved: resume it (optimizer, schedule and data position included)
    LOAD_ARGS=(--load "$CHECKPOINT_PATH" --use-checkpoint-args)
else
    LOAD_ARGS=(--load "$BASE_CHECKPOINT" --use-checkpoint-args --finetune)
fi
DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --use-distributed-optimizer --overlap-grad-reduce
)
if [ "$TP" -gt 1 ]; then PARALLEL_ARGS+=(--sequence-parallel); fi     # MoE with TP needs it too
if [ "$EP" -gt 1 ]; then PARALLEL_ARGS+=(--expert-model-parallel-size "$EP"); fi
if [ -z "$MOE_AUX_LOSS_COEFF" ]; then
    # megalite's mapping of HF_MODEL's config.json (prints nothing for a dense model)
    MOE_AUX_LOSS_COEFF=$("$PYTHON" - "$ROOT" "$HF_MODEL" <<'EOF'
import sys
sys.path.insert(0, sys.argv[1])
from megalite.checkpoint.hf_config import model_fields, read_hf_config
print(model_fields(read_hf_config(sys.argv[2])).get("moe_aux_loss_coeff", ""))
EOF
    )
fi
MOE_ARGS=()                          # the experts, router and layer pattern come from the checkpoint
if [ -n "$MOE_AUX_LOSS_COEFF" ]; then MOE_ARGS+=(--moe-aux-loss-coeff "$MOE_AUX_LOSS_COEFF"); fi
TRAINING_ARGS=(
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
    --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS"
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --clip-grad 1.0
    --attention-dropout 0.0 --hidden-dropout 0.0
    --bf16
    --save "$CHECKPOINT_PATH" --save-interval "$SAVE_INTERVAL"
    --exit-signal-handler                    # SIGTERM/Ctrl-C: finish the step, save, exit 0
)
if [ -n "$SEQ_LENGTH" ]; then TRAINING_ARGS+=(--seq-length "$SEQ_LENGTH"); fi
DATA_ARGS=(--data-path "$DATA_PATH" --split "99,1,0" --num-workers "$NUM_WORKERS")   # the tokenizer comes from the checkpoint
EVAL_AND_LOGGING_ARGS=(
    --log-interval "$LOG_INTERVAL" --log-throughput
    --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
    --tensorboard-dir "$TENSORBOARD_DIR"     # metrics.jsonl lands in CHECKPOINT_PATH (the --save dir)
)
if [ -n "${WANDB_PROJECT:-}" ]; then
    EVAL_AND_LOGGING_ARGS+=(--wandb-project "$WANDB_PROJECT"
                            --wandb-exp-name "${WANDB_EXP_NAME:-continued-$(basename "$HF_MODEL")}"
                            --wandb-save-dir "$CHECKPOINT_PATH")
fi

"${TORCHRUN[@]}" "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt.py" \
    "${LOAD_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"

# ---- 4: export the latest checkpoint to Hugging Face (node 0 only) ---------------------------------
if [ "$NODE_RANK" -eq 0 ]; then
    # --overwrite: HF_OUTPUT is derived from CHECKPOINT_PATH; a re-run exports the newer checkpoint
    "$PYTHON" "$ROOT/tools/convert_checkpoint.py" --from megalite --to hf --input "$CHECKPOINT_PATH" \
        --output "$HF_OUTPUT" --overwrite
    echo "continued model: $HF_OUTPUT (transformers.AutoModelForCausalLM.from_pretrained(\"$HF_OUTPUT\"))"
fi
