"""Cross-entropy over vocabulary-sharded logits, without ever gathering the full logits.

Each TP rank holds logits for a contiguous vocabulary range. Three all-reduces over TP (max, target
logit, sum of exponentials) give the exact loss: loss = log(sum_j exp(z_j - m)) - (z_target - m).
Backward is softmax - one_hot, computed locally.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        logits = logits.float()
        local_vocab = logits.shape[-1]
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        outside = (target < vocab_start) | (target >= vocab_start + local_vocab)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=group)

        exp = shifted.exp_()                                   # reuse the buffer: shifted is not needed again
        sum_exp = exp.sum(dim=-1)
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


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_start: int) -> torch.Tensor:
    """Per-token losses (fp32) for logits [..., V/tp] holding vocabulary [vocab_start, vocab_start + V/tp)."""
    if group is None:
        v = logits.shape[-1]
        return F.cross_entropy(logits.float().reshape(-1, v), target.reshape(-1), reduction="none").view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start)
