"""The pretraining loop: build everything from a MegaliteConfig, train, evaluate, log.

pretrain(config)
  -> initialise (ParallelState, device, seed) -> tokenizer -> model + buffer + optimizer + LR schedule
  -> datasets and samplers -> for each iteration: forward/backward over the micro-batches, optimizer
     step, LR step, log every --log-interval, evaluate every --eval-interval.
"""
from __future__ import annotations

import atexit
import dataclasses
import gc
import math
import os
import signal
import sys
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader

from megalite.checkpoint.files import CheckpointReader, check_writable
from megalite.checkpoint.sharded import (full_shape, has_checkpoint, load_checkpoint, param_entries, restore_rng,
                                   save_checkpoint)
from megalite.train.compile import compile_layers
from megalite.config.schema import MegaliteConfig
from megalite.parallel.context.ring_attention import (build_context_parallel, context_parallel_loss,
                                                      slice_for_context_parallel)
from megalite.train.faults import (Activity, ExitConditions, TrainingFault, collective_phase, nonfinite_message,
                             ranks_with_nonfinite_loss)
from megalite.data.builder import build_train_valid_test_datasets
from megalite.data.samplers import MegatronPretrainingSampler
from megalite.data.tokenizers import build_tokenizer
from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.data.grad_buffer import ParamAndGradBuffer
from megalite.parallel.initialize import initialize_distributed, set_matmul_precision, set_seed
from megalite.train.logging import (MetricsSinks, Timers, flops_per_iteration, format_timers, format_training_line,
                              format_validation_lines)
from megalite.model.gpt import DTYPES, GPTModel
from megalite.train.memory_report import report_memory
from megalite.optim.clip_grads import global_grad_norm
from megalite.optim.distrib_optimizer import build_optimizer
from megalite.optim.lr_scheduler import LRScheduler
from megalite.optim.mixed_precision import MixedPrecisionAdamW
from megalite.train.performance import Throughput, memory_usage, peak_flops_per_device
from megalite.parallel.mesh import ParallelState
from megalite.parallel.pipeline.executor import PipelineRecord, run_pipeline_schedule
from megalite.parallel.pipeline.p2p import PipelineComm
from megalite.parallel.pipeline.pipedream import AsyncPipeline, build_async_pipeline
from megalite.parallel.pipeline.plan import rank_plan
from megalite.parallel.pipeline.schedules import StageMap, forward_backward_no_pipelining, stage_placement
from megalite.parallel.pipeline.stages import (SplitFlags, build_model_chunks, check_pipeline_split, chunk_forward,
                                               sync_shared_embedding_grads, virtual_stage_layers)
from megalite.parallel.pipeline.zero_bubble import check_zero_bubble, schedule_split
from megalite.parallel.tensor.setup import build_tensor_parallel, finalize_tensor_parallel_grads


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    exit_reason: str | None = None                   # why training stopped before --train-iters, if it did
    last_local_loss: float = 0.0                     # this rank's own loss of the last step (NaN diagnosis)
    history: list = field(default_factory=list)      # per-iteration lm loss as this rank has it (0.0 on
                                                     # pipeline ranks without the loss), for callers and tests


@dataclass
class Trainer:
    """Everything built for one run, passed around explicitly."""
    config: MegaliteConfig
    parallel: ParallelState
    device: torch.device
    model: GPTModel
    buffer: ParamAndGradBuffer
    optimizer: MixedPrecisionAdamW
    scheduler: LRScheduler
    timers: Timers
    state: TrainState = field(default_factory=TrainState)
    ddp: DistributedDataParallel | None = None       # data-parallel gradient sync / ZeRO sharding
    chunks: list = field(default_factory=list)      # this rank's model chunks (pipeline stages)
    pipeline: PipelineComm | None = None             # stage-to-stage exchange when pp > 1
    async_pipeline: AsyncPipeline | None = None      # --pipeline-schedule pipedream / pipedream-2bw
    last_saved_iteration: int | None = None          # iteration of the checkpoint last saved or loaded
    checkpoint_source: dict | None = None            # metadata["source"] of the loaded checkpoint, kept on save


