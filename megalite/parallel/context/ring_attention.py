"""Ring attention over the context-parallel group, with causal load balancing.

The sequence is cut into 2 x cp chunks of equal length c; CP rank i holds chunks i and 2cp-1-i, so every
rank does the same amount of causal work. Each rank keeps its queries and passes its keys/values
around the ring: at step j it holds the KV of rank (i - j) mod cp, computes the attention of its two
query chunks against that rank's two KV chunks (full block when the query chunk comes later in the
sequence, causal block on the diagonal, nothing when it comes earlier) while the next KV block is
already in flight (batched isend/irecv), and merges the partial outputs with their log-sum-exp.

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
fp32 log-sum-exp [b, heads, s_local].
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.parallel.context.block_kernels import block_backward, block_forward


@dataclass
class ContextParallel:
    """This rank's place in its context-parallel group (size 1: whole sequences, plain attention)."""
    group: object = None
    rank: int = 0
    size: int = 1
    ranks: tuple = field(default_factory=tuple)     # global ranks of the group, in CP-rank order

    def chunk_ids(self, rank: int | None = None) -> tuple[int, int]:
        rank = self.rank if rank is None else rank
        return rank, 2 * self.size - 1 - rank


def build_context_parallel(state) -> ContextParallel:
    """The ContextParallel of this rank from a ParallelState."""
    if state.cp_size == 1:
        return ContextParallel()
    group = state.group("cp")
    return ContextParallel(group, state.cp_rank, state.cp_size, tuple(dist.get_process_group_ranks(group)))


