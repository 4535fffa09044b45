"""The optimizer step over fp32 master weights, for fp32, bf16 and fp16 (loss-scaled) models.

The optimizer is made of parts, each in its own module: the master weights of the pieces of the flat
layout this rank updates (master_weights.py), the fp16 loss scaler (loss_scaler.py), the gradient
clipper (clip_grads.py) and the update rule that --optimizer names (rules/: AdamW, Muon). The coordinator
here owns them and runs one step in this order: unscale and check for overflow (fp16) -> global norm
-> clip -> decoupled weight decay -> the rule's update -> copy back into the model's dtype -> the
after-step hook (the distributed optimizer's parameter all-gather, distrib_optimizer.py).

What checkpoints, memory reports and the planner read of the rule's state goes through
``state_names``, ``named_state(master)`` and ``step_count``, never through the rule's internals.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from megalite.config.schema import ModelConfig, OptimizerConfig
from megalite.optim.clip_grads import GradClipper, any_not_finite, clip_pieces
from megalite.optim.loss_scaler import ConstantLossScaler, DynamicLossScaler
from megalite.optim.master_weights import MasterWeights, Piece
from megalite.optim.muon_matrices import build_matrix, is_muon_matrix
from megalite.optim.muon_redistribute import row_sharded_muon
from megalite.optim.rules import RULES
from megalite.optim.rules.muon import Muon
from megalite.parallel.data.protocol import DataParallel, FlatLayout
from megalite.parallel.dry_run import REAL_RUN
from megalite.observe.clocks import waiting


@dataclass
class StepResult:
    update_successful: bool
    grad_norm: float | None
    nonfinite: bool = False      # bf16/fp32: the gradient norm was NaN/Inf, so the update was refused


class MixedPrecisionOptimizer:
    grads_sharded = False        # True when each data-parallel rank holds a different part of the gradients
    qk_clip = None               # qk_clip.QKClip: after every step (refused or not), before the copy back

    def __init__(self, buffer: FlatLayout, named_params: list[tuple[str, nn.Parameter]],
                 config: OptimizerConfig, parallel=None, ddp: DataParallel | None = None,
                 model: ModelConfig | None = None):
        """``parallel`` (ParallelState): reduce the norm / overflow flag over the model-parallel group.
        ``ddp``: the data-parallel backend owning ``buffer`` (zero_grad resets its step state).
        ``model``: the model's config (Muon splits fused weights into their logical matrices by it)."""
        self.buffer, self.config, self.ddp, self.parallel = buffer, config, ddp, parallel
        muon = config.optimizer == "muon"
        self.matrix_names = {n for n, p in named_params if is_muon_matrix(n, p)} if muon else set()
        self.weights = MasterWeights(buffer, named_params, self._pieces(), config.decoupled_lr is not None,
                                     whole=tuple(sorted(self.matrix_names)), row_shards=buffer.row_shards)
        self.clipper = GradClipper(named_params, buffer.slots, self.pieces, parallel, self._shard_groups())
        tp, etp = (parallel.group("tp"), parallel.group("etp")) if parallel is not None else (None, None)
        if muon and buffer.row_shards:         # FSDP2: each matrix gathered whole on its owner
            self.rule = row_sharded_muon(self.weights, named_params, buffer, model, config, (tp, etp), ddp.group)
        elif muon:
            params = dict(named_params)
            matrices = [None if n is None else build_matrix(n, params[n], model, config, tp, etp)
                        for n in self.weights.whole_names]
            self.rule = Muon(self.master_pieces, self.weights.decoupled, config, matrices)
        else:
            self.rule = RULES[config.optimizer](self.master_pieces, self.weights.decoupled, config)
        # fp16 compute needs loss scaling (FSDP2's shards are fp32 while forward/backward run in fp16)
        self.loss_scaler = _build_loss_scaler(config) if buffer.compute_dtype == torch.float16 else None

    # ---- what this optimizer updates -------------------------------------------------------------
    def _pieces(self) -> list[Piece]:
        return [Piece(0, self.buffer.numel, self.buffer.param_data, self.buffer.grad_data)]

    def _shard_groups(self) -> tuple:
        """(dense, expert) groups over which ranks hold different gradient shards: none here."""
        return None, None

    @property
    def pieces(self) -> list[Piece]:
        return self.weights.pieces

    @property
    def master_pieces(self) -> list[torch.Tensor]:
        return self.weights.masters

    def norm_classes(self) -> list[tuple[list, list]]:
        """[(segments per piece, groups)] of the global norm: dense parameters, then expert weights."""
        return self.clipper.norm_classes()

    @property
    def master(self) -> torch.Tensor:
        """The fp32 master weights this rank updates, as one flat tensor."""
        if self.weights.flat is not None:
            return self.weights.flat
        return self.master_pieces[0] if len(self.master_pieces) == 1 else torch.cat(self.master_pieces)

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def zero_grad(self) -> None:
        if self.ddp is not None:
            self.ddp.zero_grad()
        else:
            self.buffer.zero_grad()

    # ---- the update rule's state -----------------------------------------------------------------
    @property
    def state_names(self) -> tuple[str, ...]:
        """The names of the rule's per-element state tensors (AdamW: exp_avg, exp_avg_sq)."""
        return self.rule.state_names

    def state_names_of(self, name: str) -> tuple[str, ...]:
        """The names of the rule's state tensors of parameter ``name`` (Muon: a matrix's momentum, AdamW's
        moments for the rest)."""
        return self.rule.matrix_state_names if name in self.matrix_names else self.rule.state_names

    def named_state(self, master: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rule's state tensors of one master piece, by name."""
        return self.rule.named_state(master)

    @property
    def step_count(self) -> float:
        """Updates taken (the rule's step counter)."""
        return self.rule.step_count

    def set_step_count(self, value: float) -> None:
        """Restore the rule's step counter (a checkpoint's, or 0 without its optimizer state)."""
        self.rule.step_count = value

    def state_tensors(self) -> list[torch.Tensor]:
        """What state_bytes counts: the rule's tensors and the fp32 master copy (when it is not the weights)."""
        return self.rule.state_tensors() + ([self.weights.flat] if self.weights.flat is not None else [])

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: the rule's state (AdamW: moments and step counters)
        and the fp32 master copy when it is not the model's own fp32 weights."""
        return sum(t.untyped_storage().nbytes() for t in self.state_tensors())

    # ---- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float, decoupled_lr: float | None = None) -> StepResult:
        """One update at learning rate ``lr`` (``decoupled_lr`` for the input embedding and output layer
        with --decoupled-lr)."""
        grads = self.weights.grads
        run = REAL_RUN if self.parallel is None else self.parallel.run     # whether the values mean anything
        if self.loss_scaler is not None and run.heeds(self._overflowed(grads)):
            return self._refused(StepResult(False, None))
        grad_norm = self.clipper.norm(grads)
        if run.heeds(not math.isfinite(grad_norm)):     # the same on every rank: all refuse the update
            return self._refused(StepResult(False, grad_norm, nonfinite=True))
        clip_pieces(grads, self.config.clip_grad, grad_norm)
        group_lr = {False: lr, True: lr if decoupled_lr is None else decoupled_lr}
        if self.config.weight_decay > 0.0:
            self.weights.decay(group_lr, self.config.weight_decay)
        self.rule.step(self.master_pieces, grads, group_lr)
        self._publish()
        return StepResult(True, grad_norm)

    def _publish(self) -> None:
        """QK-clip's rescale (with --qk-clip), then the masters into the model and to the other ranks."""
        if self.qk_clip is not None:
            self.qk_clip.after_update(self.weights)
        self.weights.copy_back()
        with waiting():                 # ZeRO: the parameter all-gather
            self._after_step()

    def _refused(self, result: StepResult) -> StepResult:
        """A refused update still ends the step's max-logit record and clips, as Megatron's QK-clip runs
        after every optimizer step."""
        if self.qk_clip is not None:
            self._publish()
        return result

    def _overflowed(self, grads: list[torch.Tensor]) -> bool:
        """fp16: unscale the gradients, and whether any rank found an inf/NaN (the scaler updates)."""
        for g in grads:
            g.mul_(1.0 / self.loss_scaler.scale)
        found_inf = any_not_finite(grads, self.clipper.groups())
        self.loss_scaler.update(found_inf)
        return found_inf

    def _after_step(self) -> None:
        """Hook for the distributed optimizer: share the updated parameters."""


def _build_loss_scaler(config: OptimizerConfig):
    if config.loss_scale is not None:
        return ConstantLossScaler(config.loss_scale)
    return DynamicLossScaler(config.initial_loss_scale, config.min_loss_scale, config.loss_scale_window,
                             config.hysteresis)
