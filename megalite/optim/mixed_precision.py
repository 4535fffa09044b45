"""AdamW over fp32 master weights, for fp32, bf16 and fp16 (loss-scaled) models.

The model's parameters live in one flat layout (parallel/data/protocol.py's FlatLayout: the
ParamAndGradBuffer, or FSDP2's shards). The optimizer keeps an fp32 master copy of the
part of the flat buffer it updates (the buffer itself for fp32 models), steps it with PyTorch's fused
AdamW, and copies the result back into the model's dtype. Weight decay is decoupled (AdamW) and
skipped for biases and norm weights, as in Megatron.

The part it updates is a list of "pieces" of the flat layout: the whole buffer here; this rank's
chunk of every bucket for the distributed optimizer (distrib_optimizer.py, ZeRO), which subclasses
this one. Adam state (m, v) is allocated eagerly so start-up memory reports measure it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from megalite.config.schema import OptimizerConfig
from megalite.parallel.data.protocol import DataParallel, FlatLayout
from megalite.optim.clip_grads import (any_not_finite, clip_pieces, expert_norm_weights, local_segments,
                                       norm_over_classes, norm_weights)
from megalite.parallel.param_meta import param_meta
from megalite.optim.loss_scaler import ConstantLossScaler, DynamicLossScaler
from megalite.train.straggler import waiting


def uses_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Megatron's rule: no decay on biases and on 1-D parameters (norm weights)."""
    return not (name.endswith(".bias") or param.dim() == 1)


@dataclass
class StepResult:
    update_successful: bool
    grad_norm: float | None
    nonfinite: bool = False      # bf16/fp32: the gradient norm was NaN/Inf, so the update was refused


@dataclass
class Piece:
    """A range [start, end) of the flat layout this rank updates, with its parameter and fp32 gradient."""
    start: int
    end: int
    param: torch.Tensor          # model dtype, 1-D view
    grad: torch.Tensor           # fp32, 1-D view


