"""core_attention: softmax(q k^T scale + mask) v on the backend that fits the call, and whether selective
recomputation of it pays.

Backends, in the order they are chosen:
- context parallelism (``cp``): the layer's --cp-comm-type, parallel/context/ulysses.py (the ring's fused
  blocks merged by log-sum-exp, or Ulysses' all-to-all around this function's own path);
- a mask that is not plain (documents, a window) or attention sinks: masked.py (varlen flash attention on
  CUDA, fused blocks merged by log-sum-exp elsewhere), in O(block) memory;
- the meta device (no storage): the shapes and saved tensors of a fused kernel;
- scaled_dot_product_attention, which runs a fused kernel (CPU flash, CUDA flash or memory-efficient)
  or its math path; K/V stay grouped where the kernel takes them so (GQA), else are expanded first.

An attention module (self_attention.py, or one with its own projections) hands its heads over as
q [s, b, heads, d_qk], k [t, b, groups, d_qk], v [t, b, groups, d_v] and gets [s, b, heads * d_v] back.
K and V may have different head dims (DeepSeek's multi-latent attention: 192 / 128); ``scale`` defaults
to 1/sqrt(d_qk).
"""
from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import torch
import torch.nn.functional as F

from megalite.model.attention.mask import MaskSpec
from megalite.model.attention.masked import masked_attention
from megalite.model.kernels import attention_on_meta, compiling, sdpa_runs_fused, sdpa_runs_gqa_fused
from megalite.parallel.context.block_kernels import equal_head_dims
from megalite.parallel.context.ring_attention import ContextParallel
from megalite.parallel.context.ulysses import context_attention
from megalite.parallel.tensor.random import RNGTracker, checkpoint


def core_attention(q, k, v, mask: MaskSpec, *, scale: float | None = None, dropout: float = 0.0,
                   cp: ContextParallel | None = None, rng: RNGTracker | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """[s, b, heads, d_qk] queries, [t, b, groups, d_qk] keys, [t, b, groups, d_v] values -> [s, b, heads * d_v].

    t > s only with a KV cache: the queries are the last s of t positions. ``dropout``: attention dropout
    (0 outside training), drawn from ``rng``'s stream: heads are sharded over TP, so each rank draws its own.

    GQA runs on the unexpanded K/V (``enable_gqa``), so backward keeps [t, b, groups, d], not a copy
    repeated to every query head. The kernel's output keeps heads and features adjacent (CPU: in q's
    [s, b, heads, d] layout; CUDA flash: [b, s, heads, d]), so the reshape for the output projection is a
    view and the kernel's saved output is also the projection's saved input.

    ``sinks``: fp32 [heads], one logit per query head added to the softmax denominator (no value).
    Masks that are not plain and sinks take no attention dropout.
    """
    if cp is not None:
        return context_attention(q, k, v, cp, mask, partial(core_attention, mask=mask, scale=scale), scale=scale,
                                 sinks=sinks)
    if sinks is not None or not mask.plain:
        if dropout > 0:
            raise ValueError("attention dropout with documents, a window or sinks: set --attention-dropout 0")
        return masked_attention(q, k, v, mask, scale=scale, sinks=sinks)
    s, b, heads = q.shape[:3]
    d_v = v.shape[-1]
    if d_v != q.shape[-1] and scale is None:
        scale = q.shape[-1] ** -0.5             # before any zero-padding of q's head dim
    q, k, v, bias, causal, gqa = _sdpa_inputs(q, k, v, mask, dropout)
    if gqa and not sdpa_runs_gqa_fused(q, k, v, bias, dropout, causal):
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
        gqa = False
    if q.device.type == "meta":
        out = attention_on_meta(q, k, v, bias, dropout, causal, scale)
    else:
        with rng.fork() if dropout > 0 and rng is not None else nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal, dropout_p=dropout,
                                                 enable_gqa=gqa, scale=scale)
    if out.shape[-1] != d_v:
        out = out[..., :d_v]
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * d_v)


def _sdpa_inputs(q, k, v, mask: MaskSpec, dropout: float):
    """SDPA's [b, heads, s, d] views of q, k, v, its boolean mask (or None), is_causal and whether K/V are
    grouped. Causal with t > s keys (a KV cache) is the mask aligned to the last key; one query sees all.

    V's head dim unlike Q's and K's (multi-latent attention): the fused kernels take one head dim, so the
    three are zero-padded to the larger where a fused kernel then runs (zero features add nothing to
    q k^T, and the output's padding is cut off); the math path, which keeps the s x s scores, only where
    none would."""
    s, total = q.shape[0], k.shape[0]
    bias = None
    if mask.causal and s > 1 and total > s:
        bias = torch.ones(s, total, dtype=torch.bool, device=q.device).tril(total - s)
    causal = mask.causal and total == s
    gqa = k.shape[2] != q.shape[2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if v.shape[-1] != q.shape[-1]:
        padded = equal_head_dims(q, k, v)
        if sdpa_runs_fused(*padded, bias, dropout, causal, gqa):
            q, k, v = padded
    return q, k, v, bias, causal, gqa


def recomputing_pays(q, k, v, mask: MaskSpec, *, dropout: float, cp: ContextParallel | None,
                     sinks: torch.Tensor | None = None) -> bool:
    """Whether recomputing core_attention in backward (selective recomputation) keeps less than running
    it once. The recomputed region keeps q, the unexpanded k and v (its inputs) and the output (the
    output projection's input); so do ring attention and SDPA's fused kernels on grouped K/V, plus a
    log-sum-exp: recomputing them would only run their forward twice. It pays for SDPA's math path,
    which keeps the s x s scores (CPU with attention dropout; CUDA where no fused kernel takes the
    call, padded or not), and for K/V expanded to every query head for a kernel that cannot take them
    grouped (CUDA's memory-efficient kernel, e.g. in fp32), which that kernel keeps expanded. Masked
    attention (masked.py) keeps what the fused kernels keep."""
    if cp is not None or sinks is not None or not mask.plain:
        return False
    q, k, v, bias, causal, gqa = _sdpa_inputs(q, k, v, mask, dropout)
    if gqa and not sdpa_runs_gqa_fused(q, k, v, bias, dropout, causal):
        return True
    return not sdpa_runs_fused(q, k, v, bias, dropout, causal, gqa)


def run_core_attention(q, k, v, mask: MaskSpec, *, scale: float | None = None, dropout: float = 0.0,
                       cp: ContextParallel | None = None, rng: RNGTracker | None = None,
                       selective_recompute: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """core_attention, recomputed in backward when ``selective_recompute`` (--recompute-granularity
    selective, in training) asks for it and it pays. Eager, megalite's checkpoint replays ``rng``'s
    streams so dropout draws the same masks; compiled, it is traced as a recomputed region of the graph
    (no RNG stream to replay: --compile runs selective recomputation with attention dropout eager)."""
    attend = partial(core_attention, mask=mask, scale=scale, dropout=dropout, cp=cp, rng=rng, sinks=sinks)
    if not (selective_recompute and recomputing_pays(q, k, v, mask, dropout=dropout, cp=cp, sinks=sinks)):
        return attend(q, k, v)
    if compiling():
        return torch.utils.checkpoint.checkpoint(attend, q, k, v, use_reentrant=False)
    return checkpoint(attend, q, k, v, tracker=rng)
