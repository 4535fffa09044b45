#!/bin/bash
# Llama-2 70B launched with plain torchrun, one command per node (no SLURM). Model, layout and
# hyperparameters are in examples/llama2_70b_args.sh (shared with pretrain_llama2_70b_slurm.sh).
# Run the same command on every node, changing only NODE_RANK:
#
#   NNODES=8 NODE_RANK=0 MASTER_ADDR=node0.cluster MASTER_PORT=6000 \
#   DATA_PATH=/shared/data/my_corpus_text_document TOKENIZER_MODEL=/shared/llama2/tokenizer.model \
#       bash examples/pretrain_llama2_70b_torchrun.sh
#
# Ctrl-C or SIGTERM to the torchruns: every rank finishes its step, saves a checkpoint and exits;
# running the same commands again continues from it. A rank that dies (a crash, a GPU fault, the OOM
# killer) is survived in-job: the torchruns stop the other ranks and start all of them again, up to
# MAX_RESTARTS times, resuming from the latest checkpoint (the work since it is lost).
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
MAX_RESTARTS=${MAX_RESTARTS:-3}          # in-job restarts after a rank fails (0: the first failure ends the job)
RUN_ID=${RUN_ID:-llama2-70b}             # the same on every node; another concurrent job needs another
# torchrun forwards SIGTERM to its ranks, then kills them after this many seconds (default 30): long
# enough for the checkpoint that --exit-signal-handler writes
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-540}
# a fresh store for the ranks of every (re)start: recent torchruns (2.13 included) otherwise keep one for
# all of them, and restarted ranks read their dead predecessors' addresses from it and fail to connect
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# shellcheck source=examples/llama2_70b_args.sh
source "$ROOT/examples/llama2_70b_args.sh"

# c10d rendezvous, hosted by the NODE_RANK=0 torchrun at MASTER_ADDR:MASTER_PORT: the rendezvous that
# can restart (--max-restarts; torchrun's default static one cannot), and it re-forms the group after a
# restart; node ranks are assigned at each rendezvous
[ "$NODE_RANK" = 0 ] && IS_HOST=1 || IS_HOST=0
DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --max-restarts "$MAX_RESTARTS"
    --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RUN_ID" --rdzv_conf "is_host=$IS_HOST"
)

"${TORCHRUN[@]}" "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt.py" "${PRETRAIN_ARGS[@]}"
