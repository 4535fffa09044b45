"""Contiguous storage for all parameters and their fp32 gradients ("main_grad").

Every parameter's data becomes a view into one flat buffer in the model's dtype, and every gradient
accumulates into a view of one flat fp32 buffer, in reverse parameter order (the order backward
produces them). One flat tensor makes the optimizer step, gradient clipping and (with data
parallelism) the reduction a handful of large operations instead of one per parameter.

fp32 models: ``param.grad`` *is* the main_grad view, so autograd accumulates into it in place.
bf16/fp16 models: a post-accumulate hook adds the low-precision grad into the fp32 main_grad and frees
it, so micro-batch accumulation happens in fp32 (Megatron's behaviour).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class BufferSlot:
    start: int
    end: int
    shape: tuple


class ParamAndGradBuffer:
    def __init__(self, named_params: list[tuple[str, nn.Parameter]]):
        if not named_params:
            raise ValueError("ParamAndGradBuffer needs at least one parameter")
        dtypes = {p.dtype for _, p in named_params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters of one buffer must share a dtype, got {dtypes}")
        self.param_dtype = dtypes.pop()
        self.params = [p for _, p in named_params]
        self.slots: dict[str, BufferSlot] = {}
        numel = sum(p.numel() for p in self.params)
        device = self.params[0].device
        self.param_data = torch.empty(numel, dtype=self.param_dtype, device=device)
        self.grad_data = torch.zeros(numel, dtype=torch.float32, device=device)
        offset = 0
        for name, param in reversed(named_params):
            n = param.numel()
            self.slots[name] = BufferSlot(offset, offset + n, tuple(param.shape))
            self.param_data[offset:offset + n].copy_(param.data.view(-1))
            param.data = self.param_data[offset:offset + n].view(param.shape)
            param.main_grad = self.grad_data[offset:offset + n].view(param.shape)
            offset += n
        self.grads_are_main_grads = self.param_dtype == torch.float32
        self._hooks = []
        if not self.grads_are_main_grads:
            self._hooks = [p.register_post_accumulate_grad_hook(_accumulate_into_main_grad) for p in self.params]
        self.zero_grad()

    def zero_grad(self) -> None:
        self.grad_data.zero_()
        if self.grads_are_main_grads:
            for p in self.params:
                p.grad = p.main_grad
        else:
            for p in self.params:
                p.grad = None

    def view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """The part of a buffer-shaped flat tensor (params, grads, optimizer state) belonging to ``name``."""
        slot = self.slots[name]
        return flat[slot.start:slot.end].view(slot.shape)


def _accumulate_into_main_grad(param: nn.Parameter) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None
