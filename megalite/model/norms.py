"""The normalisation layers (RMSNorm, LayerNorm, with Megatron's zero-centred gamma) and build_norm."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config.schema import ModelConfig
from megalite.model.kernels import rms_norm
from megalite.parallel.param_meta import mark
from megalite.parallel.tensor.layers import TensorParallel


class _ZeroCenteredWeight:
    """--apply-layernorm-1p (Megatron's zero-centred gamma): the parameter holds gamma - 1, starts at 0 and
    the norm scales by weight + 1, so weight decay and low-precision storage act around 0, not 1."""

    def _init_weight(self, hidden_size: int, dtype: torch.dtype, zero_centered: bool) -> None:
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.full((hidden_size,), 0.0 if zero_centered else 1.0, dtype=dtype))
        mark(self.weight, is_norm_weight=True,
             norm_init_value=0.0 if zero_centered else 1.0)     # what initialisation fills it with

    def scale(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered else self.weight


class RMSNorm(_ZeroCenteredWeight, nn.Module):
    """RMSNorm keeping its input and an fp32 1/rms per row for backward, on every device (kernels.rms_norm)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self._init_weight(hidden_size, dtype, zero_centered)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.scale(), self.eps)


class LayerNorm(_ZeroCenteredWeight, nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self._init_weight(hidden_size, dtype, zero_centered)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.scale(), self.bias, self.eps)


def build_norm(config: ModelConfig, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
    """Norms are replicated over TP; under sequence parallelism each rank normalises its own sequence
    shard, so their gradients are partial and get summed over TP after backward."""
    norm = (RMSNorm if config.normalization == "RMSNorm" else LayerNorm)(config.hidden_size, config.norm_epsilon, dtype,
                                                                        config.apply_layernorm_1p)
    for param in norm.parameters():
        mark(param, sequence_parallel=tp.sequence_parallel)
    return norm
