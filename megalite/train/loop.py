"""The train loop: iterations until --train-iters or an exit condition, with the interval's log line,
evaluation and periodic checkpoints after each iteration.

Every function here takes the run (run.py's ``Run``: the Trainer); the loop saves through ``trainer.save()``.
"""
from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field

import torch

from megalite.optim.clip_grads import norm_over_classes
from megalite.train.faults import (EXIT_AGREEMENT_INTERVAL, Activity, ExitConditions, TrainingFault,
                                   collective_phase, nonfinite_message, ranks_with_nonfinite_loss)
from megalite.train.fp8_stats import Fp8Observer
from megalite.train.memory_account import MemoryAccount, format_breakdown
from megalite.train.metrics import (MetricsSinks, MoEStats, MTPLosses, format_timers, format_training_line,
                                    format_validation_lines, worst_load)
from megalite.train.performance import Throughput, flops_per_iteration, memory_usage, peak_flops_per_device
from megalite.train.profiler import StepProfiler
from megalite.train.run import Run
from megalite.train.step import forward_only_losses, mean_loss, release_cached_memory, reported_loss, train_step
from megalite.train.straggler import StragglerDetector


def train(trainer: Run, train_iter, valid_iter, log, sinks: MetricsSinks | None) -> None:
    """Train from ``trainer.state.iteration`` to --train-iters, or until an exit condition (then save)."""
    cfg, t, state = trainer.config, trainer.config.training, trainer.state
    moe = MoEStats(trainer.chunks, cfg.model, trainer.parallel, trainer.device) if cfg.model.num_experts else None
    stragglers = StragglerDetector(t, trainer.parallel, trainer.device, log, trainer.print_fn)
    mtp = (MTPLosses(trainer.chunks, cfg.model.mtp_num_layers, trainer.parallel.world_size, trainer.device)
           if cfg.model.mtp_num_layers else None)
    fp8 = Fp8Observer(trainer.chunks, cfg.model, trainer.parallel, trainer.device) if cfg.model.fp8_format else None
    interval = IntervalStats(moe=moe, mtp=mtp, stragglers=stragglers, fp8=fp8)
    throughput = start_throughput(trainer, log)
    interval_start = time.perf_counter()
    exits = ExitConditions(t.exit_signal_handler, t.exit_duration_in_mins, t.exit_interval, trainer.device,
                           agree_every=min(t.log_interval, EXIT_AGREEMENT_INTERVAL))
    profiler = StepProfiler(t, trainer.parallel.rank, trainer.device)
    if t.manual_gc:      # Python collects only where we say: the same iterations on every rank (Megatron)
        gc.disable()
        gc.collect()
    first = state.iteration
    try:
        while state.iteration < t.train_iters:
            batch_size = cfg.global_batch_size_at(state.consumed_train_samples)
            profiler.before_step(state.iteration)
            Activity.iteration, Activity.phase = state.iteration + 1, "the training step"
            run = trainer.parallel.run
            accounted = state.iteration == first and run.accounts_first_step(t.log_memory_breakdown)
            with interval.stragglers.step():
                loss, result = accounted_step(trainer, train_iter) if accounted else train_step(trainer, train_iter)
            state.iteration += 1
            state.consumed_train_samples += batch_size
            profiler.after_step(state.iteration)
            if t.manual_gc and t.manual_gc_interval and state.iteration % t.manual_gc_interval == 0:
                gc.collect()
            interval.add(loss, result, batch_size)
            if run.heeds(result.nonfinite):
                state.nan_iterations += 1
                handle_nonfinite_step(trainer, loss, result, log, interval.fp8)
            elif not result.update_successful:
                state.skipped_iterations += 1      # fp16 overflow: the loss scaler backs off
            interval_start = after_iteration(trainer, interval, interval_start, throughput, valid_iter,
                                             log, sinks)
            trainer.poll_saves()
            state.exit_reason = exits.check(state.iteration)
            if state.exit_reason:
                interval.read_losses(state)
                if t.save and trainer.last_saved_iteration != state.iteration:
                    trainer.save()
                log(f" > exiting at iteration {state.iteration}: {state.exit_reason}")
                return
        interval.read_losses(state)
    finally:
        exits.close()
        profiler.close()
        interval.stragglers.close()
        if t.manual_gc:
            gc.enable()


