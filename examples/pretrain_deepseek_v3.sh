#!/bin/bash
# DeepSeek-V3 671B (61 layers of 7168, multi-latent attention with 128 heads, q-LoRA 1536, KV latent 512,
# heads of 128 + 64 RoPE, values of 128, YaRN; the first 3 layers dense (SwiGLU 18432), then 256 routed
# experts of 2048 with top-8 sigmoid routing limited to 4 of 8 groups, the expert bias and a shared
# expert; one multi-token prediction depth; untied embeddings over 129280 ids; 4096-token sequences)
# on 128 nodes x 8 GPUs = 1,024 GPUs, launched with plain torchrun, one command per node. Megatron's
# recipe:
#   TP=2 with sequence parallelism x PP=16 with 2 virtual stages per rank x DP=32; the experts EP=64
#   (4 per rank, whole); the layout "Et*2|(tt|)*29,t|mL" puts the embedding and 2 dense layers first,
#   2 layers on each of the next 29 virtual stages, 1 on the 31st and the MTP depth with the output
#   layer and loss alone on the last; bf16, the distributed optimizer with overlapped reduction and
#   gather, all-to-all dispatch, full recomputation (megalite's selective recomputation keeps the
#   MLP and MoE activations that Megatron's --recompute-modules would drop: 130 GB on rank 2 by
#   tools/plan_parallelism.py, 31 GB with full).
# The planner ranks this layout at about 69 s per 32M-token step (14% MFU, 31 GB on the fullest rank);
# its best for 1,024 GPUs (TP=8 PP=16 EP=8 DP=8, no recomputation, first stage 2 layers, last 3 with the
# MTP depth: 62 GB, about 39 s, 25% MFU) runs with
#   TP=8 EP=8 LAYOUT= FIRST=2 LAST=3 VPP= RECOMPUTE=none bash examples/pretrain_deepseek_v3.sh
# (python tools/plan_parallelism.py with the model flags below and --num-gpus 1024 --gpu-memory-gb 80
# prints the table.) Run the same command on every node, changing only NODE_RANK:
#
#   NNODES=128 NODE_RANK=0 MASTER_ADDR=node0.cluster MASTER_PORT=6000 \
#   DATA_PATH=/shared/data/my_corpus_text_document TOKENIZER_MODEL=/shared/DeepSeek-V3 \
#       bash examples/pretrain_deepseek_v3.sh
#
# TOKENIZER_MODEL is a local folder with DeepSeek-V3's Hugging Face tokenizer; tokenize the data with it:
# python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/my_corpus \
#     --tokenizer-type HuggingFaceTokenizer --tokenizer-model /shared/DeepSeek-V3 --append-eod
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
NNODES=${NNODES:-128}
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

CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/checkpoints/deepseek_v3}   # on a filesystem every node sees
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}
DATA_PATH=${DATA_PATH:?set DATA_PATH to a prefix made by tools/preprocess_data.py with the DeepSeek-V3 tokenizer, e.g. data/my_corpus_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a local folder holding DeepSeek-V3 tokenizer files}

# ---- model ----------------------------------------------------------------------------------------
NUM_LAYERS=${NUM_LAYERS:-61}
HIDDEN_SIZE=${HIDDEN_SIZE:-7168}
FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-18432}   # the dense layers' SwiGLU width
NUM_HEADS=${NUM_HEADS:-128}
SEQ_LENGTH=${SEQ_LENGTH:-4096}
MOE_LAYER_FREQ=${MOE_LAYER_FREQ:-"([0]*3+[1]*58)"}
NUM_EXPERTS=${NUM_EXPERTS:-256}
EXPERT_FFN=${EXPERT_FFN:-2048}
TOPK=${TOPK:-8}
MTP_LAYERS=${MTP_LAYERS:-1}

