"""Building a rank's TensorParallel context: its group, sequence parallelism, RNG tracker, the group
of TP ranks that hold the same KV head (whose K/V gradients parallel/finalize_grads.py sums), and the
context-parallel group (over which FP8 recipes reduce the amaxes of token-split operands)."""
from __future__ import annotations

import torch

from megalite.parallel.mesh import ParallelState, rank_grid_groups
from megalite.parallel.tensor.layers import TensorParallel
from megalite.parallel.tensor.random import build_rng_tracker


def build_tensor_parallel(state: ParallelState, sequence_parallel: bool, seed: int,
                          device: torch.device, num_query_groups: int) -> TensorParallel:
    tp = TensorParallel(group=state.group("tp"), rank=state.tp_rank, size=state.tp_size,
                        sequence_parallel=sequence_parallel and state.tp_size > 1,
                        rng=build_rng_tracker(seed, state.tp_rank, device), cp_group=state.group("cp"),
                        cp_size=state.cp_size)
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
