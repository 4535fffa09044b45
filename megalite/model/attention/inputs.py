"""AttentionInputs: what every attention call of one forward pass shares, built once per forward by the
model and handed down through the layers (and their recomputation) to each attention module."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionInputs:
    """``rotary``: the (cos, sin) RoPE tables, [s, 1, 1, d] for positions shared by every sample or
    [s, b, 1, d] for the batch's own positions (--reset-position-ids); None without RoPE.

    ``cu_seqlens``: the batch's document boundaries, int32 [b, n + 1] (MaskSpec.cu_seqlens); None when the
    whole sample is one document. Per sample, never split by context parallelism: its positions index the
    whole sequence."""
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None
    cu_seqlens: torch.Tensor | None = None