def build_trainer(config: MegaliteConfig, print_fn=None) -> Trainer:
    parallel, device = initialize_distributed(config.parallel, config.training.distributed_timeout_minutes)
    set_matmul_precision(config.training.tf32, device)
    seed = set_seed(config.training.seed, parallel.pp_rank)     # dropout's: each pipeline stage its own
    tp = build_tensor_parallel(parallel, config.parallel.sequence_parallel, seed, device,
                               config.model.num_query_groups)
    cp = build_context_parallel(parallel)
    check_zero_bubble(config.parallel, config.model, parallel.dp_size)
    split = schedule_split(SplitFlags.of(config.parallel), config.parallel.pipeline_schedule)   # zbv: two chunks
    num_chunks = check_pipeline_split(config.model.num_layers, parallel.pp_size,
                                      config.parallel.num_layers_per_virtual_pipeline_stage, config.num_microbatches,
                                      split)
    # sharded start-up: the chunks are built without storage; the data-parallel buffer materialises only
    # this rank's elements (its TP shard, or its ZeRO-3 chunk of it) directly on the device
    chunks = build_model_chunks(config.model, config.training.seed, tp, parallel.pp_rank, parallel.pp_size,
                                num_chunks, cp, meta=True,
                                stage_layers=virtual_stage_layers(config.model.num_layers, parallel.pp_size, split),
                                placement=stage_placement(config.parallel.pipeline_schedule))
    model = chunks[0]
    data_parallel = DistributedDataParallel
    if config.parallel.use_torch_fsdp2:
        # imported here: torch.distributed.fsdp and DTensor cost every other rank's start-up 0.2-1 s
        from megalite.parallel.data.fsdp2 import FullyShardedDataParallel as data_parallel
    ddp = data_parallel(chunks if len(chunks) > 1 or parallel.pp_size > 1 else model, config.parallel,
                        parallel, config.num_microbatches, device=device)
    for chunk in chunks if not config.parallel.use_torch_fsdp2 else []:   # FSDP2 placed its own (fsdp2.py)
        chunk.to(device)                      # the remaining buffers (rotary tables); parameters are there
    # after the data-parallel wrapper: its hooks stay on the modules, only each layer's forward is compiled
    compile_layers(chunks, config, device, (print_fn or print_line) if parallel.is_logging_rank else (lambda *_: None))
    optimizer = build_optimizer(ddp, config.optimizer, parallel)   # global norm over TP/PP (and DP shards)
    scheduler = LRScheduler(config.optimizer, config.training.train_iters)
    comm = None
    if parallel.pp_size > 1:
        seq = config.model.seq_length // cp.size // (tp.size if tp.sequence_parallel else 1)
        comm = PipelineComm(parallel.group("pp"), parallel.pp_rank, parallel.pp_size,
                            (seq, config.training.micro_batch_size, config.model.hidden_size),
                            DTYPES[config.model.params_dtype], device)
    async_pipeline = build_async_pipeline(config, parallel, ddp, comm, chunk_forward(chunks, device))
    return Trainer(config, parallel, device, model, ddp.buffer, optimizer, scheduler,
                   Timers(config.training.timing_log_level, device), ddp=ddp, chunks=chunks, pipeline=comm,
                   async_pipeline=async_pipeline)


