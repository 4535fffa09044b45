"""What a training checkpoint saves and restores of a run, as small typed parts.

Each stateful part of a run shows the checkpoint only what it saves and loads: the optimizer its pieces
and named state tensors (``ShardedOptimizer``), the LR schedule its state dict (``SchedulerState``), the
data position its counters (``TrainPosition``), the generators their states (``RNGStreams``). The model
is its chunks (their parameters, and every persistent buffer: ``persistent_buffers``) inside the
data-parallel backend that owns their flat buffer. ``CheckpointState`` bundles them; save.py and
sharded.py take it and nothing else of the run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from megalite.config.schema import MegaliteConfig
from megalite.parallel.data.protocol import DataParallel
from megalite.parallel.mesh import ParallelState
from megalite.parallel.pipeline.pipedream import AsyncPipeline


class StateDict(Protocol):
    """A part whose state is a JSON-able dict (the loss scaler, the LR schedule)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class ShardedOptimizer(Protocol):
    """The optimizer's state as the checkpoint reads it: the ranges of the flat parameter buffer this rank
    updates (``pieces``, each with ``start``, ``end`` and ``param``), their fp32 master copies, the update
    rule's per-element state by name (``state_names_of`` a parameter), its step count and the loss scaler."""
    pieces: list
    master_pieces: list[torch.Tensor]
    grads_sharded: bool
    state_names: tuple[str, ...]
    loss_scaler: StateDict | None

    def state_names_of(self, name: str) -> tuple[str, ...]: ...

    def named_state(self, master: torch.Tensor) -> dict[str, torch.Tensor]: ...

    @property
    def step_count(self) -> float: ...

    def set_step_count(self, value: float) -> None: ...


class SchedulerState(StateDict, Protocol):
    """The LR schedule: its position and lengths as a dict, and the iterations it decays over."""
    decay: float


class TrainPosition(Protocol):
    """Where training stands: iterations done, samples the data iterators consumed, steps skipped."""
    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int
    skipped_iterations: int
    nan_iterations: int


class RNGStreams(Protocol):
    """The tensor-parallel generator streams, by name (parallel/tensor/random.py)."""
    states: dict[str, torch.Tensor]


@dataclass
class CheckpointState:
    """One rank's part of a run, as a checkpoint saves and loads it. ``source``: where the weights first
    came from (metadata["source"] of the loaded checkpoint, kept on save)."""
    config: MegaliteConfig
    parallel: ParallelState
    device: torch.device
    chunks: list[nn.Module]
    data_parallel: DataParallel
    optimizer: ShardedOptimizer
    scheduler: SchedulerState
    train_state: TrainPosition
    rng: RNGStreams | None
    async_pipeline: AsyncPipeline | None = None
    source: dict | None = None

    @property
    def buffer(self):
        """The flat parameter buffer (its slots, buckets and dtype)."""
        return self.data_parallel.buffer


def persistent_buffers(chunks: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """(global name, tensor) of every persistent buffer of the chunks (those state_dict holds), each
    once. Buffers are equal on every rank of a pipeline stage that holds them, unless parallel/param_meta
    marks them tensor-parallel (then each TP rank holds its shard, stored like a parameter's)."""
    out = []
    for chunk in chunks:
        seen = set()
        for module_name, module in chunk.named_modules():
            for name, tensor in module.named_buffers(recurse=False):
                if name in module._non_persistent_buffers_set or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                out.append((chunk.global_name(f"{module_name}.{name}" if module_name else name), tensor))
    return out