def local_positions(full_seq: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Sequence positions of the tokens CP rank ``cp_rank`` holds: chunks r and 2cp-1-r of 2cp."""
    c = full_seq // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def slice_for_context_parallel(batch: dict, cp_rank: int, cp_size: int) -> dict:
    """This CP rank's two chunks of every sample's tokens, labels, loss mask and positions ([b, s])."""
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
# Tensors stay in the caller's [s_local, b, heads, d] layout; a block is a [b, heads, c, d] view of one
# chunk of them (the kernels take any strides with a contiguous last dimension).
def _chunk(x: torch.Tensor, slot: int) -> torch.Tensor:
    """Chunk ``slot`` (0 or 1) of an [s_local, b, heads, d] tensor as a [b, heads, c, d] view."""
    c = x.shape[0] // 2
    return x[slot * c:(slot + 1) * c].permute(1, 2, 0, 3)


def _lse_chunk(lse: torch.Tensor, slot: int) -> torch.Tensor:
    """Chunk ``slot`` of a [b, heads, s_local] log-sum-exp (a view)."""
    c = lse.shape[-1] // 2
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


def _pairs(mine: tuple[int, int], theirs: tuple[int, int], causal: bool):
    """(query chunk slot, kv chunk slot, causal) of the blocks between this rank's query chunks ``mine``
    and the KV chunks ``theirs``. Causal: full where the query chunk comes later, causal on the diagonal,
    none where it comes earlier. Without the causal mask every block is full."""
    for qi in range(2):
        for ki in range(2):
            if mine[qi] > theirs[ki] or not causal:
                yield qi, ki, False
            elif mine[qi] == theirs[ki]:
                yield qi, ki, True


def _attend(q, kv: KVBlock, blocks, out, lse, filled: list, scale: float) -> None:
    """Merge the blocks of ``q`` [s_local, b, heads, d] against ``kv`` into the fp32 accumulators ``out``
    [s_local, b, heads, d_v] and ``lse`` [b, heads, s_local]; ``filled[slot]`` says whether that query
    chunk has a partial result yet."""
    for qi, ki, causal in blocks:
        o, l = block_forward(_chunk(q, qi), _chunk(kv.k, ki), _chunk(kv.v, ki), causal, scale)
        acc, acc_lse = _chunk(out, qi), _lse_chunk(lse, qi)
        if not filled[qi]:
            acc.copy_(o)
            acc_lse.copy_(l)
            filled[qi] = True
            continue
        merged = torch.logaddexp(acc_lse, l)
        acc.mul_(torch.exp(acc_lse - merged).unsqueeze(-1)).add_(o.float() * torch.exp(l - merged).unsqueeze(-1))
        acc_lse.copy_(merged)


def _attend_backward(grad_out, q, kv: KVBlock, out, lse, blocks, dq, dkv: KVBlock, scale: float) -> None:
    """Add the blocks' gradients to ``dq`` [s_local, b, heads, d] and ``dkv`` (fp32), given the final
    ``out`` and ``lse`` of the queries and the gradient ``grad_out`` of out."""
    for qi, ki, causal in blocks:
        dq_b, dk_b, dv_b = block_backward(_chunk(grad_out, qi), _chunk(q, qi), _chunk(kv.k, ki), _chunk(kv.v, ki),
                                          _chunk(out, qi), _lse_chunk(lse, qi), causal, scale)
        _chunk(dq, qi).add_(dq_b)
        _chunk(dkv.k, ki).add_(dk_b)
        _chunk(dkv.v, ki).add_(dv_b)


def _exchange(send: KVBlock, recv: KVBlock, cp: ContextParallel):
    """Send to the next CP rank, receive from the previous one (asynchronous)."""
    nxt = cp.ranks[(cp.rank + 1) % cp.size]
    prv = cp.ranks[(cp.rank - 1) % cp.size]
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send.flat, nxt, cp.group),
                                   dist.P2POp(dist.irecv, recv.flat, prv, cp.group)])


def _wait(requests) -> None:
    for req in requests:
        req.wait()


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, causal: bool, scale: float):
        s, b, nh = q.shape[:3]
        d_v = v.shape[-1]
        out = torch.empty(s, b, nh, d_v, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, nh, s, dtype=torch.float32, device=q.device)
        filled = [False, False]
        current = KVBlock.of(k, v)
        for step in range(cp.size):
            src = (cp.rank - step) % cp.size
            requests = []
            if step < cp.size - 1:
                incoming = current.new()
                requests = _exchange(current, incoming, cp)                       # prefetch the next block
            _attend(q, current, _pairs(cp.chunk_ids(), cp.chunk_ids(src), causal), out, lse, filled, scale)
            if requests:
                _wait(requests)
                current = incoming
        result = out.view(s, b, nh * d_v).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.cp, ctx.causal, ctx.scale = cp, causal, scale
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, result, lse = ctx.saved_tensors
        cp, causal, scale = ctx.cp, ctx.causal, ctx.scale
        s, b, nh, d = q.shape
        d_v = v.shape[-1]
        grad_out, out = grad_out.reshape(s, b, nh, d_v), result.view(s, b, nh, d_v)
        dq = torch.zeros(s, b, nh, d, dtype=torch.float32, device=q.device)
        current = KVBlock.of(k, v)
        travelling = None               # (requests, sent, received) of the dK/dV accumulator in flight
        for step in range(cp.size):
            src = (cp.rank - step) % cp.size
            requests = []
            if step < cp.size - 1:
                incoming = current.new()
                requests = _exchange(current, incoming, cp)
            dkv = current.new(torch.float32, zeros=True)
            _attend_backward(grad_out, q, current, out, lse, _pairs(cp.chunk_ids(), cp.chunk_ids(src), causal), dq,
                             dkv, scale)
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
        dk, dv = (g.to(k.dtype) for g in (travelling[2].k, travelling[2].v))
        return dq.to(q.dtype), dk, dv, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel, *, causal: bool = True,
                   scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's [s_local, b, heads, d] queries over the whole sequence, causal or full.

    ``k`` is [s_local, b, kv groups, d], ``v`` [s_local, b, kv groups, d_v]; s_local holds this rank's two
    chunks (see module doc). ``scale`` multiplies q k^T (default 1/sqrt(d)). A mask beyond causal (document
    boundaries, a sliding window) enters through ``_pairs``, which picks each block's mask from the
    chunks' sequence positions. Returns [s_local, b, heads * d_v]."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return RingAttention.apply(q, k, v, cp, causal, scale)