# ---- data ----------------------------------------------------------------------------------------
def ignore_stop_signals(_worker_id: int) -> None:
    """Data-loader workers ignore SIGTERM/SIGINT. torchrun and SLURM signal every process of a rank,
    and a worker dying first would kill the rank before --exit-signal-handler could save; the rank
    shuts its workers down itself."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def shut_down_workers_at_exit(iterator):
    """Stop the iterator's workers when the interpreter exits with it still alive (an uncaught
    exception's traceback holds it, or a script keeps it in a global).

    Without this the exit hangs for good: multiprocessing's own exit hook SIGTERMs the workers, which
    ignore SIGTERM (ignore_stop_signals), and then joins them. torch registers such a hook itself only
    for pinned-memory loaders. atexit runs hooks last-registered first, so this one runs before
    multiprocessing's and before torch marks the interpreter as exiting (after which the shut-down is a
    no-op). The weak reference lets an iterator that goes away earlier shut down as usual."""
    if not hasattr(iterator, "_shutdown_workers"):        # no workers (--num-workers 0)
        return iterator
    ref = weakref.ref(iterator)

    def shut_down():
        alive = ref()
        if alive is not None:
            alive._shutdown_workers()      # what the iterator's __del__ calls; there is no public name

    atexit.register(shut_down)
    return iterator


def build_data_iterators(trainer: Trainer, tokenizer):
    cfg, t = trainer.config, trainer.config.training
    evaluations = t.train_iters // t.eval_interval + 1 if t.eval_iters > 0 else 0
    num_samples = (t.train_iters * t.global_batch_size,
                   evaluations * t.eval_iters * t.global_batch_size,
                   t.eval_iters * t.global_batch_size)
    train, valid, test = build_train_valid_test_datasets(cfg.data, tokenizer, num_samples, t.seed)

    def iterator(dataset, consumed: int):
        if dataset is None:
            return None
        sampler = MegatronPretrainingSampler(len(dataset), consumed, t.micro_batch_size,
                                             trainer.parallel.dp_rank, trainer.parallel.dp_size)
        loader = DataLoader(dataset, batch_sampler=sampler, num_workers=cfg.data.num_workers,
                            pin_memory=trainer.device.type == "cuda",
                            persistent_workers=cfg.data.num_workers > 0, worker_init_fn=ignore_stop_signals)
        return shut_down_workers_at_exit(iter(loader))

    return (iterator(train, trainer.state.consumed_train_samples),
            iterator(valid, trainer.state.consumed_valid_samples), iterator(test, 0))


def make_loss_fn(model: torch.nn.Module, device: torch.device, weights: dict | None = None):
    """Per micro-batch: mean of the per-token losses where loss_mask is 1 (over whole sequences: with
    context parallelism each rank computes its chunks and the sums are combined over the CP group),
    times the micro-batch's weight in ``weights`` (by id of the batch; see per_token_loss_weights)."""
    cp = getattr(model, "cp", None)

    def loss_fn(batch: dict):
        weight = weights[id(batch)] if weights is not None else None
        if cp is not None and cp.size > 1:
            batch = slice_for_context_parallel(batch, cp.rank, cp.size)
        tokens = batch["tokens"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        loss_mask = batch["loss_mask"].to(device, non_blocking=True).float()
        per_token = model(tokens, batch["position_ids"].to(device, non_blocking=True), labels=labels)
        loss, num_tokens = context_parallel_loss(per_token, loss_mask, cp)
        return (loss if weight is None else loss * weight), num_tokens
    return loss_fn


def next_batches(trainer: Trainer, data_iterator, num_microbatches: int) -> tuple[list, dict | None]:
    """One step's micro-batches, and with --calculate-per-token-loss their loss weights."""
    batches = [next(data_iterator) for _ in range(num_microbatches)]   # pipeline stages stay in step
    return batches, per_token_loss_weights(trainer, batches)


def per_token_loss_weights(trainer: Trainer, batches: list) -> dict | None:
    """--calculate-per-token-loss (Megatron): the step's loss is the sum of every token's loss over all
    micro-batches and data-parallel ranks divided by their total count N, not a mean of micro-batch means.

    Everything downstream averages micro-batch means: the schedules backpropagate loss / m over m
    micro-batches, the data-parallel reduction divides by dp, the logged loss is averaged the same way.
    Weighting micro-batch i (n_i tokens, mean loss l_i) by w_i = n_i * m * dp / N turns that average into
    sum_i n_i * l_i / N exactly, for the gradient and the logged loss alike, with any schedule. N needs
    one all-reduce of a number over the data-parallel group (context-parallel ranks of a group see the
    same micro-batches, counted whole). Returns {id(batch): w_i}, or None without the flag."""
    if not trainer.config.training.calculate_per_token_loss:
        return None
    counts = torch.tensor([float(b["loss_mask"].sum()) for b in batches], dtype=torch.float64)
    total = counts.sum().reshape(1)
    dp = trainer.parallel.dp_size
    if dp > 1:
        total = total.to(trainer.device)
        torch.distributed.all_reduce(total, group=trainer.parallel.group("dp"))
    scale = len(batches) * dp / max(float(total), 1.0)
    return {id(b): float(n) * scale for b, n in zip(batches, counts)}


# ---- one step ------------------------------------------------------------------------------------
def train_step(trainer: Trainer, data_iterator) -> tuple[float, object]:
    """One global batch: forward/backward over its micro-batches, gradient sync, optimizer step.

    Host-device synchronisations of a step on a GPU (the rest is queued asynchronously): the loss read
    back after the last backward (the schedules return floats; with a process group, again after its
    data-parallel average), and the global gradient norm, which the host needs to decide clipping and
    to refuse a NaN/Inf update on every rank alike (as Megatron does); fp16 adds the overflow flag. The
    NaN/Inf checks use those values and read nothing more. Timers synchronise
    only at --timing-log-level >= their level; --calculate-per-token-loss and --exit-signal-handler /
    --exit-duration-in-mins each read back one all-reduced value per step."""
    model, optimizer = trainer.model, trainer.optimizer
    t = trainer.config.training
    model.train()
    # the global batch of this step (it grows under --rampup-batch-size / --step-batch-size-schedule);
    # the data-parallel wrapper counts that many backward passes before a bucket's gradients are final
    batch_size = trainer.config.global_batch_size_at(trainer.state.consumed_train_samples)
    num_microbatches = trainer.config.num_microbatches_at(trainer.state.consumed_train_samples)
    trainer.ddp.num_microbatches = num_microbatches
    optimizer.zero_grad()
    for chunk in trainer.chunks:
        chunk.train()
    timeout = t.distributed_timeout_minutes
    trainer.timers.start("forward-backward", level=1)
    with collective_phase("forward-backward (tensor/context-parallel collectives, pipeline send/receive)", timeout):
        if trainer.async_pipeline is not None:     # reads ahead: its forwards run into the next batch
            losses = trainer.async_pipeline.forward_backward(
                trainer.state.iteration, lambda: next_batches(trainer, data_iterator, num_microbatches),
                optimizer.loss_scale)
        elif trainer.pipeline is None:
            batches, weights = next_batches(trainer, data_iterator, num_microbatches)
            losses = forward_backward_no_pipelining(make_loss_fn(model, trainer.device, weights), iter(batches),
                                                    num_microbatches, optimizer.loss_scale)
        else:
            batches, weights = next_batches(trainer, data_iterator, num_microbatches)
            losses = forward_backward_pipelined(trainer, batches, optimizer.loss_scale, weights=weights)
    trainer.timers.stop("forward-backward")
    if t.empty_unused_memory_level >= 1:
        release_cached_memory(trainer.device)
    trainer.timers.start("all-grads-sync", level=1)
    with collective_phase("the data-parallel gradient reduction", timeout):
        trainer.ddp.finish_grad_sync()                 # DP: sum over data-parallel ranks / dp size
    trainer.timers.stop("all-grads-sync")
    with collective_phase("the optimizer step (gradient fix-ups, norm all-reduce, parameter all-gather)", timeout):
        # after the DP sync: with --overlap-grad-reduce, DP reductions are in flight until finish_grad_sync
        finalize_tensor_parallel_grads(trainer.buffer.params, trainer.model.tp, trainer.ddp)
        sync_shared_embedding_grads(trainer.chunks, trainer.parallel, trainer.ddp)
        trainer.timers.start("optimizer", level=1)
        if trainer.async_pipeline is not None:
            trainer.async_pipeline.before_update()     # the newest weight version is the one updated
        result = optimizer.step(trainer.scheduler.lr, trainer.scheduler.decoupled_lr)
        if trainer.async_pipeline is not None:
            trainer.async_pipeline.after_update(trainer.state.iteration)
        trainer.timers.stop("optimizer")
        if result.update_successful:
            advance_lr_schedule(trainer, batch_size)
        if t.empty_unused_memory_level >= 2:
            release_cached_memory(trainer.device)
        trainer.state.last_local_loss = mean_loss(losses)
        return trainer.ddp.average_over_dp(trainer.state.last_local_loss), result


def advance_lr_schedule(trainer: Trainer, batch_size: int) -> None:
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


def mean_loss(losses: list[float]) -> float:
    """Mean micro-batch loss; 0.0 on pipeline stages that hold no loss (only the last stage does)."""
    return sum(losses) / len(losses) if losses else 0.0


def loss_pipeline_rank(trainer: Trainer) -> int:
    """The pipeline rank holding the last virtual stage, the chunk that computes the loss (its
    post_process; build_model_chunks places chunks with the same stage_placement): the last rank, but
    rank 0 under zbv's V placement."""
    stages = StageMap(trainer.parallel.pp_size, trainer.parallel.pp_rank, len(trainer.chunks),
                      stage_placement(trainer.config.parallel.pipeline_schedule))
    return stages.where[stages.num_stages - 1][0]


def reported_loss(trainer: Trainer, value: float) -> float:
    """``value`` (a loss, or a sum of losses) as the pipeline rank that computes the loss has it, on every
    rank, so that the logging rank reports it whichever rank that is. A broadcast over the pipeline group:
    every rank calls it at the same points (log iterations, evaluations, a NaN step), not every step."""
    comm = trainer.pipeline
    if comm is None:
        return value
    loss = torch.tensor([value], dtype=torch.float64, device=trainer.device)
    with collective_phase("logging (loss broadcast)", trainer.config.training.distributed_timeout_minutes):
        torch.distributed.broadcast(loss, src=comm.global_rank(loss_pipeline_rank(trainer)), group=comm.group)
    return float(loss)


def forward_backward_pipelined(trainer: Trainer, batches: list, loss_scale: float, forward_only: bool = False,
                               record: PipelineRecord | None = None, weights: dict | None = None) -> list[float]:
    """One global batch (``batches``, its micro-batches) through this rank's stages with a synchronous
    schedule (1F1B, interleaved 1F1B, GPipe, ZB-H1, ZB-V); ``weights`` scale each micro-batch's loss (see
    per_token_loss_weights)."""
    cfg, comm = trainer.config, trainer.pipeline
    chunks = len(trainer.chunks)
    plan = rank_plan(cfg.parallel.pipeline_schedule, comm.size, comm.rank, len(batches), chunks, forward_only)
    record = record or PipelineRecord(comm.rank)
    forward = chunk_forward(trainer.chunks, trainer.device)
    if weights is not None:
        unweighted = forward

        def forward(chunk, x, batch, is_last_stage):
            out = unweighted(chunk, x, batch, is_last_stage)
            return out * weights[id(batch)] if is_last_stage else out
    losses = run_pipeline_schedule(plan, forward, batches, comm, loss_scale, forward_only, record)
    trainer.timers.add("pipeline-receive-wait", record.wait_seconds, level=2)
    return losses


def evaluate(trainer: Trainer, data_iterator, num_batches: int) -> float:
    t = trainer.config.training
    collect = t.manual_gc and t.manual_gc_eval       # --manual-gc: collect around evaluation (Megatron)
    if collect:
        gc.collect()
    with collective_phase("evaluation", t.distributed_timeout_minutes):
        loss = _evaluate(trainer, data_iterator, num_batches)
    if collect:
        gc.collect()
    return loss


def _evaluate(trainer: Trainer, data_iterator, num_batches: int) -> float:
    """The mean loss over ``num_batches`` full global batches (per token with --calculate-per-token-loss)."""
    for chunk in trainer.chunks:
        chunk.eval()
    losses = []
    m = trainer.config.num_microbatches
    for _ in range(num_batches):
        batches, weights = next_batches(trainer, data_iterator, m)
        if trainer.pipeline is None:
            losses += forward_backward_no_pipelining(make_loss_fn(trainer.model, trainer.device, weights),
                                                     iter(batches), m, forward_only=True)
        else:
            losses += forward_backward_pipelined(trainer, batches, 1.0, forward_only=True, weights=weights)
        if trainer.config.training.empty_unused_memory_level >= 1:
            release_cached_memory(trainer.device)
    for chunk in trainer.chunks:
        chunk.train()
    loss = trainer.ddp.average_over_dp(mean_loss(losses)) if trainer.ddp else mean_loss(losses)
    return reported_loss(trainer, loss)


# ---- the loop ------------------------------------------------------------------------------------
def print_line(text: str) -> None:
    """One write per line, flushed: ranks share torchrun's stdout, and print()'s separate write of the
    newline lets another rank's line land in the middle."""
    sys.stdout.write(f"{text}\n")
    sys.stdout.flush()


def pretrain(config: MegaliteConfig, print_fn=print_line) -> TrainState:
    if config.training.save:
        check_writable(config.training.save)
    trainer = build_trainer(config, print_fn)
    log = print_fn if trainer.parallel.is_logging_rank else (lambda *_: None)
    tokenizer = build_tokenizer(config.data)
    rng = load_at_start(trainer, log)
    train_iter, valid_iter, test_iter = build_data_iterators(trainer, tokenizer)
    if rng is not None:      # after the data loaders, which draw from the generator when created
        restore_rng(rng, trainer.model.tp.rng)
    sinks = MetricsSinks(config.training, dataclasses.asdict(config)) if trainer.parallel.is_logging_rank else None
    report_parameters(trainer, log)
    report_memory(trainer.ddp, trainer.optimizer, trainer.parallel.rank, print_fn)
    try:
        train(trainer, train_iter, valid_iter, log, sinks)
        trainer.ddp.wait_for_param_gather()
        t = config.training
        if trainer.state.exit_reason:
            return trainer.state                 # saved already; the end-of-training evaluation is skipped
        if t.save and trainer.state.iteration > 0 and trainer.state.iteration != trainer.last_saved_iteration:
            save(trainer, log)
        if valid_iter is not None and t.eval_iters > 0:
            loss = evaluate(trainer, valid_iter, t.eval_iters)
            log(format_validation_lines("at the end of training for val data", {"lm loss": loss}))
        if test_iter is not None and t.eval_iters > 0:
            loss = evaluate(trainer, test_iter, t.eval_iters)
            log(format_validation_lines("at the end of training for test data", {"lm loss": loss}))
        trainer.ddp.close()                  # no collective left in flight when the process groups go
    finally:
        if sinks is not None:
            sinks.close()
            if sinks.metrics_path:
                log(f"metrics written to {sinks.metrics_path}")
    return trainer.state


def load_at_start(trainer: Trainer, log):
    """--load: weights, optimizer and position of a previous run (RNG states returned for later).
    A --load directory without a checkpoint yet is a fresh start when it is also the --save directory
    (the usual "--save X --load X" job script re-run after a crash); anywhere else it is a mistake."""
    t = trainer.config.training
    if not t.load:
        return None
    if not has_checkpoint(t.load) and t.save and os.path.abspath(t.load) == os.path.abspath(t.save):
        log(f" > no checkpoint in {t.load} yet: starting from scratch")
        return None
    with collective_phase("loading a checkpoint", t.distributed_timeout_minutes):
        rng = load_checkpoint(trainer, t.load, load_optimizer=not t.no_load_optim, load_rng=not t.no_load_rng,
                              finetune=t.finetune, log=log)
    trainer.last_saved_iteration = trainer.state.iteration
    if t.batch_size_schedule and not t.finetune:
        restore_lr_position(trainer)
    return rng


def restore_lr_position(trainer: Trainer) -> None:
    """Under a batch-size schedule the LR position is fractional (advance_lr_schedule); the scheduler's
    own loader keeps whole steps, so take the exact value from the checkpoint, or without its optimizer
    state (--no-load-optim) from the samples consumed."""
    t = trainer.config.training
    if t.no_load_optim:
        trainer.scheduler.num_steps = trainer.state.consumed_train_samples / t.global_batch_size
        return
    saved = CheckpointReader(t.load).metadata.get("scheduler") or {}
    if "num_steps" in saved:
        trainer.scheduler.num_steps = float(saved["num_steps"])


def save(trainer: Trainer, log) -> None:
    start = time.perf_counter()
    with collective_phase("saving a checkpoint", trainer.config.training.distributed_timeout_minutes):
        path = save_checkpoint(trainer, trainer.config.training.save)
    trainer.last_saved_iteration = trainer.state.iteration
    log(f" > saved checkpoint at iteration {trainer.state.iteration} to {path} ({time.perf_counter() - start:.2f} s)")


def report_parameters(trainer: Trainer, log) -> None:
    n = count_model_parameters(trainer)
    log(f" > number of parameters: {n} ({n / 1e6:.2f}M); global batch {trainer.config.training.global_batch_size}"
        f" = {trainer.config.num_microbatches} micro-batches of {trainer.config.training.micro_batch_size}"
        f" x data-parallel {trainer.parallel.dp_size}")


def count_model_parameters(trainer: Trainer) -> int:
    """The whole model's parameters (full, unsharded shapes; vocabulary padded), whatever the layout:
    each pipeline stage counts its own chunks once (one TP/CP/DP replica), the tied output copy not
    again, and the stages' counts are summed. Collective: every rank calls it."""
    p = trainer.parallel
    counts_here = p.tp_rank == 0 and p.cp_rank == 0 and p.dp_rank == 0
    local = sum(math.prod(full_shape(e.param)) for e in param_entries(trainer.chunks) if e.stored_here) if counts_here else 0
    if p.world_size == 1:
        return local
    total = torch.tensor([local], dtype=torch.int64, device=trainer.device)
    torch.distributed.all_reduce(total)
    return int(total.item())


def train(trainer: Trainer, train_iter, valid_iter, log, sinks) -> None:
    cfg, t, state = trainer.config, trainer.config.training, trainer.state
    interval = IntervalStats()
    peak, peak_source = peak_flops_per_device(t.peak_flops, trainer.device)
    log(f" > MFU against {peak / 1e12:g} TFLOP/s per device from {peak_source}" if peak
        else f" > MFU not reported: {peak_source}")
    megatron_flops = flops_per_iteration(cfg.model, t.global_batch_size) if t.log_throughput else None
    throughput = Throughput(cfg.model, t.global_batch_size, trainer.parallel.world_size, peak, megatron_flops)
    interval_start = time.perf_counter()
    exits = ExitConditions(t.exit_signal_handler, t.exit_duration_in_mins, t.exit_interval, trainer.device)
    profiler = StepProfiler(t, trainer.parallel.rank, trainer.device)
    if t.manual_gc:      # Python collects only where we say: the same iterations on every rank (Megatron)
        gc.disable()
        gc.collect()
    try:
        while state.iteration < t.train_iters:
            batch_size = cfg.global_batch_size_at(state.consumed_train_samples)
            profiler.before_step(state.iteration)
            Activity.iteration, Activity.phase = state.iteration + 1, "the training step"
            loss, result = train_step(trainer, train_iter)
            state.iteration += 1
            state.consumed_train_samples += batch_size
            profiler.after_step(state.iteration)
            if t.manual_gc and t.manual_gc_interval and state.iteration % t.manual_gc_interval == 0:
                gc.collect()
            interval.add(loss, result, batch_size)
            state.history.append(loss)
            if result.nonfinite or not math.isfinite(loss):
                state.nan_iterations += 1
                handle_nonfinite_step(trainer, loss, result, log)
            elif not result.update_successful:
                state.skipped_iterations += 1      # fp16 overflow: the loss scaler backs off
            interval_start = after_iteration(trainer, interval, interval_start, throughput, valid_iter,
                                             log, sinks)
            state.exit_reason = exits.check(state.iteration)
            if state.exit_reason:
                if t.save and trainer.last_saved_iteration != state.iteration:
                    save(trainer, log)
                log(f" > exiting at iteration {state.iteration}: {state.exit_reason}")
                return
    finally:
        exits.close()
        profiler.close()
        if t.manual_gc:
            gc.enable()


class StepProfiler:
    """--profile: profile the iterations whose counter at their start is in [--profile-step-start,
    --profile-step-end) (Megatron's counting), on the ranks in --profile-ranks. On GPUs an nsys capture
    range (cudaProfilerStart/Stop) unless --use-pytorch-profiler; otherwise, and always on CPUs,
    torch.profiler, written as a Chrome trace into --tensorboard-dir (else --save, else ./profile)."""

    def __init__(self, t, rank: int, device: torch.device):
        self.t, self.rank = t, rank
        self.active = t.profile and rank in t.profile_ranks
        self.nsys = device.type == "cuda" and not t.use_pytorch_profiler
        self.nsys_running = False
        self.profiler = None

    def before_step(self, iteration: int) -> None:
        if not self.active or iteration != self.t.profile_step_start:
            return
        if self.nsys:
            torch.cuda.profiler.start()
            self.nsys_running = True
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self.profiler.start()

    def after_step(self, iteration: int) -> None:
        if self.active and iteration == self.t.profile_step_end:
            self.close()

    def close(self) -> None:
        """Stop what is running (also when training ends early) and write the trace."""
        if self.nsys_running:
            torch.cuda.profiler.stop()
            self.nsys_running = False
        if self.profiler is None:
            return
        self.profiler.stop()
        folder = self.t.tensorboard_dir or self.t.save or "profile"
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"profile_rank{self.rank}_iterations{self.t.profile_step_start + 1}-"
                                    f"{self.t.profile_step_end}.json")
        self.profiler.export_chrome_trace(path)
        self.profiler = None
        print(f" > profile of rank {self.rank} written to {path}", flush=True)


