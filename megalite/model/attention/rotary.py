"""RotaryEmbedding: the cos/sin tables of rotary position embeddings (RoPE); kernels.apply_rotary applies them."""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE in the rotate-half convention (as Hugging Face Llama).

    --rotary-percent p < 1 (partial rotary, Megatron and HF ``partial_rotary_factor``): the tables cover
    the first int(head_dim * p) dimensions of each head, with frequencies over that many; apply_rotary
    rotates those and passes the rest through."""

    def __init__(self, head_dim: int, base: float, max_positions: int, rotary_percent: float = 1.0):
        super().__init__()
        dim = int(head_dim * rotary_percent)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)             # [positions, rotary dim]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def tables(self, positions: torch.Tensor | None, seq_len: int, dtype: torch.dtype):
        """[s, 1, 1, d] tables for positions 0..seq_len-1, or for explicit ``positions`` [s]."""
        cos, sin = (self.cos[:seq_len], self.sin[:seq_len]) if positions is None else \
            (self.cos[positions], self.sin[positions])
        return cos.to(dtype)[:, None, None, :], sin.to(dtype)[:, None, None, :]

    def batch_tables(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """[s, b, 1, d] tables for each sample's own positions ``position_ids`` [b, s]."""
        index = position_ids.t().to(self.cos.device)
        return self.cos[index].to(dtype)[:, :, None, :], self.sin[index].to(dtype)[:, :, None, :]
