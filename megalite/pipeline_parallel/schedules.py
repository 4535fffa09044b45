"""Forward/backward schedules over the micro-batches of one global batch.

Every schedule calls ``loss_fn(batch) -> (loss, num_tokens)`` per micro-batch, where ``loss`` is the
mean per-token loss of that micro-batch, and backpropagates ``loss * loss_scale / num_microbatches``
so the accumulated gradient is that of the mean over micro-batches (Megatron's default).
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch


def forward_backward_no_pipelining(loss_fn: Callable, data_iterator: Iterator, num_microbatches: int,
                                   loss_scale: float = 1.0, forward_only: bool = False) -> list[float]:
    """Gradient accumulation on one stage; returns each micro-batch's mean loss."""
    losses = []
    for _ in range(num_microbatches):
        batch = next(data_iterator)
        if forward_only:
            with torch.no_grad():
                loss, _ = loss_fn(batch)
        else:
            loss, _ = loss_fn(batch)
            (loss * (loss_scale / num_microbatches)).backward()
        losses.append(loss.detach())
    return [float(x) for x in torch.stack(losses)]
