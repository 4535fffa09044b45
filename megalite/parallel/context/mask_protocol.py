"""What context-parallel attention asks of an attention mask description (the model's MaskSpec).

parallel/ sits below model/, so the ring takes the mask by its behaviour: ``relation(sample, (q0, q1),
(k0, k1))`` answers, for queries at global sequence positions [q0, q1) of ``sample`` and keys at [k0, k1),
one of the strings below or the bool [q1 - q0, k1 - k0] mask (True: the query sees the key) of a block
that a window or a document boundary cuts. Positions count in the sample's whole, unsharded sequence.
"""
from __future__ import annotations

from typing import Protocol

import torch

EMPTY = "empty"          # no query of the block sees any key: no kernel runs
FULL = "full"            # every query sees every key
CAUSAL = "causal"        # a diagonal block cut by causality alone


class AttentionMask(Protocol):
    causal: bool

    @property
    def plain(self) -> bool:
        """Causal or full over the whole sequence: no window, no documents."""

    def relation(self, sample: int, q: tuple[int, int], k: tuple[int, int]) -> str | torch.Tensor:
        """How the queries at positions ``q`` of ``sample`` see the keys at ``k`` (module docstring)."""

    def same_for_every_sample(self) -> bool:
        """Whether every sample of the batch has the same mask (no per-sample documents)."""
