"""Autograd-aware collectives for entering and leaving tensor-parallel regions.

Each function is the identity when ``group`` is None, which is the case at one TP rank in any run
(TensorParallel drops a one-rank group), so TP=1 pays no copy, collective or autograd node. Names
follow Megatron:

  copy_to_tp_region           forward identity      backward all-reduce
  reduce_from_tp_region       forward all-reduce    backward identity
  gather_from_tp_region       forward all-gather    backward split          (last dim)
  gather_from_sp_region       forward all-gather    backward reduce-scatter (dim 0, the sequence)
  reduce_scatter_to_sp_region forward reduce-scatter backward all-gather    (dim 0)
  scatter_to_sp_region        forward split         backward all-gather     (dim 0)

Column-parallel linears under sequence parallelism do not use gather_from_sp_region: it would leave
the all-gathered input saved for backward (see layers.linear_with_sequence_gather, which keeps the
local shard and gathers it again in backward with the asynchronous helpers below).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel.collectives import all_gather_single, reduce_scatter_single


def _world(group) -> int:
    return dist.get_world_size(group)


def _rank(group) -> int:
    return dist.get_rank(group)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``."""
    world = _world(group)
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, x, group=group)
    return out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum over ranks, then keep this rank's chunk of ``dim``."""
    world = _world(group)
    x = x.movedim(dim, 0).contiguous()
    if x.shape[0] % world:
        raise ValueError(f"dimension {dim} of size {x.shape[0]} is not divisible by {world} ranks")
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, x, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim)


class Pending:
    """An asynchronous collective in flight: ``wait()`` blocks until it is done. Holds its input and
    output until then, so a temporary input (a contiguous copy) cannot be freed under the collective."""

    def __init__(self, work, *tensors):
        self.work, self.tensors = work, tensors

    def wait(self) -> None:
        self.work.wait()
        self.tensors = ()


def all_gather_sequence_async(x: torch.Tensor, group) -> tuple[torch.Tensor, Pending]:
    """Start gathering every rank's ``x`` along dim 0 (the sequence); returns (output, pending): the
    output is valid once ``pending.wait()`` returns, so the caller can compute in the meantime."""
    x = x.contiguous()
    out = torch.empty((_world(group) * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, Pending(all_gather_single(out, x, group=group, async_op=True), x, out)


def reduce_scatter_sequence_async(x: torch.Tensor, group) -> tuple[torch.Tensor, Pending]:
    """Start summing ``x`` over ranks and keeping this rank's chunk of dim 0; returns (output, pending)."""
    world = _world(group)
    x = x.contiguous()
    if x.shape[0] % world:
        raise ValueError(f"dimension 0 of size {x.shape[0]} is not divisible by {world} ranks")
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, Pending(reduce_scatter_single(out, x, op=dist.ReduceOp.SUM, group=group, async_op=True), x, out)


def split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's chunk of ``dim`` (no communication)."""
    world = _world(group)
    if x.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by {world} ranks")
    return x.chunk(world, dim=dim)[_rank(group)].contiguous()


def _identity(x: torch.Tensor, group) -> torch.Tensor:
    return x


def _all_reduce_copy(x: torch.Tensor, group) -> torch.Tensor:
    return all_reduce(x.clone(), group)          # the input may be saved for backward: don't overwrite it


class _Mapping(torch.autograd.Function):
    """A collective in forward paired with its adjoint in backward (each ``op(tensor, group)``)."""

    @staticmethod
    def forward(ctx, x, group, forward_op, backward_op):
        ctx.group, ctx.backward_op = group, backward_op
        return forward_op(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.group), None, None, None


def _mapping(forward_op, backward_op):
    def apply(x: torch.Tensor, group) -> torch.Tensor:
        return x if group is None else _Mapping.apply(x, group, forward_op, backward_op)
    return apply


def _along(op, dim: int):
    return lambda x, group: op(x, group, dim=dim)


copy_to_tp_region = _mapping(_identity, all_reduce)
reduce_from_tp_region = _mapping(_all_reduce_copy, _identity)
gather_from_tp_region = _mapping(_along(all_gather, -1), _along(split, -1))
gather_from_sp_region = _mapping(_along(all_gather, 0), _along(reduce_scatter, 0))
reduce_scatter_to_sp_region = _mapping(_along(reduce_scatter, 0), _along(all_gather, 0))
scatter_to_sp_region = _mapping(_along(split, 0), _along(all_gather, 0))
