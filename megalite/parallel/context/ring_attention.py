"""Ring attention over the context-parallel group, with causal load balancing.

The sequence is cut into 2 x cp chunks of equal length; CP rank i holds chunks i and 2cp-1-i, so every
rank does the same amount of causal work. Each rank keeps its queries and passes its keys/values
around the ring: at step j it holds the KV of rank (i - j) mod cp, computes the attention of its two
query chunks against that rank's two KV chunks (full block when the query chunk comes later in the
sequence, causal block on the diagonal, nothing when it comes earlier) while the next KV block is
already in flight (batched isend/irecv), and merges the partial outputs with their log-sum-exp.

Backward recomputes each block's probabilities from the saved log-sum-exp (as flash attention):
the KV blocks travel the ring again together with their gradient accumulators, dQ stays local, and
after cp steps every dK/dV accumulator has arrived back at the rank that owns those keys and values.
Blocks are computed with explicit math in fp32 (SDPA on CPU does not return the log-sum-exp).

What is kept for backward is what flash attention keeps: q, the unexpanded GQA k and v, in their own
dtype (the fp32 working copies and the per-block repeats to every query head are rebuilt in backward),
the output (the very tensor returned, which the output projection saves as its input too) and the
fp32 log-sum-exp.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


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
# GQA without repeating K/V: the queries of one KV group are laid out [b, groups, s, heads_per_group, d],
# so a chunk of c positions is a [b, groups, c * heads_per_group, d] block whose rows (position i,
# head j) all attend to the group's [b, groups, c, d] keys. dK and dV then sum over the group's heads
# inside the matmuls.
def _causal_mask(c: int, heads_per_group: int, device) -> torch.Tensor:
    """[c * heads_per_group, c], True where masked out: row (i, j) sees keys 0..i."""
    return torch.ones(c, c, dtype=torch.bool, device=device).triu_(1).repeat_interleave(heads_per_group, dim=0)


def _block_forward(q, k, v, scale: float, mask):
    """q [b, g, rows, d], k, v [b, g, c, d] fp32 -> (softmax(qk^T) v [b, g, rows, d], lse [b, g, rows])."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores.masked_fill_(mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs, v), lse