class MixedPrecisionAdamW:
    grads_sharded = False        # True when each data-parallel rank holds a different part of the gradients

    def __init__(self, buffer: FlatLayout, named_params: list[tuple[str, nn.Parameter]],
                 config: OptimizerConfig, grad_norm_fn=None, parallel=None, ddp: DataParallel | None = None):
        """``parallel`` (ParallelState): reduce the norm / overflow flag over the model-parallel group.
        ``ddp``: the data-parallel backend owning ``buffer`` (zero_grad resets its step state).
        ``grad_norm_fn``: overrides the global-norm computation (returns the norm as a float)."""
        self.buffer = buffer
        self.config = config
        self.ddp = ddp
        self.parallel = parallel
        self.grad_norm_fn = grad_norm_fn
        self.pieces = self._pieces()
        self.decoupled = [False] * len(self.pieces)
        if config.decoupled_lr is not None:
            self.pieces, self.decoupled = _split_pieces(self.pieces, _merge_ranges(sorted(
                (buffer.slots[n].start, buffer.slots[n].end) for n, _ in named_params if is_embedding_or_output(n))))
        fp32 = buffer.param_dtype == torch.float32
        if fp32:
            self.master_pieces = [p.param for p in self.pieces]     # the model's own weights are the master copy
            self._master_flat = None
        else:
            # filled piece by piece: a list of fp32 copies joined by cat would hold the master twice
            self._master_flat = torch.empty(sum(p.end - p.start for p in self.pieces), dtype=torch.float32,
                                            device=self.pieces[0].param.device)
            self.master_pieces, offset = [], 0
            for p in self.pieces:
                master = self._master_flat[offset:offset + p.end - p.start]
                master.copy_(p.param.detach())
                self.master_pieces.append(master)
                offset += p.end - p.start
        decay = _merge_ranges(sorted((buffer.slots[n].start, buffer.slots[n].end)
                                     for n, p in named_params if uses_weight_decay(n, p)))
        self.decay_ranges = [[(lo, hi) for lo, hi, _ in local_segments([(s, e, 1.0) for s, e in decay],
                                                                        p.start, p.end)] for p in self.pieces]
        tp_rank = parallel.tp_rank if parallel is not None else 0
        weights = norm_weights(named_params, buffer.slots, tp_rank)
        self.norm_segments = [local_segments(weights, p.start, p.end) for p in self.pieces]
        self.expert_norm_segments = None            # MoE: the expert weights' class of the norm (clip_grads.py)
        if any(param_meta(p).expert for _, p in named_params) or \
                (parallel is not None and parallel.group("expert_mp") is not None):
            experts = expert_norm_weights(named_params, buffer.slots)
            self.expert_norm_segments = [local_segments(experts, p.start, p.end) for p in self.pieces]
        groups = [{"params": [m for m, d in zip(self.master_pieces, self.decoupled) if d == decoupled],
                   "decoupled": decoupled} for decoupled in (False, True)]
        self.adam = torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr,
                                      betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                                      weight_decay=0.0, **_fastest_adam_impl(self.master_pieces[0]))
        _init_adam_state(self.adam)
        # fp16 compute needs loss scaling (FSDP2's shards are fp32 while forward/backward run in fp16)
        self.loss_scaler = _build_loss_scaler(config) if buffer.compute_dtype == torch.float16 else None

    # ---- what this optimizer updates -------------------------------------------------------------
    def _pieces(self) -> list[Piece]:
        return [Piece(0, self.buffer.numel, self.buffer.param_data, self.buffer.grad_data)]

    def _reduction_groups(self) -> list:
        """Groups over which the dense parameters' squared norm and the overflow flag are summed / maxed."""
        groups = []
        if self.parallel is not None and self.parallel.tp_size * self.parallel.pp_size > 1:
            groups.append(self.parallel.group("mp"))
        if self.grads_sharded and self.ddp is not None and self.ddp.group is not None:
            groups.append(self.ddp.shard_group)         # replicas (hybrid sharding) hold the same shards
        return groups

    def _expert_reduction_groups(self) -> list:
        """The same for the expert weights: the expert model-parallel group, and EDP when sharded."""
        p = self.parallel
        if p is None or p.group("expert_mp") is None:
            return []
        groups = [p.group("expert_mp")] if p.ep_size * p.etp_size * p.pp_size > 1 else []
        if self.grads_sharded and p.edp_size > 1:
            groups.append(p.group("edp_shard" if p.instances > 1 else "edp"))
        return groups

    def norm_classes(self) -> list[tuple[list, list]]:
        """[(segments per piece, groups)] of the global norm: dense parameters, then expert weights."""
        classes = [(self.norm_segments, self._reduction_groups())]
        if self.expert_norm_segments is not None:
            classes.append((self.expert_norm_segments, self._expert_reduction_groups()))
        return classes

    @property
    def master(self) -> torch.Tensor:
        """The fp32 master weights this rank updates, as one flat tensor."""
        if self._master_flat is not None:
            return self._master_flat
        return self.master_pieces[0] if len(self.master_pieces) == 1 else torch.cat(self.master_pieces)

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    # ---- the named state a checkpoint reads and restores ----------------------------------------
    state_names = ("exp_avg", "exp_avg_sq")     # the update rule's per-element state, one tensor each per piece

    def named_state(self, master_piece: torch.Tensor) -> dict[str, torch.Tensor]:
        """The update rule's state tensors of one master piece, by name (``state_names``)."""
        state = self.adam.state[master_piece]
        return {name: state[name] for name in self.state_names}

    @property
    def step_count(self) -> float:
        """Updates applied so far (the same on every piece)."""
        return float(self.adam.state[self.master_pieces[0]]["step"])

    def set_step_count(self, value: float) -> None:
        for master in self.master_pieces:
            self.adam.state[master]["step"].fill_(value)

    def zero_grad(self) -> None:
        if self.ddp is not None:
            self.ddp.zero_grad()
        else:
            self.buffer.zero_grad()

    def state_tensors(self) -> list[torch.Tensor]:
        """What state_bytes counts: Adam's tensors and the fp32 master copy (when it is not the weights)."""
        tensors = [t for state in self.adam.state.values() for t in state.values() if torch.is_tensor(t)]
        return tensors + ([self._master_flat] if self._master_flat is not None else [])

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: Adam's moments (+ step counters) and the fp32
        master copy when it is not the model's own fp32 weights."""
        return sum(t.untyped_storage().nbytes() for t in self.state_tensors())

    # ---- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float, decoupled_lr: float | None = None) -> StepResult:
        """One update at learning rate ``lr`` (``decoupled_lr`` for the input embedding and output layer
        with --decoupled-lr)."""
        grads = [p.grad for p in self.pieces]
        classes = self.norm_classes()
        # a --fake-process-group dry run computes on what its absent peers never sent: its values mean
        # nothing, and the update runs whatever they are, for the memory and time it takes
        dry_run = self.parallel is not None and self.parallel.fake
        if self.loss_scaler is not None:
            for g in grads:
                g.mul_(1.0 / self.loss_scaler.scale)
            found_inf = any_not_finite(grads, [group for _, groups in classes for group in groups])
            self.loss_scaler.update(found_inf)
            if found_inf and not dry_run:
                return StepResult(False, None)
        if self.grad_norm_fn is not None:
            grad_norm = self.grad_norm_fn()
        else:
            grad_norm = norm_over_classes(grads, classes)
        if not math.isfinite(grad_norm) and not dry_run:     # the same on every rank: all refuse the update
            return StepResult(False, grad_norm, nonfinite=True)
        clip_pieces(grads, self.config.clip_grad, grad_norm)
        group_lr = {False: lr, True: lr if decoupled_lr is None else decoupled_lr}
        if self.config.weight_decay > 0.0:
            for master, ranges, decoupled in zip(self.master_pieces, self.decay_ranges, self.decoupled):
                shrink = 1.0 - group_lr[decoupled] * self.config.weight_decay
                for start, end in ranges:
                    master[start:end].mul_(shrink)
        for group in self.adam.param_groups:
            group["lr"] = group_lr[group["decoupled"]]
        for master, g in zip(self.master_pieces, grads):
            master.grad = g
        self.adam.step()
        for master, piece in zip(self.master_pieces, self.pieces):
            master.grad = None
            if master is not piece.param:
                piece.param.copy_(master)
        with waiting():                 # ZeRO: the parameter all-gather
            self._after_step()
        return StepResult(True, grad_norm)

    def _after_step(self) -> None:
        """Hook for the distributed optimizer: share the updated parameters."""


