"""GPTModel: embedding -> transformer layers -> final norm -> output layer -> per-token loss.

One class covers GPT-2 style (learned positions, LayerNorm, GELU, biases, tied embeddings) and Llama
style (RoPE, RMSNorm, SwiGLU, no biases, GQA, untied output) from ModelConfig. ``pre_process`` /
``post_process`` and the layer range let a pipeline stage hold only its part of the model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.model.init import initialize_parameter
from megalite.model.transformer import RotaryEmbedding, TransformerLayer, build_norm

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Embedding(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size, dtype=dtype,
                                            _weight=torch.empty(config.padded_vocab_size, config.hidden_size,
                                                                dtype=dtype))
        self.position_embeddings = None
        if not config.use_rope:
            self.position_embeddings = nn.Embedding(
                config.max_position_embeddings, config.hidden_size, dtype=dtype,
                _weight=torch.empty(config.max_position_embeddings, config.hidden_size, dtype=dtype))
        self.dropout = config.hidden_dropout

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """[b, s] ids -> [s, b, h] activations."""
        x = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
            x = x + self.position_embeddings(position_ids)
        x = x.transpose(0, 1).contiguous()
        return F.dropout(x, self.dropout, self.training)


class GPTModel(nn.Module):
    def __init__(self, config: ModelConfig, seed: int = 1234, pre_process: bool = True,
                 post_process: bool = True, layer_offset: int = 0, num_local_layers: int | None = None):
        super().__init__()
        self.config = config
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_offset = layer_offset
        self.share_embeddings_and_output_weights = not config.untie_embeddings_and_output_weights
        dtype = DTYPES[config.params_dtype]
        n_local = config.num_layers if num_local_layers is None else num_local_layers

        self.embedding = Embedding(config, dtype) if pre_process else None
        self.rotary = (RotaryEmbedding(config.kv_channels, config.rotary_base, config.max_position_embeddings)
                       if config.use_rope else None)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(
            TransformerLayer(config, layer_offset + i + 1, dtype) for i in range(n_local))
        if post_process:
            self.decoder.final_layernorm = build_norm(config, dtype)
            if not self.share_embeddings_and_output_weights:
                self.output_layer = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False, dtype=dtype)
        self.reset_parameters(seed)

    # ---- parameters -------------------------------------------------------------------------
    def global_name(self, local_name: str) -> str:
        """Parameter name in the whole (unsplit) model: layer indices shifted by this stage's offset."""
        if local_name.startswith("decoder.layers."):
            index, rest = local_name[len("decoder.layers."):].split(".", 1)
            return f"decoder.layers.{int(index) + self.layer_offset}.{rest}"
        return local_name

    def reset_parameters(self, seed: int) -> None:
        for name, param in self.named_parameters():
            initialize_parameter(param, self.global_name(name), self.config.init_method_std,
                                 self.config.num_layers, seed)

    def output_weight(self) -> torch.Tensor:
        if self.share_embeddings_and_output_weights:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None):
        """First stage takes ``input_ids`` [b, s]; later stages take ``hidden_states`` [s, b, h].

        Last stage returns per-token losses [b, s] when ``labels`` are given, else logits [b, s, V];
        other stages return hidden states [s, b, h].
        """
        x = self.embedding(input_ids, position_ids) if self.pre_process else hidden_states
        rotary = self.rotary.tables(None, x.shape[0], x.dtype) if self.rotary is not None else None
        for layer in self.decoder.layers:
            x = layer(x, rotary)
        if not self.post_process:
            return x
        x = self.decoder.final_layernorm(x)
        logits = F.linear(x, self.output_weight())                      # [s, b, V]
        if labels is None:
            return logits.transpose(0, 1)
        return cross_entropy_per_token(logits, labels)


def cross_entropy_per_token(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[s, b, V] logits (any dtype, computed in fp32) and [b, s] labels -> [b, s] fp32 losses."""
    s, b, v = logits.shape
    losses = F.cross_entropy(logits.float().view(s * b, v), labels.t().reshape(s * b), reduction="none")
    return losses.view(s, b).t()
