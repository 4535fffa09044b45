"""The transformer block: attention (GQA, RoPE) and MLP (GELU or SwiGLU), pre-norm residuals.

Activations are laid out [sequence, batch, hidden] as in Megatron, so sequence parallelism can split
the first dimension. Parameter names follow Megatron-core (linear_qkv, linear_proj, linear_fc1,
linear_fc2, input_layernorm, pre_mlp_layernorm) so checkpoints and conversions map one to one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig


class Linear(nn.Module):
    """y = x W^T + b with uninitialised storage (megalite.model.init fills it layout-independently)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.weight.is_norm_weight = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.weight.is_norm_weight = True
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def build_norm(config: ModelConfig, dtype: torch.dtype) -> nn.Module:
    norm = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    return norm(config.hidden_size, config.norm_epsilon, dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE in the rotate-half convention (as Hugging Face Llama)."""

    def __init__(self, head_dim: int, base: float, max_positions: int):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)             # [positions, head_dim]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def tables(self, positions: torch.Tensor | None, seq_len: int, dtype: torch.dtype):
        """[s, 1, 1, d] tables for positions 0..seq_len-1, or for explicit ``positions`` [s]."""
        cos, sin = (self.cos[:seq_len], self.sin[:seq_len]) if positions is None else \
            (self.cos[positions], self.sin[positions])
        return cos.to(dtype)[:, None, None, :], sin.to(dtype)[:, None, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [s, b, heads, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class SelfAttention(nn.Module):
    """Causal self-attention with a fused QKV projection in Megatron's grouped layout.

    ``linear_qkv`` rows are grouped per KV head g: [q heads of group g, k_g, v_g] (REFERENCE §3), so a
    tensor-parallel shard is a contiguous block of whole groups.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, num_heads: int | None = None,
                 num_groups: int | None = None):
        super().__init__()
        self.head_dim = config.kv_channels
        self.num_heads = num_heads or config.num_attention_heads          # local to this rank
        self.num_groups = num_groups or config.num_query_groups
        self.heads_per_group = self.num_heads // self.num_groups
        self.dropout = config.attention_dropout
        qkv_out = (self.num_heads + 2 * self.num_groups) * self.head_dim
        qkv_bias = config.add_bias_linear or config.add_qkv_bias
        self.linear_qkv = Linear(config.hidden_size, qkv_out, qkv_bias, dtype)
        self.linear_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, config.add_bias_linear, dtype)

    def split_qkv(self, qkv: torch.Tensor):
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, self.num_groups, self.heads_per_group + 2, self.head_dim)
        q = qkv[:, :, :, :self.heads_per_group].reshape(s, b, self.num_heads, self.head_dim)
        return q, qkv[:, :, :, -2], qkv[:, :, :, -1]

    def core_attention(self, q, k, v) -> torch.Tensor:
        """[s, b, heads, d] inputs -> [s, b, heads * d] output."""
        s, b = q.shape[0], q.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))            # [b, heads, s, d]
        if self.num_groups != self.num_heads:
            k = k.repeat_interleave(self.heads_per_group, dim=1)
            v = v.repeat_interleave(self.heads_per_group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             dropout_p=self.dropout if self.training else 0.0)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        q, k, v = self.split_qkv(self.linear_qkv(x))
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.linear_proj(self.core_attention(q, k, v))


class MLP(nn.Module):
    """fc1 -> activation -> fc2. With SwiGLU, fc1 rows are [gate ; up] (REFERENCE §3)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, ffn_size: int | None = None):
        super().__init__()
        ffn = ffn_size or config.ffn_hidden_size
        self.swiglu = config.swiglu
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        fc1_out = 2 * ffn if config.swiglu else ffn
        self.linear_fc1 = Linear(config.hidden_size, fc1_out, config.add_bias_linear, dtype)
        self.linear_fc2 = Linear(ffn, config.hidden_size, config.add_bias_linear, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate=self.gelu_approximate)
        return self.linear_fc2(h)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

    def __init__(self, config: ModelConfig, layer_number: int, dtype: torch.dtype):
        super().__init__()
        self.layer_number = layer_number          # global, 1-based (as Megatron)
        self.hidden_dropout = config.hidden_dropout
        self.input_layernorm = build_norm(config, dtype)
        self.self_attention = SelfAttention(config, dtype)
        self.pre_mlp_layernorm = build_norm(config, dtype)
        self.mlp = MLP(config, dtype)

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(x), rotary)
        x = x + F.dropout(attn, self.hidden_dropout, self.training)
        mlp = self.mlp(self.pre_mlp_layernorm(x))
        return x + F.dropout(mlp, self.hidden_dropout, self.training)

