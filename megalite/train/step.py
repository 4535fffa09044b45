"""One training step: forward/backward over a global batch's micro-batches, gradient sync, optimizer step.

The forward/backward dispatch picks the schedule: no pipeline, a synchronous pipeline schedule
(1F1B, interleaved 1F1B, GPipe, ZB-H1, ZB-V), or the asynchronous PipeDream schedules, which read
ahead into the next batch. Evaluation runs the same dispatch forward only (forward_only_losses).

Every function here but per_token_loss_weights takes the run (run.py's ``Run``: the Trainer) and reads
what it built: ``.model``, ``.chunks``, ``.ddp``, ``.optimizer``, ``.scheduler``, ``.pipeline``,
``.async_pipeline``, ``.timers``, ``.state``.
"""
from __future__ import annotations

import torch

from megalite.observe.clocks import waiting
from megalite.observe.memory import memory_label
from megalite.parallel.finalize_grads import finalize_model_grads
from megalite.parallel.mesh import ParallelState
from megalite.parallel.pipeline.executor import PipelineRecord
from megalite.parallel.pipeline.orders import StageMap, stage_placement
from megalite.parallel.pipeline.schedules import forward_backward_no_pipelining, forward_backward_pipelined
from megalite.parallel.pipeline.stages import LOSS_WEIGHT
from megalite.train.faults import collective_phase
from megalite.train.run import Run


def next_batches(trainer: Run, data_iterator, num_microbatches: int) -> list[dict]:
    """One step's micro-batches, each with its loss weight under --calculate-per-token-loss."""
    batches = [next(data_iterator) for _ in range(num_microbatches)]   # pipeline stages stay in step
    if not trainer.config.training.calculate_per_token_loss:
        return batches
    return per_token_loss_weights(batches, trainer.device, trainer.parallel)


def per_token_loss_weights(batches: list[dict], device: torch.device, parallel: ParallelState) -> list[dict]:
    """--calculate-per-token-loss (Megatron): the step's loss is the sum of every token's loss over all
    micro-batches and data-parallel ranks divided by their total count N, not a mean of micro-batch means.

    Everything downstream averages micro-batch means: the schedules backpropagate loss / m over m
    micro-batches, the data-parallel reduction divides by dp, the logged loss is averaged the same way.
    Weighting micro-batch i (n_i tokens, mean loss l_i) by w_i = n_i * m * dp / N turns that average into
    sum_i n_i * l_i / N exactly, for the gradient and the logged loss alike, with any schedule. N needs
    one all-reduce of a number over the data-parallel group (context-parallel ranks of a group see the
    same micro-batches, counted whole). Returns the micro-batches, each with w_i (a 0-dim device tensor)
    under stages.LOSS_WEIGHT, which forward_step applies."""
    # the counts stay tensors: read on the host, the all-reduced total would wait for the device
    counts = torch.stack([b["loss_mask"].sum() for b in batches]).to(device, torch.float64, non_blocking=True)
    total = counts.sum().reshape(1)
    dp = parallel.dp_size
    if dp > 1:
        with waiting():
            torch.distributed.all_reduce(total, group=parallel.group("dp"))
    weights = counts * (len(batches) * dp / total.clamp(min=1.0))
    return [{**b, LOSS_WEIGHT: w} for b, w in zip(batches, weights.float().unbind())]


def train_step(trainer: Run, data_iterator) -> tuple[torch.Tensor, object]:
    """One global batch: forward/backward over its micro-batches, gradient sync, optimizer step. Returns
    the step's loss averaged over data-parallel ranks (a 0-dim float64 tensor on the device; 0 on
    pipeline stages without the loss) and the optimizer's StepResult.

    Host-device synchronisations of a step on a GPU (the rest is queued asynchronously): the global
    gradient norm, which the host needs to decide clipping and to refuse a NaN/Inf update on every rank
    alike (as Megatron does), and with fp16 the overflow flag before it. The losses stay on the device
    (the loop reads them when it logs); --calculate-per-token-loss counts tokens on the device. Timers
    synchronise only at --timing-log-level >= their level."""
    t = trainer.config.training
    # the global batch of this step (it grows under --rampup-batch-size / --step-batch-size-schedule);
    # the data-parallel wrapper counts that many backward passes before a bucket's gradients are final
    batch_size = trainer.config.global_batch_size_at(trainer.state.consumed_train_samples)
    losses = forward_backward(trainer, data_iterator)
    if t.empty_unused_memory_level >= 1:
        release_cached_memory(trainer.device)
    timeout = t.distributed_timeout_minutes
    with collective_phase("the gradient finishing (data-parallel reduction, tensor/pipeline-parallel fix-ups)",
                          timeout), memory_label("gradient reduction"), waiting():
        finalize_model_grads(trainer.chunks, trainer.parallel, trainer.ddp, trainer.timers)
    with collective_phase("the optimizer step (norm all-reduce, parameter all-gather)", timeout):
        trainer.timers.start("optimizer", level=1)
        def update():
            with memory_label("optimizer step"):
                return trainer.optimizer.step(trainer.scheduler.lr, trainer.scheduler.decoupled_lr)
        result = update() if trainer.async_pipeline is None else \
            trainer.async_pipeline.optimizer_step(trainer.state.iteration, update)   # on the newest weight version
        trainer.timers.stop("optimizer")
        if result.update_successful:
            advance_lr_schedule(trainer, batch_size)
        if t.empty_unused_memory_level >= 2:
            release_cached_memory(trainer.device)
        trainer.state.last_local_loss = mean_loss(losses, trainer.device)
        with waiting():
            loss = trainer.ddp.average_over_dp(trainer.state.last_local_loss)
        return loss, result


