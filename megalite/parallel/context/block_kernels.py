"""One block of ring attention on the fused SDPA kernels that return the log-sum-exp.

A block is one query chunk against one key/value chunk: q [b, heads, c, d], k [b, groups, c, d] and v
[b, groups, c, d_v] (GQA: heads = groups x heads_per_group, query head h attends to group
h // heads_per_group), any strides with a contiguous last dimension, ``causal`` on the diagonal (query i
sees keys 0..i), full otherwise. The kernels take one head dim: with d_v != d (DeepSeek's multi-latent
attention: 192 / 128) the block's inputs are zero-padded to the larger (``equal_head_dims``) and its
outputs cut back, which changes no value: zero features add nothing to q k^T or to dO V^T.

- ``block_forward`` -> (out [b, heads, c, d_v] in q's dtype, lse [b, heads, c] fp32): the block's own softmax
  output and log-sum-exp, which the ring merges across blocks.
- ``block_backward`` takes the *final* output and log-sum-exp of those queries (merged over every block)
  with its gradient, as flash attention's ring implementations do: the kernel recomputes the block's
  probabilities as exp(q k^T scale - lse), the full softmax restricted to this block, and
  D = rowsum(dout * out) from the final output, so its dq, dk, dv are this block's share of the full
  gradients (dq summed over the blocks of a query chunk, dk/dv over the query chunks that see the keys).

Nothing of size c x c is kept or returned; the kernels tile the scores internally. The kernel is picked
by device and dtype:

- CPU: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward, on grouped K/V directly.
- CUDA fp16/bf16 (sm80+): ``_scaled_dot_product_flash_attention`` and its backward; flash attention takes
  grouped K/V and returns grouped dK/dV. Its backward reads the log-sum-exp as a contiguous [b, heads, c].
- CUDA fp32 (flash has no fp32 kernel), or an older GPU: ``_scaled_dot_product_efficient_attention``, the
  kernel plain fp32 SDPA runs there. It needs as many K/V heads as query heads (K/V are repeated per
  block and dK/dV summed back over each group's heads), keeps the log-sum-exp padded to a multiple of 32
  rows, and its backward reads the output as [b, c, heads, d] with rows heads x d apart (a per-block
  copy here).

A block may carry ``mask``, bool [c_q, c_k] (True: the query sees the key), for the blocks a window or
a document boundary cuts. It goes to the kernel as an additive mask in q's dtype (CPU flash, CUDA
memory-efficient attention; flash attention on CUDA takes none, so such a block runs the
memory-efficient kernel). A query that sees no key of the block gets log-sum-exp -inf (the kernels
report 0 there), so merging ignores it.

Attention dropout is not supported (the caller refuses it with context parallelism).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

aten = torch.ops.aten
LSE_ALIGN = 32                                  # the memory-efficient kernel's log-sum-exp row padding


def _flash_on_cuda(q: torch.Tensor) -> bool:
    """fp16/bf16 on a GPU that runs flash attention (sm80 or newer); elsewhere the memory-efficient kernel."""
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    b, heads, c, d = grad.shape
    return grad if heads == groups else grad.view(b, groups, heads // groups, c, d).sum(dim=2)


def equal_head_dims(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` zero-padded along the last dim to the largest of their head dims (unchanged if equal)."""
    d = max(t.shape[-1] for t in tensors)
    return tuple(t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1])) for t in tensors)


def block_forward(q, k, v, causal: bool, scale: float,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T scale) v, log-sum-exp fp32 [b, heads, c]) of one block."""
    d_v = v.shape[-1]
    bias = _additive(mask, q.dtype)
    if d_v != q.shape[-1]:
        out, lse = _forward(*equal_head_dims(q, k, v), causal, scale, bias)
        out = out[..., :d_v]
    else:
        out, lse = _forward(q, k, v, causal, scale, bias)
    if mask is not None:
        lse = lse.masked_fill(~mask.any(dim=1), float("-inf"))
    return out, lse


def block_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float, mask: torch.Tensor | None = None):
    """(dq, dk, dv) of one block given the final ``out`` / ``lse`` of its queries and ``grad_out``."""
    d, d_v = q.shape[-1], v.shape[-1]
    bias = _additive(mask, q.dtype)
    if d_v != d:
        q, k, v, grad_out, out = equal_head_dims(q, k, v, grad_out, out)
        dq, dk, dv = _backward(grad_out, q, k, v, out, lse, causal, scale, bias)
        return dq[..., :d], dk[..., :d], dv[..., :d_v]
    return _backward(grad_out, q, k, v, out, lse, causal, scale, bias)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The kernels' form of a bool mask: 0 where a query sees a key, -inf where it does not."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _forward(q, k, v, causal: bool, scale: float, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    if q.device.type != "cuda":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    if _flash_on_cuda(q) and bias is None:
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    heads = q.shape[1]
    bias = None if bias is None else bias.expand(q.shape[0], heads, *bias.shape)
    out, lse = aten._scaled_dot_product_efficient_attention(q, _repeat_kv(k, heads), _repeat_kv(v, heads), bias,
                                                            True, 0.0, causal, scale=scale)[:2]
    return out, lse[:, :, :q.shape[2]]


def _backward(grad_out, q, k, v, out, lse, causal: bool, scale: float, bias=None):
    if q.device.type != "cuda":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal,
                                                                         attn_mask=bias, scale=scale)
    c = q.shape[2]
    if _flash_on_cuda(q) and bias is None:
        # without dropout the kernel reads no random state: placeholders of the forward's shapes
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        return aten._scaled_dot_product_flash_attention_backward(grad_out, q, k, v, out, lse.contiguous(), None, None,
                                                                 c, c, 0.0, causal, seed, offset, scale=scale)
    heads, groups = q.shape[1], k.shape[1]
    padded = F.pad(lse, (0, -c % LSE_ALIGN))
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    out = out.transpose(1, 2).contiguous().transpose(1, 2)
    bias = None if bias is None else bias.expand(q.shape[0], heads, *bias.shape)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, _repeat_kv(k, heads), _repeat_kv(v, heads), bias, out, padded, seed, seed, 0.0,
        [True, True, True, False], causal, scale=scale)
    return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)
