"""Ring attention over the context-parallel group, with causal load balancing.

The sequence is cut into 2 x cp chunks of equal length c; CP rank i holds chunks i and 2cp-1-i, so every
rank does the same amount of causal work. Each rank keeps its queries and passes its keys/values
around the ring: at step j it holds the KV of rank (i - j) mod cp, computes the attention of its two
query chunks against that rank's two KV chunks (full block when the query chunk comes later in the
sequence, causal block on the diagonal, nothing when it comes earlier) while the next KV block is
already in flight (batched isend/irecv), and merges the partial outputs with their log-sum-exp.

The ring asks the attention mask (mask_protocol.py) how each (query chunk, KV chunk) pair relates, by
the chunks' global positions: a document may cross chunk boundaries and a window may reach back over
several chunks. Pairs the mask empties run no kernel; pairs it cuts pass its bool block mask to the
kernels, per sample when samples have documents of their own; plain causal is the full / diagonal /
nothing choice above. Attention sinks (one logit per head in every softmax denominator) are merged
once, after every block, by log-sum-exp. Under a2a+p2p (ulysses.py) a rank holds the chunks of its
all-to-all group, 2 per member, and the ring runs across those groups.

Each block runs a fused attention kernel that returns its log-sum-exp (block_kernels.py: the CPU flash
kernel, flash or memory-efficient attention on CUDA), so no block materialises its c x c scores: a step
holds O(c) memory (the travelling KV block, fp32 output and log-sum-exp accumulators, one block's
output). Backward runs the matching backward kernel per block with the final output and log-sum-exp, as
flash attention's ring does: the KV blocks travel the ring again, dQ stays local, and each KV block's
dK/dV accumulator travels one hop behind it, sent asynchronously at the end of a step and received while
the next block is computed, so that after cp steps it has arrived back at the rank that owns those keys
and values.

What is kept for backward is what flash attention keeps: q, the unexpanded GQA k and v, in their own
dtype, the output (the very tensor returned, which the output projection saves as its input too) and the
fp32 log-sum-exp [b, heads, s_local] (and the sinks).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from megalite.parallel.context.block_kernels import block_backward, block_forward
from megalite.parallel.context.mask_protocol import CAUSAL, EMPTY, AttentionMask


@dataclass
class ContextParallel:
    """This rank's place in its context-parallel group (size 1: whole sequences, plain attention).

    ``chunks``: the sequence chunk ids each rank of the group holds, in the order its tensors hold them
    (empty: the load-balanced pair r, 2 size - 1 - r of 2 size chunks). ``comm_type``: how this layer's
    attention crosses the group (--cp-comm-type: p2p, a2a, a2a+p2p, allgather); ``comm_types``: every
    layer's choice (one value: all layers).
    ``inner`` / ``outer``: for a2a+p2p, the all-to-all group of consecutive CP ranks and the ring across
    those groups (ulysses.py)."""
    group: object = None
    rank: int = 0
    size: int = 1
    ranks: tuple = field(default_factory=tuple)     # global ranks of the group, in CP-rank order
    chunks: tuple = ()
    comm_type: str = "p2p"
    comm_types: tuple = ("p2p",)
    inner: "ContextParallel | None" = None
    outer: "ContextParallel | None" = None

    def chunk_ids(self, rank: int | None = None) -> tuple[int, ...]:
        rank = self.rank if rank is None else rank
        return self.chunks[rank] if self.chunks else (rank, 2 * self.size - 1 - rank)

    def for_layer(self, layer_number: int) -> "ContextParallel":
        """This group as layer ``layer_number`` (1-based) uses it: that layer's comm type."""
        kinds = self.comm_types
        return replace(self, comm_type=kinds[(layer_number - 1) if len(kinds) > 1 else 0])


def a2a_group_size(parallel) -> int | None:
    """The all-to-all group size of --cp-comm-type a2a+p2p in a ParallelConfig (None when no layer uses it)."""
    if parallel.context_parallel_size == 1 or "a2a+p2p" not in parallel.cp_comm_type:
        return None
    return parallel.hierarchical_context_parallel_sizes[0]


