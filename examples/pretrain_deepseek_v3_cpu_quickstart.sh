#!/bin/bash
# CPU quickstart for the DeepSeek-V3 family: a tiny DeepSeek-V3 (multi-latent attention with a q-LoRA and
# a KV latent, YaRN RoPE on a decoupled part of each head; a dense first layer, then MoE layers of 8
# experts with sigmoid top-4 routing limited to 2 of 4 groups, the loss-free expert bias and a shared
# expert; one multi-token prediction depth) pretrained by two processes on one machine with
# torch.distributed's gloo backend, on the corpus `make demo` prepares (Python's standard library as
# text, a SentencePiece tokenizer trained on it, Megatron .bin/.idx). Missing data is prepared first
# with the same tools/ commands as examples/demo.sh. The two processes split the experts (EP=2: 4 each,
# tokens exchanged all-to-all) and are data parallel for everything else. The log adds the MTP loss
# and the busiest expert's load.
#
#   bash examples/pretrain_deepseek_v3_cpu_quickstart.sh                 # EP=2, data parallel 2
#   TP=2 EP=2 ETP=1 bash examples/pretrain_deepseek_v3_cpu_quickstart.sh # heads split over TP=2 + SP
#
# Every size below can be overridden from the environment.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)     # the megalite checkout

# ---- launch ---------------------------------------------------------------------------------------
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi   # what `make` installs
fi
# torchrun, through the same interpreter so the same torch runs the launcher and the workers
read -r -a TORCHRUN <<< "${TORCHRUN:-$PYTHON -m torch.distributed.run}"
NPROC_PER_NODE=${NPROC_PER_NODE:-2}
# torchrun gives every process 1 thread unless told otherwise; share the cores out instead
CORES=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES / NPROC_PER_NODE > 0 ? CORES / NPROC_PER_NODE : 1 ))}
export WANDB_MODE=${WANDB_MODE:-offline}     # a laptop run need not reach wandb's servers

RUN_DIR=${RUN_DIR:-$ROOT/runs/deepseek_v3_quickstart}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-$RUN_DIR/checkpoints}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$RUN_DIR/tensorboard}

# ---- data: the `make demo` corpus, prepared here when missing -------------------------------------
DATA_DIR=${DATA_DIR:-$ROOT/data}              # shared with `make demo`
CORPUS=${CORPUS:-$DATA_DIR/stdlib.jsonl}
CORPUS_MAX_MB=${CORPUS_MAX_MB:-20}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-$DATA_DIR/stdlib_sp.model}
TOKENIZER_VOCAB_SIZE=${TOKENIZER_VOCAB_SIZE:-4096}     # only used when the tokenizer is trained here
DATA_PATH=${DATA_PATH:-$DATA_DIR/stdlib_text_document}

# ---- model: 4 layers of 128, 4 heads, 8 experts of 128 (~3.7M parameters with the 4096-token vocabulary)
NUM_LAYERS=${NUM_LAYERS:-4}
HIDDEN_SIZE=${HIDDEN_SIZE:-128}
FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-256}      # the dense first layer's SwiGLU width
NUM_HEADS=${NUM_HEADS:-4}
SEQ_LENGTH=${SEQ_LENGTH:-128}
Q_LORA_RANK=${Q_LORA_RANK:-64}
KV_LORA_RANK=${KV_LORA_RANK:-32}
QK_HEAD_DIM=${QK_HEAD_DIM:-32}               # each head's no-RoPE part; its RoPE part is QK_POS_DIM
QK_POS_DIM=${QK_POS_DIM:-16}
V_HEAD_DIM=${V_HEAD_DIM:-32}
NUM_EXPERTS=${NUM_EXPERTS:-8}
EXPERT_FFN=${EXPERT_FFN:-128}                # each expert's and the shared expert's SwiGLU width
TOPK=${TOPK:-4}
EXPERT_GROUPS=${EXPERT_GROUPS:-4}            # experts in EXPERT_GROUPS groups; a token uses GROUP_TOPK
GROUP_TOPK=${GROUP_TOPK:-2}
MTP_LAYERS=${MTP_LAYERS:-1}

# ---- parallelism and batch ------------------------------------------------------------------------
TP=${TP:-1}                                  # data parallel = NPROC_PER_NODE / TP
EP=${EP:-2}                                  # experts split over EP ranks: EP x ETP must divide NPROC_PER_NODE
ETP=${ETP:-}                                 # each expert's tensor-parallel size; empty: the same as TP
DISPATCHER=${DISPATCHER:-alltoall}           # alltoall | allgather
MICRO_BATCH=${MICRO_BATCH:-8}
GLOBAL_BATCH=${GLOBAL_BATCH:-16}             # gradient accumulation = GLOBAL_BATCH / (MICRO_BATCH x DP)
TRAIN_ITERS=${TRAIN_ITERS:-200}
LR=${LR:-2e-3}                               # a model this small takes a large learning rate
MIN_LR=${MIN_LR:-2e-4}
PRECISION=${PRECISION:-fp32}                 # fp32 or bf16; most CPUs compute bf16 no faster than fp32
EVAL_INTERVAL=${EVAL_INTERVAL:-100}
EVAL_ITERS=${EVAL_ITERS:-5}
LOG_INTERVAL=${LOG_INTERVAL:-10}

