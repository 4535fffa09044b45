"""Process start-up: read the launcher's environment, start torch.distributed, pick the device, seed.

Launchers: torchrun or SLURM's srun, read by launch_env.py. A plain ``python pretrain_gpt.py`` is rank
0 of 1 and starts no process group, also inside a SLURM allocation that srun did not start it in.
"""
from __future__ import annotations

import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megalite.config.schema import ParallelConfig
from megalite.config.validate import check_world_size
from megalite.parallel.context.ring_attention import a2a_group_size
from megalite.parallel.dry_run import choose_run
from megalite.parallel.launch_env import (LaunchEnv, exit_with_launcher, rank_error, read_launch_env, restart_note,
                                          single_process_note)
from megalite.parallel.mesh import ParallelState
from megalite.parallel.tensor.random import stage_seed


def device_for(local_rank: int) -> torch.device:
    """The one place that decides between CUDA and CPU, and which GPU a rank uses:

    - one visible GPU: cuda:0, whatever LOCAL_RANK is. Each task sees only its own GPU, as device 0,
      under ``srun --gpus-per-task=1`` or a launcher that sets CUDA_VISIBLE_DEVICES per rank;
    - LOCAL_RANK below the visible count: cuda:LOCAL_RANK (torchrun, or srun with every task seeing
      all of the node's GPUs);
    - otherwise (e.g. 2 GPUs visible and local ranks 0-3) a one-line error: ranks sharing a GPU would
      run out of memory or be refused by NCCL, and which rank doubles up would be a guess.
    """
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        index = 0 if count == 1 else local_rank
        if index >= count:
            raise rank_error(f"LOCAL_RANK {local_rank} but this process sees {count} GPUs (CUDA_VISIBLE_DEVICES="
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most {count} ranks per "
                             f"node (torchrun --nproc_per_node {count}), or give each rank one GPU (srun "
                             "--gpus-per-task=1)")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def initialize_distributed(parallel: ParallelConfig, timeout_minutes: float = 10,
                           env: LaunchEnv | None = None, experts: bool = False) -> tuple[ParallelState, torch.device]:
    """Start the process group (NCCL with CUDA, gloo otherwise; the run backend's own for a dry run,
    parallel/dry_run.py) and build the rank grid (with the expert grid's groups when ``experts``: the
    model has MoE layers). The rank grid holds the run backend, chosen here once."""
    run = choose_run(parallel)
    env = run.start(env)
    if env is None:
        env = read_launch_env()
        for note in (single_process_note(os.environ), restart_note(os.environ) if env.rank == 0 else None):
            if note:
                print(note, flush=True)
        if env.launched:
            exit_with_launcher(env.rank)
    device = run.device(lambda: device_for(env.local_rank))
    if (env.launched or env.world_size > 1) and not dist.is_initialized():   # torchrun/srun, even with one
        # process: size-1 groups take the same collective code paths as larger ones, so one GPU exercises
        # every collective
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        backend = "nccl" if device.type == "cuda" else "gloo"
        try:
            dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                    timeout=timedelta(minutes=timeout_minutes), **process_group_options(device))
        except dist.DistError as e:
            raise rank_error(rendezvous_error(e, env.rank, env.world_size, timeout_minutes)) from None
    check_world_size(env.world_size, parallel)       # the launched world, which the flags were checked for
    state = ParallelState.build(env.world_size, env.rank, parallel.tensor_model_parallel_size,
                                parallel.context_parallel_size, parallel.pipeline_model_parallel_size,
                                timeout=timedelta(minutes=timeout_minutes), ep=parallel.expert_model_parallel_size,
                                etp=parallel.expert_tp_size, experts=experts, run=run,
                                instances=parallel.num_distributed_optimizer_instances,
                                cp_a2a=a2a_group_size(parallel))
    return state, device


def process_group_options(device: torch.device) -> dict:
    """``device_id`` on CUDA (NCCL): the communicator forms inside init_process_group, so an unreachable
    peer or a bad NCCL network setting fails there rather than at the first collective, and sub-groups
    are split from it. torch 2.7.0 then also switches NCCL to its non-blocking mode, which hangs at
    random with that release's NCCL 2.26 (pytorch/pytorch#153960; 2.7.1 no longer switches): there the
    mode stays off unless TORCH_NCCL_USE_COMM_NONBLOCKING is set. gloo (CPU) takes no device."""
    if device.type != "cuda":
        return {}
    if torch.__version__.split("+")[0] == "2.7.0":
        os.environ.setdefault("TORCH_NCCL_USE_COMM_NONBLOCKING", "0")
    return {"device_id": device}


def rendezvous_error(error: Exception, rank: int, world_size: int, timeout_minutes: float) -> str:
    """One line for a failed torch.distributed start: the address in use, or who did not show up."""
    addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
    text = " ".join(str(error).split())
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return (f"MASTER_PORT {port} on MASTER_ADDR {addr} is already in use (another run or program holds it); "
                "choose a free MASTER_PORT, or let torchrun --standalone pick one")
    if isinstance(error, dist.DistStoreError) or "timed out" in text.lower() or "timeout" in text.lower():
        return (f"rank {rank} of {world_size}: the other ranks did not all join at MASTER_ADDR {addr} MASTER_PORT "
                f"{port} within --distributed-timeout-minutes {timeout_minutes:g}; start every rank with the same "
                f"MASTER_ADDR/MASTER_PORT/WORLD_SIZE ({text[:200]})")
    return (f"rank {rank} of {world_size} cannot start torch.distributed at MASTER_ADDR {addr} MASTER_PORT {port} "
            f"({text[:200]}); check that the address is reachable from every node")


def set_matmul_precision(tf32: bool, device: torch.device) -> None:
    """GPUs: fp32 matmuls in TF32 (10-bit mantissa inputs, fp32 accumulation) on Ampere and newer, the
    tensor cores' fp32 path, unless --no-tf32. Older GPUs ignore it.
    torch.set_float32_matmul_precision sets the legacy and the new TF32 switches consistently (mixing
    the two APIs is an error in torch 2.9+). CPUs keep full fp32: on CPU the same setting would let
    oneDNN lower fp32 matmuls too."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if tf32 else "highest")


def set_seed(seed: int, pp_rank: int = 0) -> int:
    """Seed Python, NumPy and torch for pipeline stage ``pp_rank`` with ``stage_seed`` (Megatron's
    --seed + 100 x stage, so stages draw different dropout masks); returns that seed, on which the
    stage's model-parallel RNG stream is built (build_rng_tracker)."""
    seed = stage_seed(seed, pp_rank)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return seed