def build_context_parallel(state, comm_types: tuple = ("p2p",),
                           hierarchical: tuple | None = None) -> ContextParallel:
    """The ContextParallel of this rank from a ParallelState, with every layer's --cp-comm-type
    ``comm_types`` and, for a2a+p2p, the sub-groups of --hierarchical-context-parallel-sizes
    ``hierarchical`` (a2a size, ring size) that the state created."""
    if state.cp_size == 1:
        return ContextParallel()
    group = state.group("cp")
    inner = outer = None
    if "a2a+p2p" in comm_types:
        a, rings = hierarchical
        inner_group, outer_group = state.group("cp_a2a"), state.group("cp_ring")
        inner = ContextParallel(inner_group, state.cp_rank % a, a, tuple(dist.get_process_group_ranks(inner_group)))
        outer = ContextParallel(outer_group, state.cp_rank // a, rings, tuple(dist.get_process_group_ranks(outer_group)),
                                chunks=tuple(sum((ContextParallel(size=state.cp_size).chunk_ids(g * a + m)
                                                  for m in range(a)), ()) for g in range(rings)))
    return ContextParallel(group, state.cp_rank, state.cp_size, tuple(dist.get_process_group_ranks(group)),
                           comm_types=tuple(comm_types), inner=inner, outer=outer)


