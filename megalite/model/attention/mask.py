"""MaskSpec: which keys each query of an attention call may see, given to every attention backend."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MaskSpec:
    """The attention mask as a description, not a tensor: each backend builds what its kernel takes.

    ``causal``: query i of s sees keys 0..t-s+i of t (aligned to the last key: with a KV cache the s
    queries are the last s of t positions; t = s in training). Without it every query sees every key.

    How the next masks plug in, each as a field here that every backend of core_attention either honours
    or refuses (core.py picks the backend; the ring in parallel/context takes what it honours):
    - per-document boundaries: ``cu_seqlens`` (int32 [documents + 1], cumulative lengths of the packed
      sequence): CPU runs the flash kernel per document block, CUDA
      torch.nn.attention.varlen.varlen_attn(cu_seqlens_q, cu_seqlens_k, ...); the ring drops the blocks
      whose chunks share no document and masks the ones that straddle a boundary;
    - a sliding window ``(left, right)`` in tokens (-1: unbounded), which varlen_attn takes as well and
      which the ring turns into skipped or masked blocks by the chunks' positions;
    - learned sinks: per-head logits [heads] added to the softmax denominator (a parameter of the
      attention module, passed with the mask since it changes the normaliser, not the scores).
    """
    causal: bool = True