mkdir -p "$DATA_DIR" "$RUN_DIR"
[ -s "$CORPUS" ] || "$PYTHON" "$ROOT/tools/stdlib_corpus.py" --output "$CORPUS" --max-mb "$CORPUS_MAX_MB"
[ -s "$TOKENIZER_MODEL" ] || "$PYTHON" "$ROOT/tools/train_tokenizer.py" --input "$CORPUS" \
    --vocab-size "$TOKENIZER_VOCAB_SIZE" --output-prefix "${TOKENIZER_MODEL%.model}"
if [ ! -s "$DATA_PATH.idx" ]; then
    # preprocess_data.py names its output {prefix}_text_document
    if [ "${DATA_PATH%_text_document}" = "$DATA_PATH" ]; then
        echo "error: $DATA_PATH.idx does not exist and DATA_PATH does not end in _text_document, so it cannot" \
             "be made here; run tools/preprocess_data.py or point DATA_PATH at an existing prefix" >&2
        exit 1
    fi
    "$PYTHON" "$ROOT/tools/preprocess_data.py" --input "$CORPUS" --output-prefix "${DATA_PATH%_text_document}" \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL" --append-eod --workers 2
fi

MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --ffn-hidden-size "$FFN_HIDDEN_SIZE"
    --num-attention-heads "$NUM_HEADS" --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0 --hidden-dropout 0.0
    --multi-latent-attention --qk-layernorm --q-lora-rank "$Q_LORA_RANK" --kv-lora-rank "$KV_LORA_RANK"
    --qk-head-dim "$QK_HEAD_DIM" --qk-pos-emb-head-dim "$QK_POS_DIM" --v-head-dim "$V_HEAD_DIM"
    --rotary-scaling-factor 4 --mscale 1.0 --mscale-all-dim 1.0
    --mtp-num-layers "$MTP_LAYERS" --mtp-loss-scaling-factor 0.1
)
MOE_ARGS=(
    --num-experts "$NUM_EXPERTS" --moe-layer-freq "([0]+[1]*$((NUM_LAYERS - 1)))"
    --moe-ffn-hidden-size "$EXPERT_FFN" --moe-shared-expert-intermediate-size "$EXPERT_FFN"
    --moe-router-topk "$TOPK" --moe-router-num-groups "$EXPERT_GROUPS" --moe-router-group-topk "$GROUP_TOPK"
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-topk-scaling-factor 2.5
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
    --moe-grouped-gemm --moe-token-dispatcher-type "$DISPATCHER"
)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --expert-model-parallel-size "$EP")
# an MoE layer with TP > 1 needs sequence parallelism (each TP rank routes its own tokens)
if [ "$TP" -gt 1 ]; then PARALLEL_ARGS+=(--sequence-parallel); fi
if [ -n "$ETP" ]; then PARALLEL_ARGS+=(--expert-tensor-parallel-size "$ETP"); fi
TRAINING_ARGS=(
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
    --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters 20
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02
    --save "$CHECKPOINT_PATH"
)
case "$PRECISION" in
    fp32) ;;
    bf16) TRAINING_ARGS+=(--bf16) ;;
    *) echo "error: PRECISION must be fp32 or bf16, got $PRECISION" >&2; exit 1 ;;
esac
DATA_ARGS=(
    --data-path "$DATA_PATH" --split "98,2,0"
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
    --num-workers 0                          # worker processes would compete with training for the cores
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval "$LOG_INTERVAL" --log-throughput
    --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
    --tensorboard-dir "$TENSORBOARD_DIR" --metrics-file "$RUN_DIR/metrics.jsonl"
)
if [ -n "${WANDB_PROJECT:-}" ]; then
    EVAL_AND_LOGGING_ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "${WANDB_EXP_NAME:-deepseek-v3-quickstart}"
                            --wandb-save-dir "$RUN_DIR")
fi

# --standalone: one machine, torchrun picks a free port for the rendezvous
"${TORCHRUN[@]}" --standalone --nproc_per_node "$NPROC_PER_NODE" "$ROOT/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" \
    2>&1 | tee "$RUN_DIR/train.log"

echo
echo "DeepSeek-V3 quickstart finished:"
echo "  training log : $RUN_DIR/train.log"
echo "  metrics      : $RUN_DIR/metrics.jsonl (or: tensorboard --logdir $TENSORBOARD_DIR)"
echo "  checkpoint   : $CHECKPOINT_PATH (python tools/generate.py --load $CHECKPOINT_PATH --prompt 'def ' --greedy --max-new-tokens 30)"
