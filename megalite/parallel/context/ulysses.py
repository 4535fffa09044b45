"""Ulysses context parallelism (--cp-comm-type a2a) and its hierarchical form (a2a+p2p), and the choice
between them, the ring (p2p) and the all-gather (allgather.py) for one layer.

a2a (DeepSpeed-Ulysses): each CP rank holds a sequence shard [s_local, b, heads, d] (the load-balanced
chunks r and 2cp-1-r). One all-to-all turns the sequence shards into head shards: rank j gets heads
[j h / cp, (j + 1) h / cp) of the whole sequence, [s, b, h / cp, d]; the chunks are put back in sequence
order, attention runs locally on the whole sequence (the model's non-parallel attention, passed in as
``local``: so every mask and sink it supports works unchanged), and the inverse all-to-all returns the
output to sequence shards. Query heads and KV groups are split alike, so GQA's grouping survives
(rank j's query heads use exactly rank j's KV groups); both must divide by the group size. A rank's
traffic is 4 all-to-alls of its shard of q, k, v and the output, against the ring's cp - 1 hops of K/V.

a2a+p2p (--hierarchical-context-parallel-sizes a b, a x b = cp): the all-to-all runs inside groups of
a consecutive CP ranks, each of which then holds h / a heads of its group's 2a chunks, and ring attention
runs across the b groups over those chunks.

Backward of an all-to-all is the inverse all-to-all of the gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel.context.allgather import allgather_attention
from megalite.parallel.context.mask_protocol import AttentionMask
from megalite.parallel.context.ring_attention import ContextParallel, ring_attention


def _all_to_all(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """[cp, ...] -> [cp, ...]: slice j goes to rank j, slice i of the result came from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=cp.group)
    return out


def _to_heads(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Sequence shard [s_local, b, h, d] -> head shard [cp * s_local, b, h / cp, d], rank i's shard i-th."""
    s, b, h, d = x.shape
    parts = x.view(s, b, cp.size, h // cp.size, d).permute(2, 0, 1, 3, 4)
    return _all_to_all(parts, cp).view(cp.size * s, b, h // cp.size, d)


def _to_sequence(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """The inverse of _to_heads: [cp * s_local, b, h / cp, d] -> [s_local, b, h, d]."""
    s, b, h, d = x.shape
    parts = _all_to_all(x.view(cp.size, s // cp.size, b, h, d), cp)
    return parts.permute(1, 2, 0, 3, 4).reshape(s // cp.size, b, cp.size * h, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp: ContextParallel, to_heads: bool):
        ctx.cp, ctx.to_heads = cp, to_heads
        return _to_heads(x, cp) if to_heads else _to_sequence(x, cp)

    @staticmethod
    def backward(ctx, grad):
        return (_to_sequence(grad, ctx.cp) if ctx.to_heads else _to_heads(grad, ctx.cp)), None, None


def _head_slice(sinks: torch.Tensor | None, cp: ContextParallel) -> torch.Tensor | None:
    """This rank's heads' sinks (a differentiable slice of the [heads] logits)."""
    if sinks is None:
        return None
    per = sinks.shape[0] // cp.size
    return sinks[cp.rank * per:(cp.rank + 1) * per]


def _sequence_order(cp: ContextParallel, device) -> torch.Tensor:
    """Where each row of the gathered [2cp chunks] tensor goes in sequence order, as a gather index."""
    held = [t for r in range(cp.size) for t in cp.chunk_ids(r)]
    return torch.tensor(sorted(range(len(held)), key=held.__getitem__), device=device)


def _rows(order: torch.Tensor, c: int) -> torch.Tensor:
    """Row index of chunk permutation ``order`` for chunks of ``c`` rows."""
    return (order[:, None] * c + torch.arange(c, device=order.device)).reshape(-1)


def ulysses_attention(q, k, v, cp: ContextParallel, local, sinks=None) -> torch.Tensor:
    """a2a (module doc): [s_local, b, heads, d] shards -> [s_local, b, heads * d_v], attention run by
    ``local(q, k, v, sinks=...)`` on [s, b, heads / cp, d] in sequence order."""
    s_local, b, heads = q.shape[:3]
    q, k, v = (_SeqToHeads.apply(t, cp, True) for t in (q, k, v))
    rows = _rows(_sequence_order(cp, q.device), s_local // 2)
    q, k, v = (t.index_select(0, rows) for t in (q, k, v))
    out = local(q, k, v) if sinks is None else local(q, k, v, sinks=_head_slice(sinks, cp))
    out = out.view(*q.shape[:3], -1).index_select(0, torch.argsort(rows))
    return _SeqToHeads.apply(out, cp, False).reshape(s_local, b, -1)


def hierarchical_attention(q, k, v, cp: ContextParallel, mask: AttentionMask, scale=None, sinks=None):
    """a2a+p2p (module doc): all-to-all inside ``cp.inner``, ring attention across ``cp.outer``."""
    s_local, b = q.shape[:2]
    q, k, v = (_SeqToHeads.apply(t, cp.inner, True) for t in (q, k, v))
    out = ring_attention(q, k, v, cp.outer, mask, scale, _head_slice(sinks, cp.inner))
    out = out.view(*q.shape[:3], -1)
    return _SeqToHeads.apply(out, cp.inner, False).reshape(s_local, b, -1)


def context_attention(q, k, v, cp: ContextParallel, mask: AttentionMask, local, scale=None, sinks=None):
    """Attention of this rank's sequence shard by the layer's --cp-comm-type: ``local(q, k, v, sinks)`` is
    the non-parallel attention (mask and scale bound, sinks by keyword) that a2a runs on its head shard."""
    if cp.comm_type == "a2a":
        return ulysses_attention(q, k, v, cp, local, sinks)
    if cp.comm_type == "a2a+p2p":
        return hierarchical_attention(q, k, v, cp, mask, scale, sinks)
    if cp.comm_type == "allgather":
        return allgather_attention(q, k, v, cp, mask, scale, sinks)
    return ring_attention(q, k, v, cp, mask, scale, sinks)
