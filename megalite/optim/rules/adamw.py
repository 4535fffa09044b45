"""AdamW as an update rule: PyTorch's fused AdamW over the fp32 master pieces.

An update rule steps the master pieces (optim/master_weights.py) with their gradients, once per
optimizer step, and names its per-element state tensors (``state_names``), which checkpoints save
and memory reports count through ``named_state``. Weight decay is applied by the optimizer before
the rule (decoupled, on the master's decay ranges), so torch's AdamW runs with weight_decay 0.

Two parameter groups: the pieces at --lr and those at --decoupled-lr (``decoupled``). The state
(m, v and the step counter) is allocated at construction, in the form torch creates it lazily at the
first step, so start-up memory reports measure it and the first step is unchanged.
"""
from __future__ import annotations

import torch

from megalite.config.schema import OptimizerConfig


class AdamW:
    state_names = ("exp_avg", "exp_avg_sq")
    matrix_state_names = state_names

    def __init__(self, masters: list[torch.Tensor], decoupled: list[bool], config: OptimizerConfig):
        groups = [{"params": [m for m, d in zip(masters, decoupled) if d == flag], "decoupled": flag}
                  for flag in (False, True)]
        self.torch = torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr,
                                       betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                                       weight_decay=0.0, **_fastest_adam_impl(masters[0]))
        fused = self.torch.param_groups[0].get("fused")
        for group in self.torch.param_groups:
            for p in group["params"]:
                self.torch.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu"),
                    **{name: torch.zeros_like(p, memory_format=torch.preserve_format) for name in self.state_names}}

    def step(self, masters: list[torch.Tensor], grads: list[torch.Tensor], group_lr: dict[bool, float]) -> None:
        """One AdamW update of ``masters`` by ``grads``, each group at its learning rate."""
        for group in self.torch.param_groups:
            group["lr"] = group_lr[group["decoupled"]]
        for master, g in zip(masters, grads):
            master.grad = g
        self.torch.step()
        for master in masters:
            master.grad = None

    def named_state(self, master: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.torch.state[master]
        return {name: state[name] for name in self.state_names}

    @property
    def step_count(self) -> float:
        return float(next(iter(self.torch.state.values()))["step"])

    @step_count.setter
    def step_count(self, value: float) -> None:
        for state in self.torch.state.values():
            state["step"].fill_(value)

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the rule's state (moments and step counters)."""
        return [t for state in self.torch.state.values() for t in state.values() if torch.is_tensor(t)]


def _fastest_adam_impl(tensor: torch.Tensor) -> dict:
    """PyTorch's fused AdamW kernel where the device has one (CPU and CUDA do), else foreach."""
    try:
        probe = torch.zeros(1, device=tensor.device, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        torch.optim.AdamW([probe], fused=True).step()
        return {"fused": True}
    except (RuntimeError, TypeError):
        return {"foreach": True}
