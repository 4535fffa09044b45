"""MultiLatentAttention: DeepSeek-V2/V3's multi-latent attention (MLA).

Per token, with h the hidden state:
- queries: q = W_q_up norm(W_q_down h) with --q-lora-rank (q-LoRA), or q = W_q h without it;
- keys and values share one compressed latent: [c; k_rope] = W_kv_down h, c of --kv-lora-rank normed;
  per head [k_nope; v] = W_kv_up c;
- each query/key head is [no-RoPE part (--qk-head-dim); RoPE part (--qk-pos-emb-head-dim)], the key's RoPE
  part k_rope being one per token, shared by every head; values have --v-head-dim;
- softmax scale 1/sqrt(qk_head_dim + qk_pos_emb_head_dim), times mscale^2 under YaRN, mscale =
  0.1 mscale_all_dim ln(factor) + 1 (the RoPE tables carry YaRN's own cos/sin factor).

Tensor parallelism splits heads: the up projections are column-parallel by heads, ``linear_proj``
row-parallel; the down projections and the latents' norms are replicated. Their outputs (the latents)
enter the tensor-parallel region once: without sequence parallelism through copy_to_tp_region, whose
backward sums the per-rank (per-head) gradients, so the replicated weights get the whole gradient on every
rank; with it, the down projections run on the rank's own sequence shard and the latents are all-gathered
(backward reduce-scatters), so their weights' gradients are partial per rank and marked
``sequence_parallel`` for finalize_model_grads to sum over TP.

Generation's KV cache holds the latent (normed c and the roped shared key), not expanded K/V: each step
up-projects the whole cached latent.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from megalite.config.schema import ModelConfig
from megalite.model.attention.core import run_core_attention
from megalite.model.attention.inputs import AttentionInputs
from megalite.model.attention.kv_cache import KVCache
from megalite.model.attention.logit_clip import MaxLogits, QKRows, per_head_rows
from megalite.model.attention.mask import MaskSpec
from megalite.model.attention.rotary import Yarn
from megalite.model.attention.self_attention import head_sinks, learnable_offset
from megalite.model.kernels import apply_rotary, records_autograd
from megalite.model.norms import build_norm
from megalite.parallel.context.ring_attention import ContextParallel
from megalite.parallel.param_meta import mark
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, TensorParallel, linear
from megalite.parallel.tensor.mappings import copy_to_tp_region, gather_from_sp_region
from megalite.precision.gemm import build_gemm_precision


class MultiLatentAttention(nn.Module):
    """Multi-latent attention (module doc) with Megatron-Core's parameter names: ``linear_q_proj`` or
    ``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj``, ``linear_kv_down_proj`` (rows [latent;
    shared RoPE key]), ``kv_layernorm``, ``linear_kv_up_proj`` (per head [k no-RoPE; v]) and ``linear_proj``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel, cp: ContextParallel | None = None,
                 layer_number: int = 1):
        super().__init__()
        heads, h = config.num_attention_heads, config.hidden_size
        self.tp = tp
        self.cp = cp if cp is not None and cp.size > 1 else None
        self.mask = MaskSpec(causal=True, window=config.attention_window(layer_number))
        self.num_heads = heads // tp.size
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = softmax_scale(config)
        self.dropout = config.attention_dropout
        self.selective_recompute = config.recompute_granularity == "selective"
        qk_dim = self.nope_dim + self.rope_dim
        self.linear_q_proj = self.linear_q_down_proj = self.q_layernorm = self.linear_q_up_proj = None
        if config.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(h, heads * qk_dim, False, dtype, tp)
        else:
            self.linear_q_down_proj = _replicated_linear(h, config.q_lora_rank, dtype, tp)
            self.q_layernorm = _latent_norm(config, config.q_lora_rank, dtype, tp)
            self.linear_q_up_proj = ColumnParallelLinear(config.q_lora_rank, heads * qk_dim, False, dtype, tp)
        self.linear_kv_down_proj = _replicated_linear(h, config.kv_lora_rank + self.rope_dim, dtype, tp)
        self.kv_layernorm = _latent_norm(config, config.kv_lora_rank, dtype, tp)
        self.linear_kv_up_proj = ColumnParallelLinear(config.kv_lora_rank, heads * (self.nope_dim + self.v_dim),
                                                      False, dtype, tp)
        self.linear_proj = RowParallelLinear(heads * self.v_dim, h, False, dtype, tp)
        self.softmax_type = config.softmax_type
        self.softmax_offset = learnable_offset(heads, dtype, tp) if config.softmax_type == "learnable" else None
        self.max_logits = MaxLogits() if config.records_max_logit else None     # QK-clip's (logit_clip.py)

    def qk_rows(self, alpha: float) -> QKRows:
        """QK-clip's view of the up projections, one rescale eta per head: its query rows [no-RoPE part x
        eta^alpha; RoPE part x eta], the key rows of linear_kv_up_proj x eta^(1 - alpha), values as they
        are; the RoPE key is shared by every head and stays as it is."""
        q_proj = self.linear_q_proj if self.linear_q_proj is not None else self.linear_q_up_proj
        device, n = q_proj.weight.device, self.num_heads
        q_rows = per_head_rows([alpha, 1.0], [self.nope_dim, self.rope_dim], n, device)
        kv_rows = per_head_rows([1 - alpha, 0.0], [self.nope_dim, self.v_dim], n, device)
        return QKRows(n, torch.arange(n, device=device),
                      [(q_proj.weight, *q_rows), (self.linear_kv_up_proj.weight, *kv_rows)])

    def enter_tp_region(self, latent: torch.Tensor) -> torch.Tensor:
        """A latent computed by a replicated projection -> the whole sequence's latent, the same on every
        TP rank, whose gradient the ranks' heads sum (module doc)."""
        if self.tp.sequence_parallel:
            return gather_from_sp_region(latent, self.tp.group)
        return copy_to_tp_region(latent, self.tp.group)

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """[s(/tp), b, h] -> this rank's query heads [s, b, heads, qk_head_dim + qk_pos_emb_head_dim]."""
        if self.linear_q_proj is not None:
            q = self.linear_q_proj(x)
        else:
            latent = self.enter_tp_region(_norm(self.q_layernorm, self.linear_q_down_proj(x)))
            q = _local_linear(self.linear_q_up_proj, latent)
        return q.view(*q.shape[:2], self.num_heads, -1)

    def compress_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[s(/tp), b, h] -> (the normed latent [s, b, kv_lora_rank], the shared RoPE key [s, b, 1, d_rope]
        before RoPE), both for the whole sequence on every TP rank."""
        kv = self.linear_kv_down_proj(x)
        if self.kv_layernorm is not None:
            latent, key = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            kv = torch.cat([self.kv_layernorm(latent), key], dim=-1)
        latent, key = self.enter_tp_region(kv).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return latent, key.unsqueeze(2)

    def expand_kv(self, latent: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent [t, b, r] and roped shared key [t, b, 1, d_rope] -> this rank's heads' keys
        [t, b, heads, qk_head_dim + d_rope] (the shared key beside each head's own part) and values
        [t, b, heads, v_head_dim]."""
        kv = _local_linear(self.linear_kv_up_proj, latent)
        k_nope, v = kv.view(*kv.shape[:2], self.num_heads, -1).split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, key.expand(*k_nope.shape[:3], self.rope_dim)], dim=-1)
        # a view of kv would keep the keys' part of it alive for backward too
        return k, (v.contiguous() if records_autograd(kv) else v)

    def forward(self, x: torch.Tensor, inputs: AttentionInputs | None = None, kv_cache: KVCache | None = None,
                layer_number: int = 0) -> torch.Tensor:
        rotary, documents = (inputs.rotary, inputs.cu_seqlens) if inputs is not None else (None, None)
        q_nope, q_rope = self.project_q(x).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, key = self.compress_kv(x)
        if rotary is not None:
            cos, sin = rotary
            q_rope, key = apply_rotary(q_rope, cos, sin), apply_rotary(key, cos, sin)
        if kv_cache is not None:                    # the cache holds the latent and the roped shared key
            latent, key = kv_cache.update(layer_number, latent, key)
        k, v = self.expand_kv(latent, key)
        q = torch.cat([q_nope, q_rope], dim=-1)
        mask = self.mask if documents is None else self.mask.with_documents(documents)
        if self.max_logits is not None and self.training:
            self.max_logits.record(q, k, mask, self.scale, self.cp)
        out = run_core_attention(q, k, v, mask, scale=self.scale, dropout=self.dropout if self.training else 0.0,
                                 cp=self.cp, rng=self.tp.rng,
                                 selective_recompute=self.selective_recompute and self.training,
                                 sinks=head_sinks(self.softmax_type, self.softmax_offset, self.num_heads, q))
        return self.linear_proj(out)


def softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(qk_head_dim + qk_pos_emb_head_dim), times mscale(mscale_all_dim)^2 under YaRN."""
    scale = (config.qk_head_dim + config.qk_pos_emb_head_dim) ** -0.5
    if config.uses_yarn and config.mscale_all_dim:
        scale *= Yarn.from_config(config).m(config.mscale_all_dim) ** 2
    return scale


def _replicated_linear(in_features: int, out_features: int, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
    """A down projection: the whole weight on every TP rank, run on the rank's own tokens (its sequence
    shard under sequence parallelism, whence the ``sequence_parallel`` mark), with the GEMM precision of
    the model's other linears."""
    layer = ColumnParallelLinear(in_features, out_features, False, dtype,
                                 TensorParallel(rng=tp.rng, gemm_recipe=tp.gemm_recipe))
    layer.precision = build_gemm_precision(tp.gemm_recipe, tp.replicated_gemm_layout())
    mark(layer.weight, sequence_parallel=tp.sequence_parallel)
    return layer


def _latent_norm(config: ModelConfig, size: int, dtype: torch.dtype, tp: TensorParallel) -> nn.Module | None:
    """--qk-layernorm: the norm of a latent (weights [size], replicated like the down projections)."""
    return build_norm(replace(config, hidden_size=size), dtype, tp) if config.qk_layernorm else None


def _norm(norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


def _local_linear(layer: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """A column-parallel layer on an input already whole on every TP rank (a latent that entered the
    region): its GEMM alone, without the layer's own gather or copy."""
    return linear(x, layer.weight, layer.bias, layer.precision)
