"""Learning-rate schedules with warm-up, following Megatron's OptimizerParamScheduler.

Steps are counted in completed iterations. Iteration k (1-based) trains with ``lr_at(k - 1)``; as in
Megatron the scheduler advances only after a successful update, and the logged learning rate is the
one for the next iteration.
"""
from __future__ import annotations

import math

from megalite.config.schema import OptimizerConfig


class LRScheduler:
    def __init__(self, config: OptimizerConfig, train_iters: int):
        self.max_lr = config.lr
        self.min_lr = config.min_lr
        # --decoupled-lr: the input embedding and output layer follow the same schedule between their own
        # maximum and minimum (Megatron's decoupled_lr / decoupled_min_lr; the minimum defaults to --min-lr)
        self.decoupled_max_lr = config.decoupled_lr
        self.decoupled_min_lr = config.min_lr if config.decoupled_min_lr is None else config.decoupled_min_lr
        self.init_lr = config.lr_warmup_init
        self.style = config.lr_decay_style
        self.warmup = float(config.lr_warmup_iters)
        self.decay = float(config.lr_decay_iters if config.lr_decay_iters is not None else train_iters)
        self.wsd_decay = float(config.lr_wsd_decay_iters or 0)
        self.wsd_style = config.lr_wsd_decay_style
        self.num_steps = 0

    def lr_at(self, step: float, max_lr: float | None = None, min_lr: float | None = None) -> float:
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.warmup > 0 and step <= self.warmup:
            return self.init_lr + (max_lr - self.init_lr) * step / self.warmup
        if self.style == "constant":
            return max_lr
        if step > self.decay:
            return min_lr
        if self.style == "inverse-square-root":
            warmup, step = max(self.warmup, 1.0), max(step, 1.0)
            return max(min_lr, max_lr * math.sqrt(warmup) / math.sqrt(step))
        return min_lr + (max_lr - min_lr) * self._decay_coefficient(step)

    def _decay_coefficient(self, step: float) -> float:
        if self.style == "WSD":
            anneal_start = self.decay - self.wsd_decay
            if step <= anneal_start:
                return 1.0
            return _anneal(self.wsd_style, (step - anneal_start) / self.wsd_decay)
        ratio = (step - self.warmup) / (self.decay - self.warmup)
        return _anneal(self.style, ratio)

    @property
    def lr(self) -> float:
        return self.lr_at(self.num_steps)

    @property
    def decoupled_lr(self) -> float | None:
        """The input embedding's and output layer's learning rate now (None without --decoupled-lr)."""
        if self.decoupled_max_lr is None:
            return None
        return self.lr_at(self.num_steps, self.decoupled_max_lr, self.decoupled_min_lr)

    def step(self) -> None:
        self.num_steps += 1

    def state_dict(self) -> dict:
        """The position in the schedule; the schedule's shape is recorded for reference (resuming uses
        the current flags, like Megatron's --override-opt_param-scheduler)."""
        return {"num_steps": self.num_steps, "decay_iters": self.decay, "warmup_iters": self.warmup,
                "max_lr": self.max_lr, "min_lr": self.min_lr, "style": self.style}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])


def _anneal(style: str, ratio: float) -> float:
    """Coefficient in [0, 1] going from 1 (ratio 0) to 0 (ratio 1)."""
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"unknown decay style {style!r}")
