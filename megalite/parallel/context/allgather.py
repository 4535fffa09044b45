"""All-gather context parallelism (--cp-comm-type allgather): every rank gathers the whole sequence's
keys and values, then attends its own queries to them.

Each CP rank holds the load-balanced chunks r and 2cp-1-r of its queries, keys and values (as for the
ring, ring_attention.py). Forward all-gathers K and V over the CP group in one collective, so a rank
receives (cp - 1)/cp of the whole sequence's K/V, and runs the ring's blocks with no communication
between them: its two query chunks against every rank's two KV chunks, in the ring's order (its own KV
first), each pair asked of the attention mask by global positions. Blocks the mask empties run no
kernel, blocks it cuts take its bool mask (per sample for per-sample documents), and the partial outputs
merge by log-sum-exp in the same fp32 accumulators; sinks merge once at the end.

Memory: the gathered K/V [cp x s_local] lives for the duration of the layer's forward (and again in
backward), plus the ring's O(block) temporaries. Nothing beyond what the ring keeps is saved for
backward: backward all-gathers K/V again, accumulates dK/dV for the whole gathered sequence in fp32 and
reduce-scatters it, so each rank gets the summed gradients of the K/V it owns. Each all-gather is in
flight while the rank attends its own K/V (the ring's first step needs nothing from other ranks); the
reduce-scatter follows the last block, with nothing to hide behind.
"""
from __future__ import annotations

import math

import torch

from megalite.parallel import collectives
from megalite.parallel.context.mask_protocol import AttentionMask
from megalite.parallel.context.ring_attention import (ContextParallel, KVBlock, _attend, _attend_backward, _step_blocks,
                                                      accumulators, finish_backward, finish_forward, start_backward)


def _kv_steps(own: KVBlock, cp: ContextParallel):
    """(step, source CP rank, its KVBlock) in the ring's order, step j holding the KV of rank (rank - j) mod
    size: this rank's own K/V first, attended while the all-gather of every rank's is in flight, then views
    of the gathered buffer (freed when the steps are done)."""
    whole = own.flat.new_empty(cp.size * own.flat.numel())
    work = collectives.all_gather_single(whole, own.flat, group=cp.group, async_op=True)
    yield 0, cp.rank, own
    work.wait()
    kv = _views(whole, own, cp.size)
    for step in range(1, cp.size):
        src = (cp.rank - step) % cp.size
        yield step, src, kv[src]


def _views(whole: torch.Tensor, like: KVBlock, ranks: int) -> list[KVBlock]:
    """``whole`` [ranks x like's size] as one KVBlock of ``like``'s shapes per rank."""
    size = like.flat.numel()
    return [KVBlock(whole[r * size:(r + 1) * size], like.k.shape, like.v.shape) for r in range(ranks)]


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cp: ContextParallel, mask: AttentionMask, scale: float):
        out, lse, filled = accumulators(q, v, cp, mask)
        for step, _, kv in _kv_steps(KVBlock.of(k, v), cp):
            _attend(q, kv, _step_blocks(cp, mask, step, q), out, lse, filled, scale)
        return finish_forward(ctx, q, k, v, sinks, out, lse, (cp, mask, scale))

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, sinks, out, lse, grad_out, dq, (cp, mask, scale) = start_backward(ctx, grad_out)
        own = KVBlock.of(k, v)
        dkv_whole = torch.zeros(cp.size * own.flat.numel(), dtype=torch.float32, device=q.device)
        dkv = _views(dkv_whole, own, cp.size)
        for step, src, kv in _kv_steps(own, cp):     # K/V gathered again rather than kept from forward
            blocks = _step_blocks(cp, mask, step, q)
            _attend_backward(grad_out, q, kv, out, lse, blocks, dq, dkv[src], scale, len(cp.chunk_ids()))
        mine = dkv[0].new()
        collectives.reduce_scatter_single(mine.flat, dkv_whole, group=cp.group)
        return finish_backward(q, k, sinks, out, lse, grad_out, dq, mine)


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel, mask: AttentionMask,
                        scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """ring_attention's contract (same shards, mask, scale and sinks; [s_local, b, heads * d_v] out), with
    K/V all-gathered instead of passed around the ring (module doc)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return AllGatherAttention.apply(q, k, v, sinks, cp, mask, scale)