# ---- parallelism ----------------------------------------------------------------------------------
TP=${TP:-2}                     # 128 heads / 2 = 64 per rank; the latent down projections replicated
PP=${PP:-16}
VPP=${VPP-2}                    # virtual stages per rank (empty: none); LAYOUT sets them itself
LAYOUT=${LAYOUT-"Et*2|(tt|)*29,t|mL"}     # empty: FIRST/LAST or an even split
FIRST=${FIRST:-}                # layers on the first / last pipeline stage, without LAYOUT
LAST=${LAST:-}
EP=${EP:-64}                    # 256 experts / 64 = 4 whole experts per rank
RECOMPUTE=${RECOMPUTE:-full}    # full | selective | none

# ---- batch and schedule ---------------------------------------------------------------------------
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-8192}          # 8192 x 4096 = 32M tokens per step
TRAIN_ITERS=${TRAIN_ITERS:-500000}
WARMUP_ITERS=${WARMUP_ITERS:-2000}
LR=${LR:-2.2e-4}
MIN_LR=${MIN_LR:-2.2e-5}
SAVE_INTERVAL=${SAVE_INTERVAL:-500}
EVAL_INTERVAL=${EVAL_INTERVAL:-1000}
EVAL_ITERS=${EVAL_ITERS:-10}
LOG_INTERVAL=${LOG_INTERVAL:-1}
NUM_WORKERS=${NUM_WORKERS:-2}

MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --ffn-hidden-size "$FFN_HIDDEN_SIZE"
    --num-attention-heads "$NUM_HEADS" --kv-channels 128
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type rope --rotary-base 10000
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights --make-vocab-size-divisible-by 3232
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
)
MLA_ARGS=(
    --multi-latent-attention --qk-layernorm --q-lora-rank 1536 --kv-lora-rank 512
    --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128
    --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
)
MOE_ARGS=(
    --num-experts "$NUM_EXPERTS" --moe-layer-freq "$MOE_LAYER_FREQ" --moe-ffn-hidden-size "$EXPERT_FFN"
    --moe-shared-expert-intermediate-size "$EXPERT_FFN" --moe-router-topk "$TOPK"
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
    --moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-topk-scaling-factor 2.5
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 --moe-router-dtype fp32
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall
)
MTP_ARGS=(--mtp-num-layers "$MTP_LAYERS" --mtp-loss-scaling-factor 0.1)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --sequence-parallel    # MoE with TP needs sequence parallelism
    --pipeline-model-parallel-size "$PP" --expert-model-parallel-size "$EP" --expert-tensor-parallel-size 1
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
if [ -n "$LAYOUT" ]; then
    PARALLEL_ARGS+=(--pipeline-model-parallel-layout "$LAYOUT")
else
    if [ -n "$VPP" ]; then PARALLEL_ARGS+=(--num-virtual-stages-per-pipeline-rank "$VPP"); fi
    if [ -n "$FIRST" ]; then PARALLEL_ARGS+=(--decoder-first-pipeline-num-layers "$FIRST"); fi
    if [ -n "$LAST" ]; then PARALLEL_ARGS+=(--decoder-last-pipeline-num-layers "$LAST"); fi
fi
case "$RECOMPUTE" in
    full) RECOMPUTE_ARGS=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1) ;;
    selective) RECOMPUTE_ARGS=(--recompute-granularity selective) ;;
    none) RECOMPUTE_ARGS=() ;;
    *) echo "error: RECOMPUTE must be full, selective or none, got $RECOMPUTE" >&2; exit 1 ;;
esac
TRAINING_ARGS=(
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
    --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS"
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
    --bf16 --manual-gc --manual-gc-interval 10
)
# --load = --save: a restarted job continues from the latest checkpoint; --exit-signal-handler: on
# SIGTERM every rank finishes the current step, the checkpoint is saved and the run exits 0
CHECKPOINT_ARGS=(
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval "$SAVE_INTERVAL"
    --exit-signal-handler --distributed-timeout-minutes 60
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
    EVAL_AND_LOGGING_ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "${WANDB_EXP_NAME:-deepseek-v3}"
                            --wandb-save-dir "$CHECKPOINT_PATH")
fi

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
)

"${TORCHRUN[@]}" "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" "${MLA_ARGS[@]}" "${MOE_ARGS[@]}" "${MTP_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
    "${RECOMPUTE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"
