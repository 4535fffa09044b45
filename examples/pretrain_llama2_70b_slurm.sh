#!/bin/bash
#SBATCH --job-name=llama2-70b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1           # one torchrun per node; it starts that node's GPUS_PER_NODE ranks
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@600             # SIGTERM 10 minutes before the time limit: time to save
#SBATCH --output=%x_%j.out
#
# Llama-2 70B on a SLURM cluster: one `srun` task per node runs torchrun, and the torchruns meet at a
# c10d rendezvous on the first node of the allocation. Model, layout and hyperparameters are in
# examples/llama2_70b_args.sh (shared with pretrain_llama2_70b_torchrun.sh).
#
#   DATA_PATH=/shared/data/my_corpus_text_document TOKENIZER_MODEL=/shared/llama2/tokenizer.model \
#       sbatch examples/pretrain_llama2_70b_slurm.sh              # from the megalite checkout
#
# Preemption and time limits: SLURM sends SIGTERM to every process of the job step (--signal above,
# or on preemption); each rank finishes its step, saves a checkpoint and exits. Submit the same script
# again to continue from it, or queue several in advance: sbatch --dependency=singleton ... (one job
# of this name at a time, each resuming where the last stopped).
#
# A rank that dies (a crash, a GPU fault, the OOM killer) does not end the job: srun itself never
# restarts a task, but the torchrun it runs on each node does (--max-restarts MAX_RESTARTS): the
# torchruns stop the other ranks, meet again and start all ranks afresh, resuming from the latest
# checkpoint (losing the work since it). A lost node still ends the job step: resubmit, or sbatch
# --requeue (and scontrol requeue) to run the same script again.
set -euo pipefail

# sbatch runs a copy of this script from its spool directory, so the checkout is found from where the
# job was submitted (or MEGALITE_DIR)
if [ -z "${MEGALITE_DIR:-}" ]; then
    if [ -f "${SLURM_SUBMIT_DIR:-}/pretrain_gpt.py" ]; then
        MEGALITE_DIR=$SLURM_SUBMIT_DIR
    else
        MEGALITE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    fi
fi
ROOT=$MEGALITE_DIR
if [ ! -f "$ROOT/pretrain_gpt.py" ]; then
    echo "error: no megalite checkout at $ROOT; submit from the checkout or set MEGALITE_DIR" >&2
    exit 1
fi

# ---- launch ---------------------------------------------------------------------------------------
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
read -r -a TORCHRUN <<< "${TORCHRUN:-$PYTHON -m torch.distributed.run}"
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
HOSTNAMES=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?run this script with sbatch (SLURM_JOB_NODELIST is not set)}")
mapfile -t NODES <<< "$HOSTNAMES"
NNODES=${NNODES:-${#NODES[@]}}
MASTER_ADDR=${MASTER_ADDR:-${NODES[0]}}                  # the rendezvous runs on the first node
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 40000))}   # per job: two jobs on a node do not collide
MAX_RESTARTS=${MAX_RESTARTS:-3}          # in-job restarts after a rank fails (0: the first failure ends the job)
# torchrun forwards SIGTERM to its ranks, then kills them after this many seconds (default 30): long
# enough for the checkpoint that --exit-signal-handler writes
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-540}
# a fresh store for the ranks of every (re)start: recent torchruns (2.13 included) otherwise keep one for
# all of them, and restarted ranks read their dead predecessors' addresses from it and fail to connect
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# export NCCL_SOCKET_IFNAME=...  NCCL_IB_HCA=...    # cluster-specific network settings go here

# shellcheck source=examples/llama2_70b_args.sh
source "$ROOT/examples/llama2_70b_args.sh"

# c10d rendezvous: every node runs the same command and torchrun assigns the node ranks, so no
# per-node value (SLURM_NODEID) has to reach the command line; after a failure the torchruns meet again
# and restart their ranks, up to MAX_RESTARTS times
DISTRIBUTED_ARGS=(
    --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" --max-restarts "$MAX_RESTARTS"
    --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT"
)

echo "llama2-70b: $NNODES node(s) x $GPUS_PER_NODE GPU(s), rendezvous at $MASTER_ADDR:$MASTER_PORT, checkpoints in $CHECKPOINT_PATH, up to $MAX_RESTARTS in-job restart(s)"
# --kill-on-bad-exit: one failed node (its torchrun out of restarts, or gone) ends the step instead of
# leaving the others waiting
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
    "${TORCHRUN[@]}" "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt.py" "${PRETRAIN_ARGS[@]}"