def handle_nonfinite_step(trainer: Trainer, loss: float, result, log) -> None:
    """A NaN/Inf loss or gradient norm (bf16/fp32): the optimizer refused the update on every rank.
    Stop, with the ranks whose own loss went bad, unless --skip-nan-iterations."""
    t, state = trainer.config.training, trainer.state
    bad_ranks = ranks_with_nonfinite_loss(state.last_local_loss, trainer.device)
    loss = reported_loss(trainer, loss)
    last = (os.path.join(t.save, f"iter_{trainer.last_saved_iteration:07d}")
            if t.save and trainer.last_saved_iteration else None)
    message = nonfinite_message(state.iteration, loss, result.grad_norm, bad_ranks, last, t.skip_nan_iterations)
    if not t.skip_nan_iterations:
        raise TrainingFault(message)
    log(f" > {message}")


def after_iteration(trainer: Trainer, interval, interval_start: float, throughput: Throughput, valid_iter, log,
                    sinks) -> float:
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
        save(trainer, log)
        interval_start = time.perf_counter()
    return interval_start


@dataclass
class IntervalStats:
    """Megatron logs the mean lm loss over the iterations since the last log line."""
    iterations: int = 0
    loss_sum: float = 0.0
    last_grad_norm: float | None = None
    samples: int = 0                     # over the interval (the batch may grow: --rampup-batch-size)
    last_batch_size: int = 0

    def add(self, loss: float, result, batch_size: int = 0) -> None:
        self.iterations += 1
        self.loss_sum += loss
        self.samples += batch_size
        self.last_batch_size = batch_size
        if result.grad_norm is not None:
            self.last_grad_norm = result.grad_norm

    def reset(self) -> None:
        self.iterations, self.loss_sum, self.last_grad_norm, self.samples = 0, 0.0, None, 0