def _block_backward(q, k, v, d_out, lse, delta, scale: float, mask):
    """Gradients (dq, dk, dv) of one block given the final output's lse and delta = rowsum(dO * O)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores.masked_fill_(mask, float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-1, -2), d_out)
    dprobs = torch.matmul(d_out, v.transpose(-1, -2))
    dscores = probs * (dprobs - delta.unsqueeze(-1))
    dq = torch.matmul(dscores, k).mul_(scale)
    dk = torch.matmul(dscores.transpose(-1, -2), q).mul_(scale)
    return dq, dk, dv


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[s, b, heads, d] -> fp32 [b, groups, s, heads_per_group, d] (contiguous)."""
    s, b, nh, d = x.shape
    return x.reshape(s, b, groups, nh // groups, d).permute(1, 2, 0, 3, 4).float().contiguous()


def _ungrouped(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[b, groups, s, heads_per_group, d] -> [s, b, heads * d] in ``dtype`` (a new tensor)."""
    b, g, s, hpg, d = x.shape
    return x.permute(2, 0, 1, 3, 4).reshape(s, b, g * hpg * d).to(dtype)


def _exchange(send: torch.Tensor, recv: torch.Tensor, cp: ContextParallel):
    """Send to the next CP rank, receive from the previous one (asynchronous)."""
    nxt = cp.ranks[(cp.rank + 1) % cp.size]
    prv = cp.ranks[(cp.rank - 1) % cp.size]
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, cp.group),
                                   dist.P2POp(dist.irecv, recv, prv, cp.group)])


def _wait(requests) -> None:
    for req in requests:
        req.wait()


def _pairs(cp: ContextParallel, src: int):
    """(query chunk slot, kv chunk slot, causal) for the blocks this rank computes against ``src``'s KV."""
    mine, theirs = cp.chunk_ids(), cp.chunk_ids(src)
    for qi in range(2):
        for ki in range(2):
            if mine[qi] > theirs[ki]:
                yield qi, ki, False
            elif mine[qi] == theirs[ki]:
                yield qi, ki, True


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel):
        s, b, nh, d = q.shape
        ng = k.shape[2]
        hpg, c, scale = nh // ng, s // 2, 1.0 / math.sqrt(d)
        qf = _grouped(q, ng)                                                      # [b, ng, s, hpg, d]
        kv = torch.stack([k, v]).permute(0, 2, 3, 1, 4).float().contiguous()      # [2, b, ng, s, d]
        mask = _causal_mask(c, hpg, q.device)
        out, lse = [None, None], [None, None]
        current = kv
        for step in range(cp.size):
            src = (cp.rank - step) % cp.size
            requests = []
            if step < cp.size - 1:
                incoming = torch.empty_like(current)
                requests = _exchange(current, incoming, cp)                       # prefetch the next block
            for qi, ki, causal in _pairs(cp, src):
                ks = slice(ki * c, (ki + 1) * c)
                o, l = _block_forward(qf[:, :, qi * c:(qi + 1) * c].reshape(b, ng, c * hpg, d),
                                      current[0][:, :, ks], current[1][:, :, ks], scale, mask if causal else None)
                if out[qi] is None:
                    out[qi], lse[qi] = o, l
                else:
                    merged = torch.logaddexp(lse[qi], l)
                    out[qi] = out[qi] * torch.exp(lse[qi] - merged).unsqueeze(-1) + \
                        o * torch.exp(l - merged).unsqueeze(-1)
                    lse[qi] = merged
            if requests:
                _wait(requests)
                current = incoming
        out = torch.cat(out, dim=2).view(b, ng, s, hpg, d)
        lse = torch.cat(lse, dim=2)                                               # [b, ng, s * hpg]
        result = _ungrouped(out, q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.cp = cp
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, result, lse = ctx.saved_tensors
        cp = ctx.cp
        s, b, nh, d = q.shape
        ng = k.shape[2]
        hpg, c, scale = nh // ng, s // 2, 1.0 / math.sqrt(d)
        rows = c * hpg
        qf = _grouped(q, ng)
        kv = torch.stack([k, v]).permute(0, 2, 3, 1, 4).float().contiguous()      # [2, b, ng, s, d]
        d_out = _grouped(grad_out.reshape(s, b, nh, d), ng)
        delta = (d_out * _grouped(result.view(s, b, nh, d), ng)).sum(dim=-1).view(b, ng, s * hpg)
        mask = _causal_mask(c, hpg, q.device)
        dq = torch.zeros_like(qf)
        current, dkv = kv, torch.zeros_like(kv)
        for step in range(cp.size):
            src = (cp.rank - step) % cp.size
            requests = []
            if step < cp.size - 1:
                incoming = torch.empty_like(current)
                requests = _exchange(current, incoming, cp)
            for qi, ki, causal in _pairs(cp, src):
                qs, ks, rs = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c), slice(qi * rows, (qi + 1) * rows)
                dq_b, dk_b, dv_b = _block_backward(qf[:, :, qs].reshape(b, ng, rows, d), current[0][:, :, ks],
                                                   current[1][:, :, ks], d_out[:, :, qs].reshape(b, ng, rows, d),
                                                   lse[:, :, rs], delta[:, :, rs], scale, mask if causal else None)
                dq[:, :, qs] += dq_b.view(b, ng, c, hpg, d)
                dkv[0][:, :, ks] += dk_b
                dkv[1][:, :, ks] += dv_b
            if requests:                       # the next KV block (prefetched during this step's math)
                _wait(requests)
                current = incoming
            # this block's dK/dV accumulator moves on with it; the last hop returns it to its owner
            received = torch.empty_like(dkv)
            _wait(_exchange(dkv, received, cp))
            dkv = received
        dq = dq.permute(2, 0, 1, 3, 4).reshape(s, b, nh, d).to(q.dtype)
        dk, dv = (g.permute(2, 0, 1, 3).to(k.dtype) for g in dkv)
        return dq, dk, dv, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Causal attention of this rank's [s_local, b, heads, d] queries over the whole sequence.

    ``k``/``v`` are [s_local, b, kv groups, d]; s_local holds this rank's two chunks (see module doc).
    Returns [s_local, b, heads * d]."""
    return RingAttention.apply(q, k, v, cp)