def accounted_step(trainer: Run, train_iter):
    """train_step with every byte of it accounted (memory_account.py); each rank prints its breakdown."""
    with MemoryAccount(trainer.chunks, trainer.ddp.buffer, trainer.optimizer) as account:
        out = train_step(trainer, train_iter)
    for line in format_breakdown(trainer.parallel.rank, account.breakdown):
        trainer.print_fn(line)
    return out


def start_throughput(trainer: Run, log) -> Throughput:
    """The run's rate calculator; says once against which peak MFU is reported, or why it is not."""
    cfg, t = trainer.config, trainer.config.training
    peak, peak_source = peak_flops_per_device(t.peak_flops, trainer.device)
    log(f" > MFU against {peak / 1e12:g} TFLOP/s per device from {peak_source}" if peak
        else f" > MFU not reported: {peak_source}")
    megatron_flops = flops_per_iteration(cfg.model, t.global_batch_size) if t.log_throughput else None
    return Throughput(cfg.model, t.global_batch_size, trainer.parallel.world_size, peak, megatron_flops)


def handle_nonfinite_step(trainer: Run, loss: torch.Tensor, result, log, fp8: Fp8Observer | None = None) -> None:
    """A NaN/Inf gradient norm (bf16/fp32; a NaN/Inf loss makes one): the optimizer refused the update on
    every rank.
    Stop, with the ranks whose own loss went bad (and with FP8 the first layer whose FP8 operand went
    NaN/Inf), unless --skip-nan-iterations."""
    t, state = trainer.config.training, trainer.state
    bad_ranks = ranks_with_nonfinite_loss(state.last_local_loss, trainer.device)
    loss = reported_loss(trainer, loss)
    last = (os.path.join(t.save, f"iter_{trainer.last_saved_iteration:07d}")
            if t.save and trainer.last_saved_iteration else None)
    message = nonfinite_message(state.iteration, loss, result.grad_norm, bad_ranks, last, t.skip_nan_iterations)
    if fp8 is not None and fp8.first_nonfinite() is not None:
        message = f"{fp8.nonfinite_message()}: {message}"
    if not t.skip_nan_iterations:
        raise TrainingFault(message)
    log(f" > {message}")


def after_iteration(trainer: Run, interval, interval_start: float, throughput: Throughput, valid_iter, log,
                    sinks: MetricsSinks | None) -> float:
    """Logging, evaluation and periodic checkpoints after an iteration; returns the new interval start."""
    t, state = trainer.config.training, trainer.state
    if state.iteration % t.log_interval == 0:
        elapsed = (time.perf_counter() - interval_start) / interval.iterations
        metrics = log_iteration(trainer, interval, elapsed, throughput, log)
        if sinks is not None:
            sinks.log(state.iteration, metrics)
        interval.reset()
        interval_start = time.perf_counter()

    if valid_iter is not None and t.eval_iters > 0 and state.iteration % t.eval_interval == 0:
        loss = evaluate(trainer, valid_iter, t.eval_iters)
        state.consumed_valid_samples += t.eval_iters * t.global_batch_size
        log(format_validation_lines(f"at iteration {state.iteration}", {"lm loss": loss}))
        if sinks is not None:
            sinks.log(state.iteration, {"validation lm loss": loss})
        interval_start = time.perf_counter()

    if t.save and t.save_interval and state.iteration % t.save_interval == 0:
        trainer.save()
        interval_start = time.perf_counter()
    elif (t.non_persistent_save_interval and state.iteration % t.non_persistent_save_interval == 0
          and state.iteration < t.train_iters):                 # the end of the run saves persistently
        trainer.save(non_persistent=True)
        interval_start = time.perf_counter()
    return interval_start


# ---- evaluation ----------------------------------------------------------------------------------
def evaluate(trainer: Run, data_iterator, num_batches: int) -> float:
    """The mean loss over ``num_batches`` full global batches (per token with --calculate-per-token-loss),
    as the pipeline rank that computes the loss has it, on every rank."""
    t = trainer.config.training
    collect = t.manual_gc and t.manual_gc_eval       # --manual-gc: collect around evaluation (Megatron)
    if collect:
        gc.collect()
    with collective_phase("evaluation", t.distributed_timeout_minutes):
        loss = _evaluate(trainer, data_iterator, num_batches)
    if collect:
        gc.collect()
    return loss