def log_iteration(trainer: Trainer, interval: IntervalStats, seconds_per_iter: float, throughput: Throughput,
                  log) -> dict:
    t, state = trainer.config.training, trainer.state
    loss = reported_loss(trainer, interval.loss_sum) / interval.iterations
    # Throughput assumes full global batches; a ramp-up interval's smaller ones take proportionally
    # fewer tokens and FLOPs, i.e. count as a proportionally longer time per full batch
    full_batches = interval.samples / t.global_batch_size if interval.samples else interval.iterations
    rates = throughput.rates(seconds_per_iter * interval.iterations / full_batches)
    memory = memory_over_ranks(trainer)
    norms = optional_norms(trainer)            # collectives: every rank computes them
    batch_size = interval.last_batch_size or t.global_batch_size
    log(format_training_line(
        iteration=state.iteration, train_iters=t.train_iters, consumed_samples=state.consumed_train_samples,
        elapsed_ms=1000.0 * seconds_per_iter, learning_rate=trainer.scheduler.lr,
        global_batch_size=batch_size, losses={"lm loss": loss}, loss_scale=trainer.optimizer.loss_scale,
        grad_norm=interval.last_grad_norm, skipped_iterations=state.skipped_iterations,
        nan_iterations=state.nan_iterations, tflops_per_gpu=rates.get("throughput (TFLOP/s/GPU)"),
        num_zeros=norms.get("num zeros"), params_norm=norms.get("params norm"),
        extra=line_extras(rates, memory)))
    timing = trainer.timers.report(interval.iterations)
    if timing:
        log(format_timers(timing))
    metrics = {"lm loss": loss, "learning rate": trainer.scheduler.lr, "grad norm": interval.last_grad_norm,
               "loss scale": trainer.optimizer.loss_scale, "consumed samples": state.consumed_train_samples,
               "global batch size": batch_size, "elapsed time per iteration (ms)": 1000.0 * seconds_per_iter,
               "skipped iterations": state.skipped_iterations, "nan iterations": state.nan_iterations, **norms,
               **rates, **{f"memory {key} (MB)": mb for key, mb in memory.items()},
               **{f"time {name} (ms)": ms for name, ms in timing.items()}}
    if t.log_timers_to_tensorboard:
        metrics["iteration-time"] = seconds_per_iter        # Megatron's tensorboard key, in seconds
    return metrics


