"""KVCache: the keys and values of the tokens seen so far, for incremental decoding."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, for incremental decoding (inference, TP size 1).

    Per layer (by layer number), two buffers [max_length, batch, ...] of what the attention module caches,
    allocated on first use: self-attention's k and v [.., groups, head_dim]; multi-latent attention's
    compressed form, its normed KV latent [.., kv_lora_rank] and roped shared key [.., 1, d_rope], which it
    up-projects to K/V on each read. Positions ``0..length-1`` are filled. GPTModel.forward advances
    ``length`` after a step.
    """
    max_length: int
    length: int = 0
    keys: dict = field(default_factory=dict)
    values: dict = field(default_factory=dict)

    def update(self, layer_number: int, k: torch.Tensor, v: torch.Tensor):
        """Append this step's k, v [s, b, ...] for one layer; return the layer's cached k, v so far."""
        if layer_number not in self.keys:
            self.keys[layer_number] = k.new_empty(self.max_length, *k.shape[1:])
            self.values[layer_number] = v.new_empty(self.max_length, *v.shape[1:])
        end = self.length + k.shape[0]
        self.keys[layer_number][self.length:end] = k
        self.values[layer_number][self.length:end] = v
        return self.keys[layer_number][:end], self.values[layer_number][:end]
