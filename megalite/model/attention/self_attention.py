"""SelfAttention: causal self-attention with a fused QKV projection (GQA, RoPE, qk-layernorm, KV cache), a
sliding window on the layers --window-size / --window-attn-skip-freq pick, and softmax sinks (--softmax-type)."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config.schema import ModelConfig
from megalite.model.attention.core import run_core_attention
from megalite.model.attention.inputs import AttentionInputs
from megalite.model.attention.kv_cache import KVCache
from megalite.model.attention.logit_clip import MaxLogits, QKRows, per_head_rows
from megalite.model.attention.mask import MaskSpec
from megalite.model.kernels import apply_rotary, records_autograd
from megalite.model.norms import LayerNorm, build_norm
from megalite.parallel.context.ring_attention import ContextParallel
from megalite.parallel.param_meta import mark
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, TensorParallel
from megalite.parallel.tensor.mappings import copy_to_tp_region


class SelfAttention(nn.Module):
    """Causal self-attention with a fused QKV projection in Megatron's grouped layout.

    ``linear_qkv`` rows are grouped per KV head g: [q heads of group g, k_g, v_g] (Megatron's layout), so a
    tensor-parallel shard is a contiguous block of whole groups. With more TP ranks than KV heads,
    each rank takes a slice of one group's query heads plus that group's K and V, which are then
    replicated across the ranks sharing the group (their gradients are summed over those ranks).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel, cp: ContextParallel | None = None,
                 layer_number: int = 1):
        super().__init__()
        nq, nkv, d, h = config.num_attention_heads, config.num_query_groups, config.kv_channels, config.hidden_size
        self.tp = tp
        self.cp = cp if cp is not None and cp.size > 1 else None
        self.mask = MaskSpec(causal=True, window=config.attention_window(layer_number))
        self.head_dim = d
        self.num_heads = nq // tp.size                              # local to this rank
        self.num_groups = max(1, nkv // tp.size)
        self.num_kv_heads = nkv
        self.heads_per_group = self.num_heads // self.num_groups
        self.dropout = config.attention_dropout
        self.selective_recompute = config.recompute_granularity == "selective"
        local_rows, local_out = None, (self.num_heads + 2 * self.num_groups) * d
        if tp.size > nkv:
            local_rows = _replicated_kv_rows(nq, nkv, d, tp)
        qkv_bias = config.add_bias_linear or config.add_qkv_bias
        self.linear_qkv = ColumnParallelLinear(h, (nq + 2 * nkv) * d, qkv_bias, dtype, tp,
                                               local_rows=local_rows, local_out=local_out)
        if tp.size > nkv:
            kv_rows = (self.num_heads * d, (self.num_heads + 2) * d, tp.size // nkv)
            for param in self.linear_qkv.parameters():
                mark(param, replicated_rows=kv_rows)
        self.linear_proj = RowParallelLinear(nq * d, h, config.add_bias_linear, dtype, tp)
        self.softmax_type = config.softmax_type
        self.softmax_offset = learnable_offset(nq, dtype, tp) if config.softmax_type == "learnable" else None
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:         # --qk-layernorm: per-head norms of q and k, weights [head_dim]
            self.q_layernorm = build_norm(replace(config, hidden_size=d), dtype, tp)
            self.k_layernorm = build_norm(replace(config, hidden_size=d), dtype, tp)
        self.max_logits = MaxLogits() if config.records_max_logit else None     # QK-clip's (logit_clip.py)

    def norm_heads(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """q or k [s, b, heads, d] normalised over d. Each TP rank holds its own heads, so the replicated
        norm weight's gradient is partial per rank and must be summed over TP: under sequence parallelism
        finalize_model_grads does it (build_norm's sequence_parallel mark), without it the weight enters
        through copy_to_tp_region, whose backward all-reduces its gradient."""
        if self.tp.size == 1 or self.tp.sequence_parallel:
            return norm(x)
        weight = copy_to_tp_region(norm.scale(), self.tp.group)
        if isinstance(norm, LayerNorm):
            return F.layer_norm(x, weight.shape, weight, copy_to_tp_region(norm.bias, self.tp.group), norm.eps)
        return F.rms_norm(x, weight.shape, weight, norm.eps)

    def split_qkv(self, qkv: torch.Tensor):
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, self.num_groups, self.heads_per_group + 2, self.head_dim)
        q, k, v = torch.split(qkv, [self.heads_per_group, 1, 1], dim=3)
        return q.reshape(s, b, self.num_heads, self.head_dim), k.squeeze(3), v.squeeze(3)

    def sinks(self, q: torch.Tensor) -> torch.Tensor | None:
        return head_sinks(self.softmax_type, self.softmax_offset, self.num_heads, q)

    def forward(self, x: torch.Tensor, inputs: AttentionInputs | None = None, kv_cache: KVCache | None = None,
                layer_number: int = 0) -> torch.Tensor:
        rotary, documents = (inputs.rotary, inputs.cu_seqlens) if inputs is not None else (None, None)
        qkv = self.linear_qkv(x)
        q, k, v = self.split_qkv(qkv)
        if self.q_layernorm is not None:
            q, k = self.norm_heads(self.q_layernorm, q), self.norm_heads(self.k_layernorm, k)
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if records_autograd(qkv) and not _same_storage(q, qkv):
            # q (and with RoPE k) are new tensors: a k or v that is still a view would keep the whole
            # QKV output alive for backward, queries included (compiled, the partitioner picks what is saved)
            k, v = (t.contiguous() if _same_storage(t, qkv) else t for t in (k, v))
        if kv_cache is not None:
            k, v = kv_cache.update(layer_number, k, v)
        mask = self.mask if documents is None else self.mask.with_documents(documents)
        if self.max_logits is not None and self.training:
            self.max_logits.record(q, k, mask, self.head_dim ** -0.5, self.cp)
        out = run_core_attention(q, k, v, mask, dropout=self.dropout if self.training else 0.0, cp=self.cp,
                                 rng=self.tp.rng, selective_recompute=self.selective_recompute and self.training,
                                 sinks=self.sinks(q))
        return self.linear_proj(out)

    def qk_rows(self, alpha: float) -> QKRows:
        """QK-clip's view of linear_qkv (weight and bias): rows [q heads of g; k_g; v_g] per local query
        group g, one rescale per group, queries x eta^alpha, keys x eta^(1 - alpha), values as they are."""
        device = self.linear_qkv.weight.device
        d, hpg = self.head_dim, self.heads_per_group
        unit, power = per_head_rows([alpha, 1 - alpha, 0.0], [hpg * d, d, d], self.num_groups, device)
        head_unit = torch.arange(self.num_heads, device=device) // hpg
        replicas = self.tp.size // self.num_kv_heads
        sharers = (self.tp.group, self.tp.rank // replicas * replicas, replicas) if replicas > 1 else None
        return QKRows(self.num_groups, head_unit, [(p, unit, power) for p in self.linear_qkv.parameters()], sharers)


def head_sinks(softmax_type: str, offset: nn.Parameter | None, num_heads: int, q: torch.Tensor) -> torch.Tensor | None:
    """fp32 [local heads]: the logit each head adds to its softmax denominator (--softmax-type): the
    learned ``offset``, 0 for off-by-one; None for vanilla (plain softmax)."""
    if softmax_type == "off-by-one":
        return q.new_zeros(num_heads, dtype=torch.float32)
    return None if offset is None else offset.float()


def learnable_offset(num_heads: int, dtype: torch.dtype, tp: TensorParallel) -> nn.Parameter:
    """--softmax-type learnable: one sink logit per head, [heads / TP] on each rank, sharded by heads as the
    query heads are (a contiguous chunk per rank); initialised N(0, --init-method-std) and without weight
    decay (a 1-D parameter), as Megatron's ``softmax_offset``."""
    offset = nn.Parameter(torch.empty(num_heads // tp.size, dtype=dtype))
    return mark(offset, full_shape=(num_heads,), take_shard=tp.chunk, partition_dim=0,
                tensor_model_parallel=tp.size > 1)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """By the storage object, not its address: meta tensors (no storage) all have address 0."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def _replicated_kv_rows(nq: int, nkv: int, d: int, tp: TensorParallel):
    """Rows of the full QKV weight/bias for a rank sharing its KV head with tp/nkv - 1 others."""
    replicas = tp.size // nkv
    group, slot = tp.rank // replicas, tp.rank % replicas
    q_per_rank = nq // tp.size

    def local_rows(full: torch.Tensor) -> torch.Tensor:
        grouped = full.view(nkv, nq // nkv + 2, d, *full.shape[1:])[group]
        q = grouped[slot * q_per_rank:(slot + 1) * q_per_rank]
        return torch.cat([q, grouped[-2:]]).reshape(-1, *full.shape[1:])
    return local_rows
