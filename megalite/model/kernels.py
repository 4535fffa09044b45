"""Which kernel a model op runs: hand-written autograd Functions (RMSNorm, rotary), the scaled-dot-product
attention kernel predicates, attention on the meta device, dropout, and the eager-or-compiled choice.

Eager, the hand-written Functions keep less for backward than autograd of the plain ops and make fewer
passes over memory. Under torch.compile (--compile) the plain ops run: inductor fuses them and its
partitioner picks what backward keeps. ``compiling`` is the one place model code asks which it is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.parallel.context.block_kernels import equal_head_dims
from megalite.parallel.pipeline.split_backward import input_grads_to_compute


def compiling() -> bool:
    """Whether torch.compile is tracing this call: the plain ops run, and Python-side memory choices
    (copies that free a view's base, recomputation with the RNG tracker) are left to the compiler."""
    return torch.compiler.is_compiling()


def records_autograd(*tensors: torch.Tensor) -> bool:
    """Eager autograd recording a graph through one of ``tensors``: where a hand-written Function (or a
    copy that keeps less alive for backward) pays. Without a graph the plain ops are the same values."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors) and not compiling()


# ---- RMSNorm ---------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm keeping its input and an fp32 1/rms per row for backward, on every device.

    CUDA: F.rms_norm, whose fused forward and backward kernels keep exactly that; the custom Function
    would keep the same and run its backward as several unfused elementwise passes. Elsewhere (CPU,
    meta): _RMSNormFunction, since torch's composite rms_norm keeps fp32 copies of the input and of the
    normalised tensor (8 bytes per element instead of 2 at 16 bit, 4 at 32) and its backward is also
    the slower one there (fewer passes over [.., h] in the custom one). Compiled, the plain op."""
    if records_autograd(x, weight) and x.device.type != "cuda":
        return _RMSNormFunction.apply(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


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
        w = weight.to(work.dtype)              # fp32 (fp64 for an fp64 model)
        # d/dx of x * rstd(x): rstd * (g w - normed * mean(g w normed)) over the normalised dimension. The
        # row means are work @ w (a matrix-vector product), then work's buffer takes g * w and the rest
        # runs in place: few passes over [.., h] and two allocations (CPU: the backward is memory-bound)
        mean = work.matmul(w).unsqueeze(-1).div_(h)
        grad_x = torch.mul(grad, w, out=work).addcmul_(normed, mean, value=-1).mul_(rstd)
        return grad_x.to(x.dtype), grad_w, None


# ---- rotary ----------------------------------------------------------------------------------------
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, x: [s, b, heads, d]; tables narrower than d rotate the first
    dimensions only (partial rotary). Compiled, the plain ops (inductor fuses them); eager, _Rotary."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :dim], cos, sin), x[..., dim:]], dim=-1)
    if not compiling():
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


# ---- scaled dot-product attention --------------------------------------------------------------------
def sdpa_runs_fused(q, k, v, mask, dropout: float, causal: bool, gqa: bool = False) -> bool:
    """Whether scaled_dot_product_attention on these [b, heads, s, d] inputs runs a fused kernel, which
    keeps for backward only q, k, v, the output and the log-sum-exp, rather than the math path, which
    keeps the s x s scores, probabilities and dropout mask. ``gqa``: K/V with fewer heads, enable_gqa.

    CPU: the flash kernel (any mask, grouped K/V or not) unless dropout > 0 or V's head dim differs from
    Q's and K's (it takes one head dim). meta: attention_on_meta runs the CPU flash kernel's shapes, as a
    GPU's fused kernel would run them. CUDA: flash (fp16/bf16, no mask; the only one that takes grouped
    K/V) or, with as many K/V heads as query heads, the memory-efficient kernel (any dtype, masks);
    torch's own checks decide, as SDPA's dispatch does."""
    if q.device.type == "meta":
        return True
    if q.device.type == "cpu":
        return dropout == 0 and v.shape[-1] == q.shape[-1]
    try:
        params = torch.backends.cuda.SDPAParams(q, k, v, mask, dropout, causal, gqa)
        if torch.backends.cuda.can_use_flash_attention(params, False):
            return True
        return not gqa and bool(torch.backends.cuda.can_use_efficient_attention(params, False))
    except (AttributeError, TypeError, RuntimeError):
        return False


def sdpa_runs_gqa_fused(q, k, v, mask, dropout: float, causal: bool) -> bool:
    """Whether scaled_dot_product_attention(enable_gqa=True) can take these unexpanded K/V.

    CPU's flash kernel takes grouped K/V (with or without a mask; on its math path, with dropout or
    unequal head dims, SDPA expands K/V itself either way). On CUDA only the flash kernel does (fp16/bf16,
    no mask): the memory-efficient and cuDNN kernels need as many K/V heads as query heads, so a call they
    would serve falls back to the math kernel, which keeps the s x s scores; there, expand K/V first."""
    return q.device.type in ("cpu", "meta") or sdpa_runs_fused(q, k, v, mask, dropout, causal, gqa=True)


def attention_on_meta(q, k, v, mask, dropout: float, causal: bool, scale: float | None) -> torch.Tensor:
    """[b, heads, s, d_v] output of attention on meta tensors (no storage, shapes only). SDPA would take
    its math path there, which keeps the s x s scores; the fused kernel a GPU runs (with or without
    dropout) keeps the output and the log-sum-exp, as the CPU flash op does. That op takes one head dim:
    with d_v != d_qk the inputs are zero-padded to the larger, as the fused kernels' callers pad them."""
    d_v = v.shape[-1]
    scale = q.shape[-1] ** -0.5 if scale is None and d_v != q.shape[-1] else scale
    q, k, v = equal_head_dims(q, k, v)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout, causal, attn_mask=mask,
                                                                     scale=scale)[0]
    return out if out.shape[-1] == d_v else out[..., :d_v]


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """F.dropout that keeps a 1-byte mask for backward (as Megatron counts it). CPU's F.dropout keeps a
    noise tensor in x's dtype; native_dropout, which CUDA's F.dropout runs, draws the same mask from
    the same generator and gives the same values."""
    if not training or p == 0:
        return x
    return torch.native_dropout(x, p, True)[0]
