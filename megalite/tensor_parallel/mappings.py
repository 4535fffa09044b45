"""Autograd-aware collectives for entering and leaving tensor-parallel regions.

Each function is the identity when ``group`` is None (one TP rank), so single-process runs pay
nothing. Names follow Megatron:

  copy_to_tp_region           forward identity      backward all-reduce
  reduce_from_tp_region       forward all-reduce    backward identity
  gather_from_tp_region       forward all-gather    backward split          (last dim)
  scatter_to_tp_region        forward split         backward all-gather     (last dim)
  gather_from_sp_region       forward all-gather    backward reduce-scatter (dim 0, the sequence)
  reduce_scatter_to_sp_region forward reduce-scatter backward all-gather    (dim 0)
  scatter_to_sp_region        forward split         backward all-gather     (dim 0)
"""
from __future__ import annotations

import torch
import torch.distributed as dist


# torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single; older releases have only the first
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
    dist.all_gather_into_tensor(out, x, group=group)
    return out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum over ranks, then keep this rank's chunk of ``dim``."""
    world = _world(group)
    x = x.movedim(dim, 0).contiguous()
    if x.shape[0] % world:
        raise ValueError(f"dimension {dim} of size {x.shape[0]} is not divisible by {world} ranks")
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_into(out, x, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim)


def split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's chunk of ``dim`` (no communication)."""
    world = _world(group)
    if x.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by {world} ranks")
    return x.chunk(world, dim=dim)[_rank(group)].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return split(grad, ctx.group, dim=-1), None


class _ScatterLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, dim=-1), None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.group, dim=0), None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, group, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, dim=0), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split(x, group, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, dim=0), None


def _apply(fn, x, group):
    return x if group is None else fn.apply(x, group)


def copy_to_tp_region(x, group):
    return _apply(_CopyToRegion, x, group)


def reduce_from_tp_region(x, group):
    return _apply(_ReduceFromRegion, x, group)


def gather_from_tp_region(x, group):
    return _apply(_GatherLastDim, x, group)


def scatter_to_tp_region(x, group):
    return _apply(_ScatterLastDim, x, group)


def gather_from_sp_region(x, group):
    return _apply(_GatherSequence, x, group)


def reduce_scatter_to_sp_region(x, group):
    return _apply(_ReduceScatterSequence, x, group)


def scatter_to_sp_region(x, group):
    return _apply(_ScatterSequence, x, group)
