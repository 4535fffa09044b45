"""AdamW over fp32 master weights, for fp32, bf16 and fp16 (loss-scaled) models.

The model's parameters live in one ParamAndGradBuffer. The optimizer keeps one flat fp32 master copy
of it (the buffer itself for fp32 models), steps it with PyTorch's fused AdamW, and copies the result
back into the model's dtype. Weight decay is decoupled (AdamW) and skipped for biases and norm
weights, as in Megatron.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megalite.config import OptimizerConfig
from megalite.distributed.grad_buffer import ParamAndGradBuffer
from megalite.optimizer.clip_grads import clip_by_global_norm
from megalite.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler


def uses_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Megatron's rule: no decay on biases and on 1-D parameters (norm weights)."""
    return not (name.endswith(".bias") or param.dim() == 1)


@dataclass
class StepResult:
    update_successful: bool
    grad_norm: float | None


class MixedPrecisionAdamW:
    def __init__(self, buffer: ParamAndGradBuffer, named_params: list[tuple[str, nn.Parameter]],
                 config: OptimizerConfig):
        self.buffer = buffer
        self.config = config
        if buffer.param_dtype == torch.float32:
            self.master = buffer.param_data               # the model's own weights are the master copy
        else:
            self.master = buffer.param_data.detach().float()
        self.decay_ranges = _merge_ranges(sorted(
            (buffer.slots[n].start, buffer.slots[n].end) for n, p in named_params if uses_weight_decay(n, p)))
        self.adam = torch.optim.AdamW([self.master], lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                      eps=config.adam_eps, weight_decay=0.0, **_fastest_adam_impl(self.master))
        self.loss_scaler = _build_loss_scaler(config) if buffer.param_dtype == torch.float16 else None

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def zero_grad(self) -> None:
        self.buffer.zero_grad()

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        grads = self.buffer.grad_data
        if self.loss_scaler is not None:
            grads.mul_(1.0 / self.loss_scaler.scale)
            found_inf = not bool(torch.isfinite(grads).all())
            self.loss_scaler.update(found_inf)
            if found_inf:
                return StepResult(False, None)
        grad_norm = clip_by_global_norm(grads, self.config.clip_grad)
        if self.config.weight_decay > 0.0:
            shrink = 1.0 - lr * self.config.weight_decay
            for start, end in self.decay_ranges:
                self.master[start:end].mul_(shrink)
        self.adam.param_groups[0]["lr"] = lr
        self.master.grad = grads
        self.adam.step()
        self.master.grad = None
        if self.master is not self.buffer.param_data:
            self.buffer.param_data.copy_(self.master)
        return StepResult(True, grad_norm)


def _merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _fastest_adam_impl(tensor: torch.Tensor) -> dict:
    """PyTorch's fused AdamW kernel where the device has one (CPU and CUDA do), else foreach."""
    try:
        probe = torch.zeros(1, device=tensor.device, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        torch.optim.AdamW([probe], fused=True).step()
        return {"fused": True}
    except (RuntimeError, TypeError):
        return {"foreach": True}


def _build_loss_scaler(config: OptimizerConfig):
    if config.loss_scale is not None:
        return ConstantLossScaler(config.loss_scale)
    return DynamicLossScaler(config.initial_loss_scale, config.min_loss_scale, config.loss_scale_window,
                             config.hysteresis)
