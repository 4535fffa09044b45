"""The transformer block: attention (GQA, RoPE) and MLP (GELU or SwiGLU), pre-norm residuals.

Activations are laid out [sequence, batch, hidden] as in Megatron, so sequence parallelism can split
the first dimension. Parameter names follow Megatron-core (linear_qkv, linear_proj, linear_fc1,
linear_fc2, input_layernorm, pre_mlp_layernorm) so checkpoints and conversions map one to one.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from megalite.parallel.pipeline.split_backward import input_grads_to_compute
from megalite.config.schema import ModelConfig
from megalite.model.mlp import MLP
from megalite.model.moe import MoELayer
from megalite.parallel.context.ring_attention import ContextParallel, ring_attention
from megalite.parallel.expert.dispatch import ExpertParallel, MoEContext
from megalite.parallel.param_meta import mark
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, TensorParallel
from megalite.parallel.tensor.mappings import copy_to_tp_region
from megalite.parallel.tensor.random import checkpoint


def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """(F.rms_norm(x), fp32 1/rms per row [..., 1])."""
    fused = getattr(torch.ops.aten, "_fused_rms_norm", None)
    if fused is not None:
        return fused(x, [x.shape[-1]], weight, eps)         # the kernel F.rms_norm runs, with its statistics
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (x.float() * rstd).to(x.dtype) * weight, rstd


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm keeping only its input and the fp32 1/rms per row for backward, as fused GPU kernels do.

    torch's CPU rms_norm is composed of elementwise ops whose autograd keeps fp32 copies of the input
    and of the normalised tensor (8 bytes per element at any precision); Megatron counts the input
    (2 bytes at 16 bit). Backward recomputes the normalised tensor in fp32."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        out, rstd = _rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        need_x, need_w, _ = input_grads_to_compute(ctx)      # zero-bubble B and W passes need one each
        h = x.shape[-1]
        normed = x * rstd                       # fp32 by type promotion: one pass, no upcast copy of x
        work = grad * normed                    # fp32
        grad_w = work.reshape(-1, h).sum(dim=0).to(weight.dtype) if need_w else None
        if not need_x:
            return None, grad_w, None
        w = weight.float()
        # d/dx of x * rstd(x): rstd * (g w - normed * mean(g w normed)) over the normalised dimension. The
        # row means are work @ w (a matrix-vector product), then work's buffer takes g * w and the rest
        # runs in place: few passes over [.., h] and two allocations (CPU: the backward is memory-bound)
        mean = work.matmul(w).unsqueeze(-1).div_(h)
        grad_x = torch.mul(grad, w, out=work).addcmul_(normed, mean, value=-1).mul_(rstd)
        return grad_x.to(x.dtype), grad_w, None


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
    """RMSNorm keeping its input and an fp32 1/rms per row for backward, on every device.

    CUDA: F.rms_norm, whose fused forward and backward kernels keep exactly that; the custom Function
    would keep the same and run its backward as several unfused elementwise passes. Elsewhere (CPU,
    meta): _RMSNormFunction, since torch's composite rms_norm keeps fp32 copies of the input and of the
    normalised tensor (8 bytes per element instead of 2 at 16 bit, 4 at 32) and its backward is also
    the slower one there (fewer passes over [.., h] in the custom one). Compiled (--compile), the plain
    op everywhere: inductor fuses it and its partitioner picks what backward keeps."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self._init_weight(hidden_size, dtype, zero_centered)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.scale()
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad) \
                and not torch.compiler.is_compiling() and x.device.type != "cuda":
            return _RMSNormFunction.apply(x, weight, self.eps)
        return F.rms_norm(x, weight.shape, weight, self.eps)


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, x: [s, b, heads, d]; tables narrower than d rotate the first
    dimensions only (partial rotary). Compiled, the plain ops (inductor fuses them); eager, _Rotary."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :dim], cos, sin), x[..., dim:]], dim=-1)
    if not torch.compiler.is_compiling():
        return _Rotary.apply(x, cos, sin)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class _Rotary(torch.autograd.Function):
    """RoPE with one new tensor per pass: the tables repeat their frequencies (RotaryEmbedding), so
    output half 1 is x1 c - x2 s and half 2 is x2 c + x1 s (c, s: the tables' first halves), each
    written in place. Backward applies the transposed rotation to the gradient and saves only the
    tables, as autograd of the plain ops does; those ops would allocate a negated half, a
    concatenation, two products and their sum on each pass (every allocation a full pass over x)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1.0), None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """[x1, x2] -> [x1 c - sign x2 s, x2 c + sign x1 s]: the rotation (sign 1) or its transpose (-1)."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x1, c, out=out[..., :half]).addcmul_(x2, s, value=-sign)
    torch.mul(x2, c, out=out[..., half:]).addcmul_(x1, s, value=sign)
    return out


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, for incremental decoding (inference, TP size 1).

    Per layer (by layer number), k and v buffers [max_length, batch, groups, head_dim], allocated on
    first use; positions ``0..length-1`` are filled. GPTModel.forward advances ``length`` after a step.
    """
    max_length: int
    length: int = 0
    keys: dict = field(default_factory=dict)
    values: dict = field(default_factory=dict)

    def update(self, layer_number: int, k: torch.Tensor, v: torch.Tensor):
        """Append this step's k, v [s, b, groups, d] for one layer; return the layer's cached k, v so far."""
        if layer_number not in self.keys:
            self.keys[layer_number] = k.new_empty(self.max_length, *k.shape[1:])
            self.values[layer_number] = v.new_empty(self.max_length, *v.shape[1:])
        end = self.length + k.shape[0]
        self.keys[layer_number][self.length:end] = k
        self.values[layer_number][self.length:end] = v
        return self.keys[layer_number][:end], self.values[layer_number][:end]


class SelfAttention(nn.Module):
    """Causal self-attention with a fused QKV projection in Megatron's grouped layout.

    ``linear_qkv`` rows are grouped per KV head g: [q heads of group g, k_g, v_g] (Megatron's layout), so a
    tensor-parallel shard is a contiguous block of whole groups. With more TP ranks than KV heads,
    each rank takes a slice of one group's query heads plus that group's K and V, which are then
    replicated across the ranks sharing the group (their gradients are summed over those ranks).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel, cp: ContextParallel | None = None):
        super().__init__()
        nq, nkv, d, h = config.num_attention_heads, config.num_query_groups, config.kv_channels, config.hidden_size
        self.tp = tp
        self.cp = cp if cp is not None and cp.size > 1 else None
        self.head_dim = d
        self.num_heads = nq // tp.size                              # local to this rank
        self.num_groups = max(1, nkv // tp.size)
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
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:         # --qk-layernorm: per-head norms of q and k, weights [head_dim]
            self.q_layernorm = build_norm(replace(config, hidden_size=d), dtype, tp)
            self.k_layernorm = build_norm(replace(config, hidden_size=d), dtype, tp)

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

    def core_attention(self, q, k, v) -> torch.Tensor:
        """[s, b, heads, d] queries, [t, b, groups, d] keys/values -> [s, b, heads * d] output.

        t > s only with a KV cache: the queries are the last s of t positions; they attend to every
        cached key and causally among themselves (one new query needs no mask).

        GQA runs on the unexpanded K/V (``enable_gqa``), so backward keeps [t, b, groups, d], not a
        copy repeated to every query head. The kernel's output keeps heads and features adjacent (CPU:
        in q's [s, b, heads, d] layout; CUDA flash: [b, s, heads, d]), so the reshape for the output
        projection is a view and the kernel's saved output is also the projection's saved input.
        """
        if self.cp is not None:
            return ring_attention(q, k, v, self.cp)
        s, b, total = q.shape[0], q.shape[1], k.shape[0]
        q, k, v, mask, dropout, gqa = self.sdpa_inputs(q, k, v)
        if gqa and not sdpa_runs_gqa_fused(q, k, v, mask, dropout, total == s):
            k = k.repeat_interleave(self.heads_per_group, dim=1)
            v = v.repeat_interleave(self.heads_per_group, dim=1)
            gqa = False
        # attention heads are sharded over TP: their dropout draws from this rank's own stream
        if q.device.type == "meta":
            # no storage (a --no-storage dry run): SDPA would take its math path, which keeps the s x s
            # scores; the fused kernel a GPU runs (with or without dropout) keeps the output and the
            # log-sum-exp, as this one does
            out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout, total == s,
                                                                             attn_mask=mask)[0]
            return out.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)
        with self.tp.rng.fork() if dropout > 0 and self.tp.rng is not None else nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=total == s, dropout_p=dropout,
                                                 enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)

    def sdpa_inputs(self, q, k, v):
        """[s, b, heads, d] q, [t, b, groups, d] k, v -> SDPA's [b, heads, s, d] views of them, its mask
        (queries after a KV cache: the last s of t positions), dropout and whether K/V are grouped."""
        s, total = q.shape[0], k.shape[0]
        mask = None
        if s > 1 and total > s:
            mask = torch.ones(s, total, dtype=torch.bool, device=q.device).tril(total - s)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        return q, k, v, mask, dropout, self.num_groups != self.num_heads

    def recomputing_attention_pays(self, q, k, v) -> bool:
        """Whether recomputing core_attention in backward (selective recomputation) keeps less than running
        it once. The recomputed region keeps q, the unexpanded k and v (its inputs) and the output (the
        output projection's input); so do ring attention and SDPA's fused kernels on grouped K/V, plus a
        log-sum-exp: recomputing them would only run their forward twice. It pays for SDPA's math path,
        which keeps the s x s scores (CPU with attention dropout; CUDA where no fused kernel takes the
        call), and for K/V expanded to every query head for a kernel that cannot take them grouped
        (CUDA's memory-efficient kernel, e.g. in fp32), which that kernel keeps expanded."""
        if self.cp is not None:
            return False
        causal = q.shape[0] == k.shape[0]
        q, k, v, mask, dropout, gqa = self.sdpa_inputs(q, k, v)
        if gqa and not sdpa_runs_gqa_fused(q, k, v, mask, dropout, causal):
            return True
        return not sdpa_runs_fused(q, k, v, mask, dropout, causal, gqa)

    def forward(self, x: torch.Tensor, rotary=None, kv_cache: KVCache | None = None,
                layer_number: int = 0) -> torch.Tensor:
        qkv = self.linear_qkv(x)
        q, k, v = self.split_qkv(qkv)
        if self.q_layernorm is not None:
            q, k = self.norm_heads(self.q_layernorm, q), self.norm_heads(self.k_layernorm, k)
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if torch.is_grad_enabled() and not torch.compiler.is_compiling() and not _same_storage(q, qkv):
            # q (and with RoPE k) are new tensors: a k or v that is still a view would keep the whole
            # QKV output alive for backward, queries included (compiled, the partitioner picks what is saved)
            k, v = (t.contiguous() if _same_storage(t, qkv) else t for t in (k, v))
        if kv_cache is not None:
            k, v = kv_cache.update(layer_number, k, v)
        recompute = self.selective_recompute and self.training and self.recomputing_attention_pays(q, k, v)
        if recompute and torch.compiler.is_compiling():
            # traced as a recomputed region of the compiled graph; no RNG stream to replay (--compile runs
            # selective recomputation with attention dropout eager: megalite/train/compile.py)
            out = torch.utils.checkpoint.checkpoint(self.core_attention, q, k, v, use_reentrant=False)
        elif recompute:
            out = checkpoint(self.core_attention, q, k, v, tracker=self.tp.rng)
        else:
            out = self.core_attention(q, k, v)
        return self.linear_proj(out)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """By the storage object, not its address: meta tensors (no storage) all have address 0."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def sdpa_runs_fused(q, k, v, mask, dropout: float, causal: bool, gqa: bool = False) -> bool:
    """Whether scaled_dot_product_attention on these [b, heads, s, d] inputs runs a fused kernel, which
    keeps for backward only q, k, v, the output and the log-sum-exp, rather than the math path, which
    keeps the s x s scores, probabilities and dropout mask. ``gqa``: K/V with fewer heads, enable_gqa.

    CPU: the flash kernel (any mask, grouped K/V or not) unless dropout > 0. meta: core_attention runs
    the CPU flash kernel's shapes, as a GPU's fused kernel would run them. CUDA: flash (fp16/bf16, no
    mask; the only one that takes grouped K/V) or, with as many K/V heads as query heads, the
    memory-efficient kernel (any dtype, masks); torch's own checks decide, as SDPA's dispatch does."""
    if q.device.type == "meta":
        return True
    if q.device.type == "cpu":
        return dropout == 0
    try:
        params = torch.backends.cuda.SDPAParams(q, k, v, mask, dropout, causal, gqa)
        if torch.backends.cuda.can_use_flash_attention(params, False):
            return True
        return not gqa and bool(torch.backends.cuda.can_use_efficient_attention(params, False))
    except (AttributeError, TypeError, RuntimeError):
        return False


def sdpa_runs_gqa_fused(q, k, v, mask, dropout: float, causal: bool) -> bool:
    """Whether scaled_dot_product_attention(enable_gqa=True) can take these unexpanded K/V.

    CPU's flash kernel takes grouped K/V (with or without a mask; with dropout SDPA takes the math path,
    which expands K/V itself either way). On CUDA only the flash kernel does (fp16/bf16, no mask): the
    memory-efficient and cuDNN kernels need as many K/V heads as query heads, so a call they would
    serve falls back to the math kernel, which keeps the s x s scores; there, expand K/V first."""
    return q.device.type in ("cpu", "meta") or sdpa_runs_fused(q, k, v, mask, dropout, causal, gqa=True)


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


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """F.dropout that keeps a 1-byte mask for backward (as Megatron counts it). CPU's F.dropout keeps a
    noise tensor in x's dtype; native_dropout, which CUDA's F.dropout runs, draws the same mask from
    the same generator and gives the same values."""
    if not training or p == 0:
        return x
    return torch.native_dropout(x, p, True)[0]


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))); the MLP is an MoE layer
    (model/moe.py) in the layers --moe-layer-freq selects."""

    def __init__(self, config: ModelConfig, layer_number: int, dtype: torch.dtype, tp: TensorParallel,
                 cp: ContextParallel | None = None, moe: MoEContext | None = None):
        super().__init__()
        self.layer_number = layer_number          # global, 1-based (as Megatron)
        self.hidden_dropout = config.hidden_dropout
        self.input_layernorm = build_norm(config, dtype, tp)
        self.self_attention = SelfAttention(config, dtype, tp, cp)
        self.pre_mlp_layernorm = build_norm(config, dtype, tp)
        if config.is_moe_layer(layer_number):
            self.mlp = MoELayer(config, dtype, tp, moe or MoEContext(ExpertParallel()))
        else:
            self.mlp = MLP(config, dtype, tp)

    def forward(self, x: torch.Tensor, rotary=None, kv_cache: KVCache | None = None) -> torch.Tensor:
        # the layer number only keys the KV cache; not read without one, so torch.compile does not
        # specialise (and recompile) each layer on it
        layer_number = self.layer_number if kv_cache is not None else 0
        attn = self.self_attention(self.input_layernorm(x), rotary, kv_cache, layer_number)
        x = x + dropout(attn, self.hidden_dropout, self.training)
        mlp = self.mlp(self.pre_mlp_layernorm(x))
        return x + dropout(mlp, self.hidden_dropout, self.training)

