"""What the training step and loop read of a run: the ``Run`` protocol, which the Trainer (trainer.py)
satisfies, and the run's position and outcome (``TrainState``).

The step (step.py) and the loop (loop.py) take a ``Run``; they sit below trainer.py, which builds one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from megalite.config.schema import MegaliteConfig
from megalite.model.gpt import GPTModel
from megalite.optim.lr_scheduler import LRScheduler
from megalite.optim.mixed_precision import MixedPrecisionOptimizer
from megalite.parallel.data.protocol import DataParallel
from megalite.parallel.mesh import ParallelState
from megalite.parallel.pipeline.p2p import PipelineComm
from megalite.parallel.pipeline.pipedream import AsyncPipeline
from megalite.observe.clocks import Timers


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    exit_reason: str | None = None                   # why training stopped before --train-iters, if it did
    last_local_loss: torch.Tensor | None = None      # this rank's own loss of the last step, on the device
                                                     # (NaN diagnosis)
    history: list = field(default_factory=list)      # per-iteration lm loss as this rank has it (0.0 on
                                                     # pipeline ranks without the loss), for callers and
                                                     # tests; filled when the loop logs and at its end


class Run(Protocol):
    """One rank's built run: ``config``, ``parallel``, ``device``, ``model`` (the first chunk), ``chunks``
    (this rank's pipeline stages), ``ddp`` (data-parallel gradient sync / ZeRO sharding), ``optimizer``,
    ``scheduler``, ``timers``, ``state``, ``pipeline`` (stage-to-stage exchange when pp > 1),
    ``async_pipeline`` (--pipeline-schedule pipedream / pipedream-2bw), ``last_saved_iteration`` (of the
    checkpoint last saved or loaded); ``print_fn`` prints a line; ``save`` checkpoints, ``poll_saves``
    reports a background save that has finished."""
    config: MegaliteConfig
    parallel: ParallelState
    device: torch.device
    model: GPTModel
    chunks: list[GPTModel]
    ddp: DataParallel
    optimizer: MixedPrecisionOptimizer
    scheduler: LRScheduler
    timers: Timers
    state: TrainState
    pipeline: PipelineComm | None
    async_pipeline: AsyncPipeline | None
    last_saved_iteration: int | None
    print_fn: Callable[[str], None]

    def save(self, non_persistent: bool = False) -> None: ...

    def poll_saves(self, wait: bool = False) -> None: ...
