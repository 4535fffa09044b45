"""Attention for masks that are not plain causal (documents, sliding windows) and for attention sinks,
in O(block) memory: no s x s tensor is ever built.

``masked_attention`` picks the kernel:
- the meta device (no storage): the fused kernel's shapes (attention_on_meta);
- CUDA, fp16/bf16, no sinks: torch's ``varlen_attn`` (flash attention on the packed [tokens, heads, d]
  layout), with the batch's documents flattened into one cu_seqlens and the window passed as its own;
- everywhere else ``BlockwiseAttention``: the queries and keys of each sample are cut into tiles, each
  (query tile, key tile) pair asks ``MaskSpec.relation`` how the tile sees the other, empty pairs are
  skipped and the others run the fused block kernels of parallel/context/block_kernels.py (causal for a
  diagonal block, a bool mask for a block a window or a document boundary cuts), their partial outputs
  merged by log-sum-exp into fp32 accumulators of one query tile at a time. Backward reruns the same
  pairs with the final output and log-sum-exp, as flash attention does; only q, k, v, the output and
  the log-sum-exp are kept for it.

Tiles follow the documents: each document is a tile of its own (one causal flash call on its diagonal),
cut into near-equal pieces of at most ``TILE`` tokens where it is longer (its diagonal blocks causal,
the others full), so a block's partial output stays TILE rows; with a window the pieces are at most
``WINDOW_TILE`` tokens, which bounds a cut block's mask and lets whole pairs outside the window be
skipped. Consecutive documents shorter than ``PACK`` tokens share tiles of at most PACK tokens (one
small block with a block-diagonal mask instead of many tiny calls). No other tile spans a document
boundary, so the pairs of tiles of different documents are skipped without a look. Samples without
documents share one mask: every tile runs the whole batch at once.

Sinks (GPT-OSS; Megatron's ``--softmax-type off-by-one`` is a fixed logit 0, ``learnable`` a parameter):
one fp32 logit per query head in the softmax denominator that carries no value. With the unsunk
output O and log-sum-exp L of a row, the sunk output is O * sigmoid(L - sink) and its log-sum-exp
logaddexp(L, sink); backward is the ordinary one on those final values (the probabilities the kernel
recomputes from the final log-sum-exp already leave the sink's share out), and the sink's gradient is
-sum over batch and queries of p_sink * rowsum(dO * O), with p_sink = exp(sink - log-sum-exp).
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Iterator

import torch

from megalite.model.attention.mask import MaskSpec, Relation, documents_of
from megalite.model.kernels import attention_on_meta
from megalite.parallel.context.block_kernels import block_backward, block_forward

TILE = 1024                     # the most tokens of a tile: the CPU flash kernel slows down on shorter blocks
WINDOW_TILE = 512               # ... with a window, whose cut blocks each carry a mask of this size squared
PACK = 64                       # documents shorter than this share tiles of at most this many tokens


@dataclass
class Tile:
    """One query tile of some samples and the key tiles it sees: (key range, Relation or bool mask)."""
    samples: slice
    q: tuple[int, int]
    blocks: list[tuple[tuple[int, int], str | torch.Tensor]]


def boundaries(mask: MaskSpec, sample: int, t: int) -> list[int]:
    """The tile boundaries 0 = b_0 < ... = t of one sample's t key positions (see the module docstring)."""
    docs = documents_of(mask.cu_seqlens[sample]) if mask.cu_seqlens is not None else [(0, t)]
    left, right = mask.window
    size = WINDOW_TILE if left >= 0 or (right >= 0 and not mask.causal) else TILE
    bounds = [0]
    for start, end in docs:
        if end - start < PACK:                      # joins the open tile of very short documents if it fits
            if end - bounds[-1] > PACK:
                bounds.append(start)
            continue
        if bounds[-1] < start:                      # close the open tile of very short documents
            bounds.append(start)
        pieces = -(-(end - start) // size)
        bounds += [start + (end - start) * i // pieces for i in range(1, pieces + 1)]
    if bounds[-1] < t:
        bounds.append(t)
    return bounds


def tiles(mask: MaskSpec, s: int, t: int, batch: int) -> Iterator[Tile]:
    """Every query tile of the batch with the key tiles it sees. The s queries are the last s of the t
    key positions (t > s with a KV cache)."""
    offset = t - s
    shared = mask.same_for_every_sample()
    for sample in range(1 if shared else batch):
        samples = slice(None) if shared else slice(sample, sample + 1)
        bounds = boundaries(mask, sample, t)
        docs = [0, t] if mask.cu_seqlens is None else sorted(set(mask.cu_seqlens[sample].tolist()) | {0, t})
        q_bounds = [offset] + [x for x in bounds if x > offset]
        for q0, q1 in zip(q_bounds, q_bounds[1:]):
            lo, hi = docs[bisect_right(docs, q0) - 1], docs[bisect_right(docs, q1 - 1)]   # their documents' span
            blocks = []
            for k0, k1 in zip(bounds, bounds[1:]):
                if k1 <= lo or k0 >= hi:
                    continue
                relation = mask.relation(sample, (q0, q1), (k0, k1))
                if not (isinstance(relation, str) and relation == Relation.EMPTY):
                    blocks.append(((k0, k1), relation))
            yield Tile(samples, (q0, q1), blocks)


def _block_args(relation, device) -> tuple[bool, torch.Tensor | None]:
    """block_forward's (causal, mask) for a relation, the mask on the kernel's device."""
    if isinstance(relation, str):
        return relation == Relation.CAUSAL, None
    return False, relation.to(device)


def _heads_view(x: torch.Tensor) -> torch.Tensor:
    """[s, b, heads, d] -> the kernels' [b, heads, s, d] view."""
    return x.permute(1, 2, 0, 3)


def _forward_tile(tile: Tile, q, k, v, out, lse, sinks, scale: float, offset: int) -> None:
    """Merge the blocks of one query tile into ``out`` [b, heads, s, d_v] and ``lse`` [b, heads, s]."""
    rows = slice(tile.q[0] - offset, tile.q[1] - offset)
    q_t, out_t, lse_t = q[tile.samples, :, rows], out[tile.samples, :, rows], lse[tile.samples, :, rows]
    acc = acc_lse = None
    for (k0, k1), relation in tile.blocks:
        causal, mask = _block_args(relation, q.device)
        o, l = block_forward(q_t, k[tile.samples, :, k0:k1], v[tile.samples, :, k0:k1], causal, scale, mask)
        if acc is None:
            if len(tile.blocks) == 1 and sinks is None:
                out_t.copy_(o)
                lse_t.copy_(l)
                return
            acc = out_t if out.dtype == torch.float32 else torch.empty(o.shape, dtype=torch.float32, device=o.device)
            acc.copy_(o)
            acc_lse = l.clone()
        else:
            merged = torch.logaddexp(acc_lse, l)
            ref = merged.masked_fill(merged == float("-inf"), 0.0)      # rows no block has reached yet stay 0
            acc.mul_(torch.exp(acc_lse - ref).unsqueeze(-1)).addcmul_(o, torch.exp(l - ref).unsqueeze(-1))
            acc_lse = merged
        del o                                       # one block's output alive at a time
    if acc is None:                                 # no key visible to any query of the tile
        out_t.zero_()
        acc_lse = torch.full(lse_t.shape, float("-inf"), device=lse.device)
    if sinks is not None:
        total = torch.logaddexp(acc_lse, sinks.view(1, -1, 1))
        if acc is not None:
            acc.mul_(torch.exp(acc_lse - total).unsqueeze(-1))
        acc_lse = total
    if acc is not None and acc is not out_t:
        out_t.copy_(acc)
    lse_t.copy_(acc_lse)


def _backward_tile(tile: Tile, grad, q, k, v, out, lse, grads, scale: float, offset: int) -> None:
    """Add one query tile's blocks' gradients to ``grads`` = (dq, dk, dv) (fp32, the kernels' views)."""
    rows, at = slice(tile.q[0] - offset, tile.q[1] - offset), tile.samples
    dq, dk, dv = grads
    q_t, g_t, o_t, l_t = q[at, :, rows], grad[at, :, rows], out[at, :, rows], lse[at, :, rows]
    for (k0, k1), relation in tile.blocks:
        causal, mask = _block_args(relation, q.device)
        dq_b, dk_b, dv_b = block_backward(g_t, q_t, k[at, :, k0:k1], v[at, :, k0:k1], o_t, l_t, causal, scale, mask)
        dq[at, :, rows].add_(dq_b)
        dk[at, :, k0:k1].add_(dk_b)
        dv[at, :, k0:k1].add_(dv_b)


def _sink_grad(tile: Tile, grad, out, lse, sinks, offset: int) -> torch.Tensor:
    """[heads]: this tile's share of -sum p_sink * rowsum(dO * O)."""
    rows = slice(tile.q[0] - offset, tile.q[1] - offset)
    g_t, o_t, l_t = grad[tile.samples, :, rows], out[tile.samples, :, rows], lse[tile.samples, :, rows]
    p_sink = torch.exp(sinks.view(1, -1, 1) - l_t)
    return -(p_sink * (g_t.float() * o_t.float()).sum(-1)).sum(dim=(0, 2))


class BlockwiseAttention(torch.autograd.Function):
    """q [s, b, heads, d], k [t, b, groups, d], v [t, b, groups, d_v], sinks fp32 [heads] or None ->
    [s, b, heads * d_v], tile by tile (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, mask: MaskSpec, scale: float):
        s, b, heads = q.shape[:3]
        t, d_v = k.shape[0], v.shape[-1]
        result = torch.empty(s, b, heads * d_v, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, heads, s, dtype=torch.float32, device=q.device)
        out = _heads_view(result.view(s, b, heads, d_v))
        sink = None if sinks is None else sinks.detach().float()
        views = [_heads_view(x) for x in (q, k, v)]
        for tile in tiles(mask, s, t, b):
            _forward_tile(tile, *views, out, lse, sink, scale, t - s)
        ctx.save_for_backward(q, k, v, result, lse, sinks)
        ctx.mask, ctx.scale = mask, scale
        return result

    @staticmethod
    def backward(ctx, grad_result):
        q, k, v, result, lse, sinks = ctx.saved_tensors
        s, b, heads = q.shape[:3]
        t, d_v = k.shape[0], v.shape[-1]
        grad = _heads_view(grad_result.contiguous().view(s, b, heads, d_v))
        out = _heads_view(result.view(s, b, heads, d_v))
        raw = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (q, k, v)]
        grads = [_heads_view(g) for g in raw]
        views = [_heads_view(x) for x in (q, k, v)]
        dsinks = None if sinks is None else torch.zeros(heads, dtype=torch.float32, device=q.device)
        for tile in tiles(ctx.mask, s, t, b):
            _backward_tile(tile, grad, *views, out, lse, grads, ctx.scale, t - s)
            if dsinks is not None and ctx.needs_input_grad[3]:
                dsinks += _sink_grad(tile, grad, out, lse, sinks.detach().float(), t - s)
        dq, dk, dv = (g.to(x.dtype) for g, x in zip(raw, (q, k, v)))
        return dq, dk, dv, None if dsinks is None else dsinks.to(sinks.dtype), None, None


def _varlen_runs(q, k, v, sinks) -> bool:
    """Whether torch's varlen flash kernel takes the call: CUDA fp16/bf16, t = s, one head dim, no sinks."""
    return (sinks is None and q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and k.shape[0] == q.shape[0] and v.shape[-1] == q.shape[-1])


def flat_cu_seqlens(mask: MaskSpec, s: int, batch: int, device) -> tuple[torch.Tensor, int]:
    """int32 cu_seqlens over the batch's samples laid end to end (padding dropped), and the longest
    document: varlen_attn's form of the per-sample rows."""
    if mask.cu_seqlens is None:
        return torch.arange(0, (batch + 1) * s, s, dtype=torch.int32, device=device), s
    rows = mask.cu_seqlens.to(device, torch.int64) + s * torch.arange(batch, device=device)[:, None]
    flat = torch.unique_consecutive(rows.flatten())
    return flat.to(torch.int32), int(flat.diff().max())


def _varlen(q, k, v, mask: MaskSpec, scale: float | None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn
    s, b, heads = q.shape[:3]
    cu, longest = flat_cu_seqlens(mask, s, b, q.device)
    packed = [x.transpose(0, 1).reshape(b * s, *x.shape[2:]) for x in (q, k, v)]
    left, right = mask.window
    window = (left, 0 if mask.causal else right)
    out = varlen_attn(*packed, cu, cu, longest, longest, scale=scale, window_size=window,
                      enable_gqa=k.shape[2] != heads)
    return out.view(b, s, heads * v.shape[-1]).transpose(0, 1)


def masked_attention(q, k, v, mask: MaskSpec, *, scale: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """core_attention for a mask that is not plain or with sinks: [s, b, heads, d_qk] queries,
    [t, b, groups, d_qk] keys, [t, b, groups, d_v] values -> [s, b, heads * d_v]."""
    s, b, heads = q.shape[:3]
    if q.device.type == "meta":
        views = [_heads_view(x) for x in (q, k, v)]
        out = attention_on_meta(*views, None, 0.0, mask.causal, scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * v.shape[-1])
    if _varlen_runs(q, k, v, sinks):
        return _varlen(q, k, v, mask, scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return BlockwiseAttention.apply(q, k, v, sinks, mask, scale)
