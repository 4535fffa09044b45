"""Building a rank's TensorParallel context, and the gradient fix-ups tensor parallelism needs.

After backward, two kinds of gradients are partial per TP rank and must be summed over ranks:
- with sequence parallelism, replicated parameters (norm weights, row-parallel biases) saw only this
  rank's sequence shard;
- with more TP ranks than KV heads, the K/V rows of the fused QKV weight are replicated across the
  ranks sharing a KV head, each of which saw only its own query heads.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel.mesh import ParallelState, rank_grid_groups
from megalite.parallel.tensor.layers import TensorParallel
from megalite.parallel.tensor.random import build_rng_tracker


def build_tensor_parallel(state: ParallelState, sequence_parallel: bool, seed: int,
                          device: torch.device, num_query_groups: int) -> TensorParallel:
    tp = TensorParallel(group=state.group("tp"), rank=state.tp_rank, size=state.tp_size,
                        sequence_parallel=sequence_parallel and state.tp_size > 1,
                        rng=build_rng_tracker(seed, state.tp_rank, device))
    tp.kv_replica_group = _kv_replica_group(state, num_query_groups)
    return tp


def _kv_replica_group(state: ParallelState, num_query_groups: int):
    """The TP ranks that hold the same KV head when tp > num_query_groups (created on every rank)."""
    if state.tp_size <= num_query_groups:
        return None
    replicas = state.tp_size // num_query_groups
    mine = None
    for tp_ranks in rank_grid_groups(state.world_size, state.tp_size, state.cp_size, state.pp_size, "t"):
        for g in range(num_query_groups):
            members = tp_ranks[g * replicas:(g + 1) * replicas]
            group = state.new_group(members)
            if state.rank in members:
                mine = group
    return mine


def finalize_tensor_parallel_grads(params, tp: TensorParallel, ddp=None) -> None:
    """Sum the per-rank partial gradients described above (after backward and the DP reduction).

    With a DistributedDataParallel, its ``all_reduce_param_grads`` reduces whatever part of each
    gradient this rank holds (full, or a ZeRO shard); without one, ``param.main_grad`` is used."""
    if tp.size == 1:
        return
    all_reduce = ddp.all_reduce_param_grads if ddp is not None else all_reduce_main_grads
    if tp.sequence_parallel:
        all_reduce([(p, None) for p in params if getattr(p, "sequence_parallel", False)], tp.group)
    replicated = [(p, p.replicated_rows[:2]) for p in params if getattr(p, "replicated_rows", None)]
    if replicated:
        all_reduce(replicated, tp.kv_replica_group)


def all_reduce_main_grads(selection: list, group) -> None:
    """Sum ``param.main_grad`` (or rows ``(first, end)`` of it) over ``group``, coalesced in one call."""
    tensors = [p.main_grad if rows is None else p.main_grad[rows[0]:rows[1]] for p, rows in selection]
    if not tensors or group is None:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