def is_embedding_or_output(name: str) -> bool:
    """The parameters --decoupled-lr applies to (Megatron: the input embedding and the output layer)."""
    return name.endswith(("embedding.word_embeddings.weight", "output_layer.weight"))


def _split_pieces(pieces: list[Piece], ranges: list[tuple[int, int]]) -> tuple[list[Piece], list[bool]]:
    """Cut pieces where ``ranges`` (sorted, disjoint flat ranges) begin and end; returns the finer pieces
    and whether each lies inside ``ranges``."""
    out, inside = [], []
    for piece in pieces:
        cuts = sorted({piece.start, piece.end} | {b for r in ranges for b in r if piece.start < b < piece.end})
        for lo, hi in zip(cuts, cuts[1:]):
            a, b = lo - piece.start, hi - piece.start
            out.append(Piece(lo, hi, piece.param[a:b], piece.grad[a:b]))
            inside.append(any(s <= lo and hi <= e for s, e in ranges))
    return out, inside


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


def _init_adam_state(adam: torch.optim.AdamW) -> None:
    """Allocate m, v and the step counter now (torch does it lazily at the first step), in the form
    torch's AdamW creates them, so memory is measurable at start-up and the first step is unchanged."""
    fused = adam.param_groups[0].get("fused")
    for group in adam.param_groups:
        for p in group["params"]:
            adam.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu"),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }


def _build_loss_scaler(config: OptimizerConfig):
    if config.loss_scale is not None:
        return ConstantLossScaler(config.loss_scale)
    return DynamicLossScaler(config.initial_loss_scale, config.min_loss_scale, config.loss_scale_window,
                             config.hysteresis)
