"""Cross-entropy over vocabulary-sharded logits, without ever gathering the full logits.

Each TP rank holds logits for a contiguous vocabulary range. Three all-reduces over TP (max, target
logit, sum of exponentials) give the exact loss: loss = log(sum_j exp(z_j - m)) - (z_target - m).
Backward is softmax - one_hot, computed locally.

With no group (one TP rank) there is nothing to reduce: either loss runs without its all-reduces. The
unfused one is then the plain loss computed in place: on a CPU it runs in about half F.cross_entropy's
time, and its backward holds no more than its saved softmax, where F.cross_entropy's backward holds two
more fp32 [tokens, V] tensors (the one-hot loss gradient and log_softmax's input gradient).

Two implementations:
- ``vocab_parallel_cross_entropy(..., fused=False)``: upcast all logits to fp32 and keep the fp32 softmax
  for backward: 4·s·b·V/tp bytes on top of the logits, at Llama-3's vocabulary the largest activation.
- ``fused=True`` (``--cross-entropy-loss-fusion``): ``_ChunkedCrossEntropy`` upcasts ``chunk_tokens``
  tokens' logits at a time, keeps only the low-precision logits and one fp32 log-sum-exp per token for
  backward, and recomputes each chunk's softmax there. The fp32 working set is one chunk.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        logits = logits.float()
        local_vocab = logits.shape[-1]
        logits_max = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        outside = (target < vocab_start) | (target >= vocab_start + local_vocab)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()                                   # reuse the buffer: shifted is not needed again
        sum_exp = exp.sum(dim=-1)
        if group is not None:
            dist.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax                                          # d loss / d logits = softmax - one_hot
        one_hot = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -one_hot.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


# fp32 elements of one chunk's working set: 16M (64 MiB), whatever the vocabulary
CHUNK_ELEMENTS = 1 << 24


def default_chunk_tokens(local_vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // local_vocab)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Exact vocabulary-parallel cross-entropy whose fp32 temporaries are one chunk of tokens.

    Forward: the row max and the target logit need no upcast (max and gather are exact in the logits'
    dtype); the sum of exponentials is accumulated a chunk of rows at a time in fp32. Saved for
    backward: the logits as they are (low precision) and log-sum-exp per token (fp32). Backward
    recomputes softmax - one_hot per chunk in fp32 and writes it into a gradient of the logits' dtype.
    """

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, chunk_tokens):
        local_vocab = logits.shape[-1]
        flat = logits.reshape(-1, local_vocab)
        flat_target = target.reshape(-1)
        outside = (flat_target < vocab_start) | (flat_target >= vocab_start + local_vocab)
        local_target = (flat_target - vocab_start).masked_fill(outside, 0)

        row_max = flat.max(dim=-1).values.float()
        target_logit = flat.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float().masked_fill(outside, 0.0)
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=group)
        sum_exp = torch.empty_like(row_max)
        for start in range(0, flat.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            sum_exp[rows] = (flat[rows].float() - row_max[rows, None]).exp_().sum(dim=-1)
        if group is not None:
            dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        log_sum_exp = sum_exp.log_().add_(row_max)            # log(sum_j exp(z_j)), per token
        ctx.save_for_backward(logits, log_sum_exp, local_target, outside)
        ctx.chunk_tokens = chunk_tokens
        return (log_sum_exp - target_logit).view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, log_sum_exp, local_target, outside = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        grad_flat = grad_loss.reshape(-1).float()
        inside = (~outside).float()
        grad = torch.empty_like(flat)
        for start in range(0, flat.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            softmax = (flat[rows].float() - log_sum_exp[rows, None]).exp_()
            softmax.scatter_add_(-1, local_target[rows, None], -inside[rows, None])      # - one_hot
            grad[rows] = softmax.mul_(grad_flat[rows, None])
        return grad.view(logits.shape), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_start: int,
                                 fused: bool = False, chunk_tokens: int | None = None) -> torch.Tensor:
    """Per-token losses (fp32) for logits [..., V/tp] holding vocabulary [vocab_start, vocab_start + V/tp).

    ``fused``: the chunked implementation (``--cross-entropy-loss-fusion``); ``chunk_tokens`` tokens per
    chunk (default: 16M fp32 elements per chunk)."""
    if fused:
        chunk = chunk_tokens or default_chunk_tokens(logits.shape[-1])
        return _ChunkedCrossEntropy.apply(logits, target, group, vocab_start, chunk)
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start)
