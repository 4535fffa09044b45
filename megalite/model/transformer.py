"""The transformer block: attention (model/attention/) and MLP (GELU or SwiGLU) or MoE, pre-norm residuals.

Activations are laid out [sequence, batch, hidden] as in Megatron, so sequence parallelism can split
the first dimension. Parameter names follow Megatron-core (self_attention.linear_qkv, linear_proj,
linear_fc1, linear_fc2, input_layernorm, pre_mlp_layernorm) so checkpoints and conversions map one to one.
"""
from __future__ import annotations

import torch
from torch import nn

from megalite.config.schema import ModelConfig
from megalite.model.attention import build_attention
from megalite.model.attention.inputs import AttentionInputs
from megalite.model.attention.kv_cache import KVCache
from megalite.model.kernels import dropout
from megalite.model.mlp import MLP
from megalite.model.moe import MoELayer
from megalite.model.norms import build_norm
from megalite.parallel.context.ring_attention import ContextParallel
from megalite.parallel.expert.dispatch import ExpertParallel, MoEContext
from megalite.parallel.tensor.layers import TensorParallel


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))); the attention is the module
    config.attention_type names, the MLP an MoE layer (model/moe.py) in the layers --moe-layer-freq selects."""

    def __init__(self, config: ModelConfig, layer_number: int, dtype: torch.dtype, tp: TensorParallel,
                 cp: ContextParallel | None = None, moe: MoEContext | None = None):
        super().__init__()
        self.layer_number = layer_number          # global, 1-based (as Megatron)
        self.hidden_dropout = config.hidden_dropout
        self.input_layernorm = build_norm(config, dtype, tp)
        self.self_attention = build_attention(config, dtype, tp, cp.for_layer(layer_number) if cp else cp)
        self.pre_mlp_layernorm = build_norm(config, dtype, tp)
        if config.is_moe_layer(layer_number):
            self.mlp = MoELayer(config, dtype, tp, moe or MoEContext(ExpertParallel()))
        else:
            self.mlp = MLP(config, dtype, tp)

    def forward(self, x: torch.Tensor, inputs: AttentionInputs | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        # the layer number only keys the KV cache; not read without one, so torch.compile does not
        # specialise (and recompile) each layer on it
        layer_number = self.layer_number if kv_cache is not None else 0
        attn = self.self_attention(self.input_layernorm(x), inputs, kv_cache, layer_number)
        x = x + dropout(attn, self.hidden_dropout, self.training)
        mlp = self.mlp(self.pre_mlp_layernorm(x))
        return x + dropout(mlp, self.hidden_dropout, self.training)