def local_positions(full_seq: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Sequence positions of the tokens CP rank ``cp_rank`` holds: chunks r and 2cp-1-r of 2cp."""
    c = full_seq // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


# [b, s, ...] per-sample sequences; the mtp_ ones are multi-token prediction's [b, s, D] (model/mtp.py)
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "mtp_tokens", "mtp_labels", "mtp_loss_mask")


def slice_for_context_parallel(batch: dict, cp_rank: int, cp_size: int) -> dict:
    """This CP rank's two chunks of every sample's tokens, labels, loss mask and positions ([b, s]), and
    of the multi-token prediction inputs and targets made from whole sequences ([b, s, D])."""
    if cp_size == 1:
        return batch
    out = dict(batch)
    for key in SEQUENCE_KEYS:
        t = batch.get(key)
        if t is None:
            continue
        b, s = t.shape[0], t.shape[1]
        chunks = t.reshape(b, 2 * cp_size, s // (2 * cp_size), *t.shape[2:])
        first, second = cp_rank, 2 * cp_size - 1 - cp_rank
        out[key] = torch.cat([chunks[:, first], chunks[:, second]], dim=1)
    return out


def context_parallel_loss(per_token: torch.Tensor, loss_mask: torch.Tensor, cp: ContextParallel | None):
    """(mean loss over the whole sequences, token count) for a micro-batch of which this rank holds a part.

    The value is the full-sequence masked mean on every CP rank. Its gradient is that of this rank's
    share x cp: the data-parallel reduction sums over dp x cp ranks and divides by dp x cp, so the
    summed shares give exactly the full-sequence gradient."""
    local = (per_token * loss_mask).sum()
    num_tokens = loss_mask.sum()
    if cp is None or cp.size == 1:
        return local / num_tokens.clamp(min=1.0), num_tokens
    stats = torch.stack([local.detach(), num_tokens.detach()])
    dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=cp.group)
    total = stats[1].clamp(min=1.0)
    share = local * (cp.size / total)
    full = stats[0] / total
    return share + (full - share).detach(), stats[1]


# ---- blocks ---------------------------------------------------------------------------------------
# Tensors stay in the caller's [s_local, b, heads, d] layout, which holds n equal chunks (two on a plain
# ring); a block is a [b, heads, c, d] view of one chunk of them, or of one sample's rows of it (the
# kernels take any strides with a contiguous last dimension).
def _chunk(x: torch.Tensor, slot: int, n: int = 2) -> torch.Tensor:
    """Chunk ``slot`` of the ``n`` of an [s_local, b, heads, d] tensor as a [b, heads, c, d] view."""
    c = x.shape[0] // n
    return x[slot * c:(slot + 1) * c].permute(1, 2, 0, 3)


def _lse_chunk(lse: torch.Tensor, slot: int, n: int = 2) -> torch.Tensor:
    """Chunk ``slot`` of the ``n`` of a [b, heads, s_local] log-sum-exp (a view)."""
    c = lse.shape[-1] // n
    return lse[..., slot * c:(slot + 1) * c]


class KVBlock:
    """One rank's keys and values (or their gradients) as contiguous views ``k`` [s_local, b, groups, d] and
    ``v`` [s_local, b, groups, d_v] of one flat buffer, so one message carries both whatever their head dims."""

    def __init__(self, flat: torch.Tensor, k_shape: torch.Size, v_shape: torch.Size):
        self.flat = flat
        split = k_shape.numel()
        self.k, self.v = flat[:split].view(k_shape), flat[split:].view(v_shape)

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor) -> "KVBlock":
        return cls(torch.cat([k.reshape(-1), v.reshape(-1)]), k.shape, v.shape)

    def new(self, dtype: torch.dtype | None = None, zeros: bool = False) -> "KVBlock":
        """A block of the same shapes, uninitialised or zero, in ``dtype`` (default: this one's)."""
        make = torch.zeros if zeros else torch.empty
        flat = make(self.flat.shape, dtype=dtype or self.flat.dtype, device=self.flat.device)
        return KVBlock(flat, self.k.shape, self.v.shape)


@dataclass(frozen=True)
class Block:
    """Query chunk slot ``qi`` against KV chunk slot ``ki``, for the batch rows ``rows``: ``causal`` on the
    diagonal, else full unless ``mask`` (bool [c, c], True: the query sees the key) cuts it."""
    qi: int
    ki: int
    rows: slice
    causal: bool
    mask: torch.Tensor | None = None


def _blocks(mask: AttentionMask, mine: tuple[int, ...], theirs: tuple[int, ...], c: int, batch: int):
    """The Blocks between this rank's query chunks ``mine`` and the KV chunks ``theirs`` (chunk ids: chunk t
    covers sequence positions [t c, (t + 1) c)), asking ``mask`` about each pair, per sample when samples
    have masks of their own; blocks the mask empties are left out. Plain causal: full where the query
    chunk comes later, causal on the diagonal, none where it comes earlier."""
    samples = [slice(None)] if mask.same_for_every_sample() else [slice(i, i + 1) for i in range(batch)]
    for qi, q_chunk in enumerate(mine):
        for ki, k_chunk in enumerate(theirs):
            for rows in samples:
                relation = mask.relation(rows.start or 0, (q_chunk * c, (q_chunk + 1) * c),
                                         (k_chunk * c, (k_chunk + 1) * c))
                if isinstance(relation, torch.Tensor):
                    yield Block(qi, ki, rows, False, relation)
                elif relation != EMPTY:
                    yield Block(qi, ki, rows, relation == CAUSAL)


def _attend(q, kv: KVBlock, blocks, out, lse, filled: list, scale: float) -> None:
    """Merge the blocks of ``q`` [s_local, b, heads, d] against ``kv`` into the fp32 accumulators ``out``
    [s_local, b, heads, d_v] and ``lse`` [b, heads, s_local]; ``filled[slot]`` says whether that query
    chunk has a partial result yet (always, for a mask beyond plain: its accumulators start at 0 and -inf,
    as rows that have seen no key yet must)."""
    n = len(filled)
    for blk in blocks:
        o, l = block_forward(_chunk(q, blk.qi, n)[blk.rows], _chunk(kv.k, blk.ki, n)[blk.rows],
                             _chunk(kv.v, blk.ki, n)[blk.rows], blk.causal, scale, blk.mask)
        acc, acc_lse = _chunk(out, blk.qi, n)[blk.rows], _lse_chunk(lse, blk.qi, n)[blk.rows]
        if not filled[blk.qi]:
            acc.copy_(o)
            acc_lse.copy_(l)
            filled[blk.qi] = True
            continue
        merged = torch.logaddexp(acc_lse, l)
        # rows that have seen no key on either side stay (0, -inf) instead of exp(-inf - -inf) = nan; where
        # merged is finite (always, for plain causal) base is merged, bit for bit
        base = merged.masked_fill(merged == -math.inf, 0.0)
        acc.mul_(torch.exp(acc_lse - base).unsqueeze(-1)).add_(o.float() * torch.exp(l - base).unsqueeze(-1))
        acc_lse.copy_(merged)


def _attend_backward(grad_out, q, kv: KVBlock, out, lse, blocks, dq, dkv: KVBlock, scale: float, n: int = 2) -> None:
    """Add the blocks' gradients to ``dq`` [s_local, b, heads, d] and ``dkv`` (fp32), given the final
    ``out`` and ``lse`` of the queries and the gradient ``grad_out`` of out."""
    for blk in blocks:
        r = blk.rows
        dq_b, dk_b, dv_b = block_backward(_chunk(grad_out, blk.qi, n)[r], _chunk(q, blk.qi, n)[r],
                                          _chunk(kv.k, blk.ki, n)[r], _chunk(kv.v, blk.ki, n)[r],
                                          _chunk(out, blk.qi, n)[r], _lse_chunk(lse, blk.qi, n)[r], blk.causal, scale,
                                          blk.mask)
        _chunk(dq, blk.qi, n)[r].add_(dq_b)
        _chunk(dkv.k, blk.ki, n)[r].add_(dk_b)
        _chunk(dkv.v, blk.ki, n)[r].add_(dv_b)


def _exchange(send: KVBlock, recv: KVBlock, cp: ContextParallel):
    """Send to the next CP rank, receive from the previous one (asynchronous)."""
    nxt = cp.ranks[(cp.rank + 1) % cp.size]
    prv = cp.ranks[(cp.rank - 1) % cp.size]
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send.flat, nxt, cp.group),
                                   dist.P2POp(dist.irecv, recv.flat, prv, cp.group)])


