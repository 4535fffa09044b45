"""Attention: the modules that project heads (chosen by ModelConfig.attention_type) and core_attention,
which runs softmax(q k^T scale + mask) v on the backend that fits (core.py).

An attention module is built as ``cls(config, dtype, tp, cp, layer_number)`` (the 1-based layer number
picks the layer's window, ModelConfig.attention_window) and called as
``module(x, inputs, kv_cache, layer_number)`` on [s, b, hidden] -> [s, b, hidden], ``inputs`` the
forward's AttentionInputs (RoPE tables, document boundaries: inputs.py); it owns its projections and
hands q, k, v to core.run_core_attention with its MaskSpec (its window, the batch's documents), its
sinks and scale. A new variant is
one module file and one line in ATTENTION.
"""
from __future__ import annotations

import torch
from torch import nn

from megalite.config.schema import ModelConfig
from megalite.model.attention.mla import MultiLatentAttention
from megalite.model.attention.self_attention import SelfAttention
from megalite.parallel.context.ring_attention import ContextParallel
from megalite.parallel.tensor.layers import TensorParallel

ATTENTION = {"self": SelfAttention, "mla": MultiLatentAttention}     # ModelConfig.attention_type -> module class


def build_attention(config: ModelConfig, dtype: torch.dtype, tp: TensorParallel,
                    cp: ContextParallel | None = None, layer_number: int = 1) -> nn.Module:
    """The attention module ``config`` names, for 1-based layer ``layer_number``."""
    return ATTENTION[config.attention_type](config, dtype, tp, cp, layer_number)
