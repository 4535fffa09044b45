"""RotaryEmbedding: the cos/sin tables of rotary position embeddings (RoPE), optionally extended by YaRN;
kernels.apply_rotary applies them."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Yarn:
    """YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"), Megatron's and Hugging Face's
    parametrisation. Of the rotary frequencies w_i = base^(-2i/d):
    - those turning more than ``beta_fast`` times over ``original_max_positions`` keep w_i (extrapolated);
    - those turning fewer than ``beta_slow`` times become w_i / ``factor`` (interpolated);
    - in between a linear ramp over i mixes the two. The ramp's ends are the dimensions
      d ln(L / (2 pi beta)) / (2 ln base) for beta = beta_fast, beta_slow (L = original_max_positions),
      rounded outwards when ``truncate``, clipped to [0, d-1].
    cos and sin are multiplied by the attention factor m(mscale) / m(mscale_all_dim), m(x) = 0.1 x ln(factor)
    + 1 (1 when factor <= 1), so every q.k is scaled by its square."""
    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    @classmethod
    def from_config(cls, config) -> "Yarn":
        """The YaRN of a ModelConfig with --position-embedding-type yarn."""
        return cls(config.rotary_scaling_factor,
                   config.yarn_original_max_position_embeddings or config.max_position_embeddings,
                   config.yarn_beta_fast, config.yarn_beta_slow, config.mscale, config.mscale_all_dim,
                   config.yarn_correction_range_round_to_int)

    def m(self, x: float) -> float:
        """m(x) = 0.1 x ln(factor) + 1 (1 when factor <= 1): the attention scale of an mscale x."""
        return 1.0 if self.factor <= 1 else 0.1 * x * math.log(self.factor) + 1.0

    def attention_factor(self) -> float:
        return self.m(self.mscale) / self.m(self.mscale_all_dim)

    def inv_freq(self, inv_freq: torch.Tensor, dim: int, base: float) -> torch.Tensor:
        """The plain frequencies [dim/2] (fp32) -> YaRN's."""
        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))
        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001                                   # a ramp of width 0: a step
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp                                     # 1: extrapolate (keep w_i), 0: interpolate
        return inv_freq / self.factor * (1 - keep) + inv_freq * keep


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE in the rotate-half convention (as Hugging Face Llama).

    --rotary-percent p < 1 (partial rotary, Megatron and HF ``partial_rotary_factor``): the tables cover
    the first int(head_dim * p) dimensions of each head, with frequencies over that many; apply_rotary
    rotates those and passes the rest through. ``yarn``: the frequencies and scale of YaRN (``Yarn``)."""

    def __init__(self, head_dim: int, base: float, max_positions: int, rotary_percent: float = 1.0,
                 yarn: Yarn | None = None):
        super().__init__()
        dim = int(head_dim * rotary_percent)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        if yarn is not None:
            inv_freq = yarn.inv_freq(inv_freq, dim, base)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)             # [positions, rotary dim]
        cos, sin = angles.cos(), angles.sin()
        if yarn is not None:
            cos, sin = cos * yarn.attention_factor(), sin * yarn.attention_factor()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, positions: torch.Tensor | None, seq_len: int, dtype: torch.dtype):
        """[s, 1, 1, d] tables for positions 0..seq_len-1, or for explicit ``positions`` [s]."""
        cos, sin = (self.cos[:seq_len], self.sin[:seq_len]) if positions is None else \
            (self.cos[positions], self.sin[positions])
        return cos.to(dtype)[:, None, None, :], sin.to(dtype)[:, None, None, :]

    def batch_tables(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """[s, b, 1, d] tables for each sample's own positions ``position_ids`` [b, s]."""
        index = position_ids.t().to(self.cos.device)
        return self.cos[index].to(dtype)[:, :, None, :], self.sin[index].to(dtype)[:, :, None, :]