def _wait(requests) -> None:
    for req in requests:
        req.wait()


def _step_blocks(cp: ContextParallel, mask: AttentionMask, step: int, q: torch.Tensor) -> list:
    """The Blocks of ring step ``step``: this rank's queries against the KV of rank (rank - step) mod size."""
    mine = cp.chunk_ids()
    return list(_blocks(mask, mine, cp.chunk_ids((cp.rank - step) % cp.size), q.shape[0] // len(mine), q.shape[1]))


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Add one sink logit per head (``sinks`` [heads], fp32) to the softmax denominator of the merged ``out``
    [s, b, heads, d_v] (scaled in place by sigmoid(lse - sink)) and return the new log-sum-exp
    logaddexp(lse, sink) of ``lse`` [b, heads, s]. The sink carries no value."""
    sink = sinks.float().view(1, -1, 1)
    out.mul_(torch.sigmoid(lse - sink).permute(2, 0, 1).unsqueeze(-1))
    return torch.logaddexp(lse, sink)


def sinks_grad(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks over these queries: -sum p_sink rowsum(dO * O), p_sink = exp(sink - lse) with the
    final (sink-merged) ``lse`` [b, heads, s]; ``grad_out`` and ``out`` are [s, b, heads, d_v]. Each CP rank
    returns its queries' share; the data-parallel reduction over dp x cp sums the shares, as for every
    replicated weight."""
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
    rowsum = (grad_out.float() * out.float()).sum(-1).permute(1, 2, 0)
    return -(p_sink * rowsum).sum(dim=(0, 2)).to(sinks.dtype)


# ---- what ring and all-gather attention share around their blocks ---------------------------------
def accumulators(q: torch.Tensor, v: torch.Tensor, cp: ContextParallel, mask: AttentionMask):
    """(out [s_local, b, heads, d_v], lse [b, heads, s_local], filled) fp32 accumulators for _attend. A plain
    mask gives every query chunk a block at the first step (its own diagonal), so they start unset; any
    other starts at (0, -inf), as rows that have seen no key yet must."""
    s, b, nh = q.shape[:3]
    d_v, n = v.shape[-1], len(cp.chunk_ids())
    if mask.plain:
        out = torch.empty(s, b, nh, d_v, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, nh, s, dtype=torch.float32, device=q.device)
        return out, lse, [False] * n
    out = torch.zeros(s, b, nh, d_v, dtype=torch.float32, device=q.device)
    lse = torch.full((b, nh, s), -math.inf, dtype=torch.float32, device=q.device)
    return out, lse, [True] * n


def finish_forward(ctx, q, k, v, sinks, out, lse, context: tuple) -> torch.Tensor:
    """Merge the sinks into the accumulated ``out`` / ``lse``, keep what backward needs (``context``: the
    ContextParallel, mask and scale) and return the [s_local, b, heads * d_v] output in q's dtype."""
    s, b, nh, d_v = out.shape
    if sinks is not None:
        lse = merge_sinks(out, lse, sinks)
    result = out.view(s, b, nh * d_v).to(q.dtype)
    ctx.save_for_backward(q, k, v, sinks, result, lse)
    ctx.cp, ctx.mask, ctx.scale = context
    return result


def start_backward(ctx, grad_out):
    """(q, k, v, sinks, out, lse, grad_out, dq, (cp, mask, scale)) from what finish_forward kept: out and
    grad_out as [s_local, b, heads, d_v], dq a zero fp32 accumulator."""
    q, k, v, sinks, result, lse = ctx.saved_tensors
    s, b, nh, d = q.shape
    d_v = v.shape[-1]
    grad_out, out = grad_out.reshape(s, b, nh, d_v), result.view(s, b, nh, d_v)
    dq = torch.zeros(s, b, nh, d, dtype=torch.float32, device=q.device)
    return q, k, v, sinks, out, lse, grad_out, dq, (ctx.cp, ctx.mask, ctx.scale)


def finish_backward(q, k, sinks, out, lse, grad_out, dq, dkv: KVBlock) -> tuple:
    """The autograd gradients (q, k, v, sinks, then None for cp, mask, scale) given this rank's own ``dkv``."""
    dk, dv = (g.to(k.dtype) for g in (dkv.k, dkv.v))
    dsinks = None if sinks is None else sinks_grad(grad_out, out, lse, sinks)
    return dq.to(q.dtype), dk, dv, dsinks, None, None, None


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cp: ContextParallel, mask: AttentionMask, scale: float):
        out, lse, filled = accumulators(q, v, cp, mask)
        current = KVBlock.of(k, v)
        for step in range(cp.size):
            requests = []
            if step < cp.size - 1:
                incoming = current.new()
                requests = _exchange(current, incoming, cp)                       # prefetch the next block
            _attend(q, current, _step_blocks(cp, mask, step, q), out, lse, filled, scale)
            if requests:
                _wait(requests)
                current = incoming
        return finish_forward(ctx, q, k, v, sinks, out, lse, (cp, mask, scale))

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, sinks, out, lse, grad_out, dq, (cp, mask, scale) = start_backward(ctx, grad_out)
        n = len(cp.chunk_ids())
        current = KVBlock.of(k, v)
        travelling = None               # (requests, sent, received) of the dK/dV accumulator in flight
        for step in range(cp.size):
            requests = []
            if step < cp.size - 1:
                incoming = current.new()
                requests = _exchange(current, incoming, cp)
            dkv = current.new(torch.float32, zeros=True)
            _attend_backward(grad_out, q, current, out, lse, _step_blocks(cp, mask, step, q), dq, dkv, scale, n)
            if travelling is not None:  # what the ranks before this one added to this KV block's gradients
                _wait(travelling[0])
                dkv.flat += travelling[2].flat
            # moves on with the KV block while the next block is computed; the last hop returns it to its owner
            received = dkv.new()
            travelling = (_exchange(dkv, received, cp), dkv, received)
            if requests:
                _wait(requests)
                current = incoming
        _wait(travelling[0])
        return finish_backward(q, k, sinks, out, lse, grad_out, dq, travelling[2])


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel, mask: AttentionMask,
                   scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of this rank's [s_local, b, heads, d] queries over the whole sequence, as ``mask`` allows.

    ``k`` is [s_local, b, kv groups, d], ``v`` [s_local, b, kv groups, d_v]; s_local holds this rank's
    chunks ``cp.chunk_ids()`` (see module doc). ``mask`` (mask_protocol.py) is asked about every pair of
    chunks by their global positions: blocks it empties run nothing, blocks it cuts take its bool mask.
    ``scale`` multiplies q k^T (default 1/sqrt(d)); ``sinks`` ([heads] logits, or None) join every query's
    softmax denominator. Returns [s_local, b, heads * d_v]."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return RingAttention.apply(q, k, v, sinks, cp, mask, scale)