def optional_norms(trainer: Trainer) -> dict[str, float]:
    """--log-params-norm: L2 norm of the fp32 master weights; --log-num-zeros-in-grad: zero elements of the
    last step's (unscaled, clipped) gradients. Both count each parameter of the whole model once, with the
    global gradient norm's rules (clip_grads.py: TP-replicated parameters on TP rank 0, the tied
    embedding's second copy not at all, ZeRO shards on their owner), summed over the same ranks."""
    t, opt = trainer.config.training, trainer.optimizer
    out = {}
    groups = opt._reduction_groups()
    if t.log_num_zeros_in_grad:
        zeros = sum(float((p.grad[lo:hi] == 0).sum()) * w
                    for p, segments in zip(opt.pieces, opt.norm_segments) for lo, hi, w in segments)
        total = torch.tensor([zeros], dtype=torch.float64, device=trainer.device)
        for group in groups:
            torch.distributed.all_reduce(total, group=group)
        out["num zeros"] = float(total)
    if t.log_params_norm:
        out["params norm"] = global_grad_norm(opt.master_pieces, opt.norm_segments, groups)
    return out


def line_extras(rates: dict[str, float], memory: dict[str, float]) -> dict[str, str]:
    """megalite's fields after Megatron's: tokens/s, MFU when the peak is known, the largest rank's memory."""
    extras = {"tokens per second": f"{rates['tokens per second']:.1f}"}
    if "MFU" in rates:
        extras["MFU"] = f"{100 * rates['MFU']:.1f}%"
    peak_key = "max allocated" if "max allocated" in memory else "max rss"
    extras[f"{peak_key} (MB)"] = f"{memory[peak_key]:.1f}"
    return extras


def memory_over_ranks(trainer: Trainer) -> dict[str, float]:
    """Each memory figure's maximum over all ranks (the device that runs out first), in MB.
    Every rank calls it at the same log iterations: one all-reduce of a few numbers."""
    memory = memory_usage(trainer.device)
    if trainer.parallel.world_size == 1:
        return memory
    values = torch.tensor(list(memory.values()), dtype=torch.float64, device=trainer.device)
    with collective_phase("logging (memory all-reduce)", trainer.config.training.distributed_timeout_minutes):
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    return dict(zip(memory, values.tolist()))