def forward_backward(trainer: Run, data_iterator) -> torch.Tensor | None:
    """Zero the gradients, then forward and backward over this step's micro-batches with the run's
    schedule; returns the micro-batch losses (none on pipeline stages without the loss)."""
    model, optimizer = trainer.model, trainer.optimizer
    model.train()
    num_microbatches = trainer.config.num_microbatches_at(trainer.state.consumed_train_samples)
    trainer.ddp.zero_grad(num_microbatches)       # the optimizer reads the gradients of its buffer
    if model.moe is not None:
        model.moe.start_step(optimizer.loss_scale, num_microbatches)
    for chunk in trainer.chunks:
        chunk.train()
    timeout = trainer.config.training.distributed_timeout_minutes
    trainer.timers.start("forward-backward", level=1)
    with collective_phase("forward-backward (tensor/context-parallel collectives, pipeline send/receive)", timeout):
        if trainer.async_pipeline is not None:     # reads ahead: its forwards run into the next batch
            losses = trainer.async_pipeline.forward_backward(
                trainer.state.iteration, lambda: next_batches(trainer, data_iterator, num_microbatches),
                optimizer.loss_scale)
        else:
            losses = run_schedule(trainer, next_batches(trainer, data_iterator, num_microbatches),
                                  optimizer.loss_scale)
    trainer.timers.stop("forward-backward")
    return losses


def forward_only_losses(trainer: Run, data_iterator) -> torch.Tensor | None:
    """The micro-batch losses of one global batch, forward only (evaluation)."""
    return run_schedule(trainer, next_batches(trainer, data_iterator, trainer.config.num_microbatches), 1.0,
                        forward_only=True)


def run_schedule(trainer: Run, batches: list[dict], loss_scale: float, forward_only: bool = False) -> torch.Tensor | None:
    """``batches`` through the run's synchronous schedule (schedules.py): gradient accumulation without
    a pipeline, else this rank's stages, whose receive waits go to the timers."""
    if trainer.pipeline is None:
        return forward_backward_no_pipelining(trainer.model, batches, trainer.device, loss_scale, forward_only)
    record = PipelineRecord(trainer.pipeline.rank)
    losses = forward_backward_pipelined(trainer.chunks, batches, trainer.device, trainer.pipeline,
                                        trainer.config.parallel.pipeline_schedule, loss_scale, forward_only, record)
    trainer.timers.add("pipeline-receive-wait", record.wait_seconds, level=2)
    return losses


def advance_lr_schedule(trainer: Run, batch_size: int) -> None:
    """Megatron steps its schedule by the samples of each update (its lengths are iterations x the global
    batch size): a ramp-up step of a smaller batch advances megalite's schedule, counted in full-batch
    iterations, by batch_size / global batch size."""
    full = trainer.config.training.global_batch_size
    if batch_size == full:
        trainer.scheduler.step()
    else:
        trainer.scheduler.num_steps += batch_size / full


def release_cached_memory(device: torch.device) -> None:
    """--empty-unused-memory-level: hand CUDA's caching allocator's unused blocks back. On CPUs the
    process's malloc decides when freed pages go back to the OS, so there is nothing to release."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def mean_loss(losses: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Mean micro-batch loss as a 0-dim float64 tensor on ``device``; 0 on pipeline stages that hold no
    loss (only the last stage does)."""
    if losses is None:
        return torch.zeros((), dtype=torch.float64, device=device)
    return losses.to(torch.float64).mean()


def loss_pipeline_rank(trainer: Run) -> int:
    """The pipeline rank holding the last virtual stage, the chunk that computes the loss (its
    post_process; build_model_chunks places chunks with the same stage_placement): the last rank, but
    rank 0 under zbv's V placement."""
    stages = StageMap(trainer.parallel.pp_size, trainer.parallel.pp_rank, len(trainer.chunks),
                      stage_placement(trainer.config.parallel.pipeline_schedule))
    return stages.where[stages.num_stages - 1][0]


def reported_loss(trainer: Run, value: float | torch.Tensor) -> float:
    """``value`` (a loss, or a sum of losses; a number or a 0-dim tensor) as the pipeline rank that
    computes the loss has it, on every rank, so that the logging rank reports it whichever rank that is.
    A broadcast over the pipeline group: every rank calls it at the same points (log iterations,
    evaluations, a NaN step), not every step. Reads the value on the host."""
    comm = trainer.pipeline
    if comm is None:
        return float(value)
    loss = torch.as_tensor(value, dtype=torch.float64, device=trainer.device).reshape(1).clone()
    with collective_phase("logging (loss broadcast)", trainer.config.training.distributed_timeout_minutes):
        torch.distributed.broadcast(loss, src=comm.global_rank(loss_pipeline_rank(trainer)), group=comm.group)
    return float(loss)