def _evaluate(trainer: Run, data_iterator, num_batches: int) -> float:
    for chunk in trainer.chunks:
        chunk.eval()
    losses = []
    for _ in range(num_batches):
        batch_losses = forward_only_losses(trainer, data_iterator)
        if batch_losses is not None:
            losses.append(batch_losses)
        if trainer.config.training.empty_unused_memory_level >= 1:
            release_cached_memory(trainer.device)
    for chunk in trainer.chunks:
        chunk.train()
    losses = torch.cat(losses) if losses else None
    loss = mean_loss(losses, trainer.device)
    return reported_loss(trainer, trainer.ddp.average_over_dp(loss) if trainer.ddp else loss)


# ---- the interval's log line ---------------------------------------------------------------------
@dataclass
class IntervalStats:
    """Megatron logs the mean lm loss over the iterations since the last log line; ``moe`` reports the MoE
    layers' auxiliary losses over the same iterations (their routers sum them on the device), ``mtp`` the
    multi-token prediction depths' losses (summed on the device alike); ``stragglers``
    each rank's compute and waiting over them (--log-straggler).

    The iterations' losses stay on the device (``losses``) until ``read_losses`` reads them, once per
    log line and at the end: reading one on the host would wait for the device every step."""
    iterations: int = 0
    losses: list = field(default_factory=list)      # this interval's per-iteration losses, on the device
    last_grad_norm: float | None = None
    samples: int = 0                     # over the interval (the batch may grow: --rampup-batch-size)
    last_batch_size: int = 0
    moe: MoEStats | None = None
    mtp: MTPLosses | None = None
    stragglers: StragglerDetector | None = None
    fp8: Fp8Observer | None = None

    def add(self, loss: torch.Tensor, result, batch_size: int = 0) -> None:
        self.iterations += 1
        self.losses.append(loss.detach().reshape(()))
        self.samples += batch_size
        self.last_batch_size = batch_size
        if result.grad_norm is not None:
            self.last_grad_norm = result.grad_norm

    def read_losses(self, state) -> float:
        """The sum of the losses not read yet (one host read), appended to ``state.history``."""
        values = torch.stack(self.losses).tolist() if self.losses else []
        self.losses = []
        state.history.extend(values)
        return sum(values)

    def reset(self) -> None:
        self.iterations, self.losses, self.last_grad_norm, self.samples = 0, [], None, 0


