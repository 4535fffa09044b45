"""MaskSpec: which keys each query of an attention call may see, given to every attention backend.

The mask is a description, never an s x s tensor: each backend asks it about the blocks it computes
(``relation``) and builds at most one block's mask at a time, so memory stays O(block), not O(s^2).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


class Relation:
    """How the queries of a block see its keys, when no per-element mask is needed."""
    EMPTY = "empty"        # no query sees any key: the block is skipped
    FULL = "full"          # every query sees every key
    CAUSAL = "causal"      # the block is on the diagonal (same positions) and only causality cuts it


@dataclass(frozen=True)
class MaskSpec:
    """``causal``: query i of s sees keys 0..t-s+i of t (aligned to the last key: with a KV cache the s
    queries are the last s of t positions; t = s in training). Without it every query sees every key.

    ``window``: Megatron's ``--window-size (left, right)`` as flash attention counts it: query i sees keys
    i - left .. i + right, -1 meaning unbounded on that side (with ``causal`` the right side is 0).

    ``cu_seqlens``: per-sample document boundaries, int32 [b, n + 1], each row the cumulative document
    lengths 0 = c_0 < c_1 < ... ending at s and padded by repeating s (rows differ in their number of
    documents). A query sees only keys of its own document (--reset-attention-mask). None: one document.

    Positions here are indices into the whole (unsharded) sequence of a sample: a context-parallel
    backend asks about the global positions of the chunks it holds.
    """
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    cu_seqlens: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """Causal or full over the whole sequence, no window and no documents: every kernel takes it."""
        return self.window == (-1, -1) and self.cu_seqlens is None

    def with_documents(self, cu_seqlens: torch.Tensor | None) -> MaskSpec:
        return replace(self, cu_seqlens=cu_seqlens)

    # ---- the questions a backend asks -----------------------------------------------------------
    def document_ids(self, sample: int, positions: torch.Tensor) -> torch.Tensor:
        """The document index of each of ``positions`` in ``sample`` (0 without documents)."""
        if self.cu_seqlens is None:
            return torch.zeros_like(positions)
        cu = self.cu_seqlens[sample].to(positions.device, torch.int64)
        return torch.searchsorted(cu, positions, right=True) - 1

    def visible(self, sample: int, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """bool [len(q), len(k)]: whether each query sees each key."""
        d = q_positions[:, None] - k_positions[None, :]          # query position minus key position
        ok = torch.ones(d.shape, dtype=torch.bool, device=d.device)
        left, right = self.window
        if self.causal:
            ok &= d >= 0
        elif right >= 0:
            ok &= d >= -right
        if left >= 0:
            ok &= d <= left
        if self.cu_seqlens is not None:
            ok &= self.document_ids(sample, q_positions)[:, None] == self.document_ids(sample, k_positions)[None, :]
        return ok

    def relation(self, sample: int, q: tuple[int, int], k: tuple[int, int]) -> str | torch.Tensor:
        """How queries at positions [q0, q1) of ``sample`` see keys at [k0, k1): a Relation, or the bool
        [q1 - q0, k1 - k0] mask of a block that the window or a document boundary cuts."""
        (q0, q1), (k0, k1) = q, k
        left = self.window[0]
        span = self.span_relation(q, k)
        if span == Relation.EMPTY:
            return Relation.EMPTY
        docs = None
        if self.cu_seqlens is not None:
            ends = torch.tensor([q0, q1 - 1, k0, k1 - 1], device=self.cu_seqlens.device)
            docs = self.document_ids(sample, ends).tolist()
            if docs[3] < docs[0] or docs[2] > docs[1]:
                return Relation.EMPTY
        one_document = docs is None or len(set(docs)) == 1
        if one_document and span == Relation.FULL:
            return Relation.FULL
        if one_document and self.causal and (q0, q1) == (k0, k1) and (left < 0 or left >= q1 - q0 - 1):
            return Relation.CAUSAL
        device = self.cu_seqlens.device if self.cu_seqlens is not None else None
        return self.visible(sample, torch.arange(q0, q1, device=device), torch.arange(k0, k1, device=device))

    def span_relation(self, q: tuple[int, int], k: tuple[int, int]) -> str | None:
        """EMPTY or FULL where causality and the window alone decide how queries at positions [q0, q1) see
        keys at [k0, k1) (documents aside), else None: a question of positions only, no tensor read."""
        (q0, q1), (k0, k1) = q, k
        left, right = self.window
        right = 0 if self.causal else right
        if (right >= 0 and k0 > q1 - 1 + right) or (left >= 0 and k1 - 1 < q0 - left):
            return Relation.EMPTY
        if (left < 0 or k0 >= q1 - 1 - left) and (right < 0 or k1 - 1 <= q0 + right):
            return Relation.FULL
        return None

    def same_for_every_sample(self) -> bool:
        """Whether every sample of the batch has the same mask (no per-sample documents)."""
        return self.cu_seqlens is None


def documents_of(cu_seqlens_row: torch.Tensor) -> list[tuple[int, int]]:
    """The (start, end) of each document of one padded ``cu_seqlens`` row, empty padding dropped."""
    bounds = torch.unique_consecutive(cu_seqlens_row.to(torch.int64)).tolist()
    return list(zip(bounds[:-1], bounds[1:]))