def log_iteration(trainer: Run, interval: IntervalStats, seconds_per_iter: float, throughput: Throughput,
                  log) -> dict:
    """The interval's training line (and timer block) through ``log``; returns the metrics for the sinks."""
    t, state = trainer.config.training, trainer.state
    loss = reported_loss(trainer, interval.read_losses(state)) / interval.iterations
    # Throughput assumes full global batches; a ramp-up interval's smaller ones take proportionally
    # fewer tokens and FLOPs, i.e. count as a proportionally longer time per full batch
    full_batches = interval.samples / t.global_batch_size if interval.samples else interval.iterations
    rates = throughput.rates(seconds_per_iter * interval.iterations / full_batches)
    memory = memory_over_ranks(trainer)
    norms = optional_norms(trainer)            # collectives: every rank computes them
    moe_losses, moe_loads = interval.moe.report() if interval.moe is not None else ({}, {})
    batch_size = interval.last_batch_size or t.global_batch_size
    mtp_losses = interval.mtp.report() if interval.mtp is not None else {}
    losses = {"lm loss": loss, **moe_losses, **mtp_losses}
    clip = trainer.optimizer.qk_clip            # --qk-clip / --log-max-attention-logit: a collective
    logits = clip.report(trainer.device, trainer.parallel.world_size) if clip is not None else {}
    fp8 = interval.fp8.report() if interval.fp8 is not None else {}      # a collective; stops on NaN/Inf
    log(format_training_line(
        iteration=state.iteration, train_iters=t.train_iters, consumed_samples=state.consumed_train_samples,
        elapsed_ms=1000.0 * seconds_per_iter, learning_rate=trainer.scheduler.lr,
        global_batch_size=batch_size, losses=losses, loss_scale=trainer.optimizer.loss_scale,
        grad_norm=interval.last_grad_norm, skipped_iterations=state.skipped_iterations,
        nan_iterations=state.nan_iterations, tflops_per_gpu=rates.get("throughput (TFLOP/s/GPU)"),
        num_zeros=norms.get("num zeros"), params_norm=norms.get("params norm"),
        extra=line_extras(rates, memory) | worst_load(moe_loads) | {k: f"{v:.3f}" for k, v in logits.items()}
        | {k: f"{v:.4g}" for k, v in fp8.items()}))
    timing = trainer.timers.report(interval.iterations)
    if timing:
        log(format_timers(timing))
    stragglers = interval.stragglers.report() if interval.stragglers is not None else {}   # on every rank
    metrics = {**losses, **moe_loads, **logits, **fp8, "learning rate": trainer.scheduler.lr, "grad norm": interval.last_grad_norm,
               "loss scale": trainer.optimizer.loss_scale, "consumed samples": state.consumed_train_samples,
               "global batch size": batch_size, "elapsed time per iteration (ms)": 1000.0 * seconds_per_iter,
               "skipped iterations": state.skipped_iterations, "nan iterations": state.nan_iterations, **norms,
               **rates, **{f"memory {key} (MB)": mb for key, mb in memory.items()},
               **{f"time {name} (ms)": ms for name, ms in timing.items()}, **stragglers}
    if t.log_timers_to_tensorboard:
        metrics["iteration-time"] = seconds_per_iter        # Megatron's tensorboard key, in seconds
    return metrics


def optional_norms(trainer: Run) -> dict[str, float]:
    """--log-params-norm: L2 norm of the fp32 master weights; --log-num-zeros-in-grad: zero elements of the
    last step's (unscaled, clipped) gradients. Both count each parameter of the whole model once, with the
    global gradient norm's rules (clip_grads.py: TP-replicated parameters on TP rank 0, the tied
    embedding's second copy not at all, ZeRO shards on their owner, MoE expert weights as a class of their
    own over the expert grid), each class summed over its own ranks."""
    t, opt = trainer.config.training, trainer.optimizer
    out = {}
    classes = opt.norm_classes()
    if t.log_num_zeros_in_grad:
        total = 0.0
        for segments_per_piece, groups in classes:
            zeros = sum(float((p.grad[lo:hi] == 0).sum()) * w
                        for p, segments in zip(opt.pieces, segments_per_piece) for lo, hi, w in segments)
            count = torch.tensor([zeros], dtype=torch.float64, device=trainer.device)
            for group in groups:
                torch.distributed.all_reduce(count, group=group)
            total += float(count)
        out["num zeros"] = total
    if t.log_params_norm:
        out["params norm"] = norm_over_classes(opt.master_pieces, classes)
    return out


def line_extras(rates: dict[str, float], memory: dict[str, float]) -> dict[str, str]:
    """megalite's fields after Megatron's: tokens/s, MFU when the peak is known, the largest rank's memory."""
    extras = {"tokens per second": f"{rates['tokens per second']:.1f}"}
    if "MFU" in rates:
        extras["MFU"] = f"{100 * rates['MFU']:.1f}%"
    peak_key = "max allocated" if "max allocated" in memory else "max rss"
    extras[f"{peak_key} (MB)"] = f"{memory[peak_key]:.1f}"
    return extras


def memory_over_ranks(trainer: Run) -> dict[str, float]:
    """Each memory figure's maximum over all ranks (the device that runs out first), in MB.
    Every rank calls it at the same log iterations: one all-reduce of a few numbers."""
    memory = memory_usage(trainer.device)
    if trainer.parallel.world_size == 1:
        return memory
    values = torch.tensor(list(memory.values()), dtype=torch.float64, device=trainer.device)
    with collective_phase("logging (memory all-reduce)", trainer.config.training.distributed_timeout_minutes):
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    return dict(zip(memory, values.tolist()))
