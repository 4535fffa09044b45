"""The Trainer: one training run built from a MegaliteConfig, owning its lifecycle.

    with Trainer(config) as trainer:   start the processes (ParallelState, device, seed), build the model
                                       chunks, the data-parallel wrapper, optimizer, LR schedule and
                                       pipeline exchange
        trainer.train()                --load, the data loaders, the loop (loop.py: steps from step.py,
                                       logging, evaluation, periodic checkpoints), the final checkpoint and
                                       evaluations
    .evaluate() .save() .load() .close()
                                       leaving the block (any way but a broken process group): background
                                       saves waited for, ddp closed, the process group it started destroyed

build_trainer(config, print_fn) and pretrain(config, print_fn) are the two entry points tests and
tools use: the built Trainer (whose caller tears down what it needs), and a whole run in a ``with``
block returning its TrainState.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import math
import os
import signal
import sys
import time
import weakref

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from megalite.checkpoint import locations
from megalite.checkpoint.background import BackgroundSaves
from megalite.checkpoint.files import CheckpointReader, check_writable
from megalite.checkpoint.save import save_checkpoint
from megalite.checkpoint.sharded import full_shape, load_checkpoint, param_entries, restore_rng
from megalite.checkpoint.state import CheckpointState
from megalite.config import validate as rules
from megalite.config.schema import MegaliteConfig
from megalite.data.builder import build_train_valid_test_datasets
from megalite.data.samplers import MegatronPretrainingSampler
from megalite.data.tokenizers import build_tokenizer
from megalite.model.gpt import DTYPES
from megalite.observe.clocks import Timers
from megalite.optim.distrib_optimizer import build_optimizer
from megalite.optim.qk_clip import build_qk_clip
from megalite.optim.lr_scheduler import LRScheduler
from megalite.optim.muon_cost import owner_cost
from megalite.parallel.context.ring_attention import build_context_parallel
from megalite.parallel.data.build import build_data_parallel
from megalite.parallel.initialize import initialize_distributed, set_matmul_precision, set_seed
from megalite.parallel.pipeline.p2p import PipelineComm
from megalite.parallel.pipeline.pipedream import build_async_pipeline
from megalite.parallel.pipeline.orders import stage_placement
from megalite.model.chunks import build_model_chunks
from megalite.parallel.pipeline.stages import chunk_forward
from megalite.config.pipeline_split import stage_layers_of
from megalite.parallel.expert.dispatch import build_moe_context
from megalite.parallel.tensor.setup import build_tensor_parallel
from megalite.precision.fp8 import gemm_recipe_for
from megalite.train import loop
from megalite.train.compile import compile_layers
from megalite.train.faults import CollectiveFailure, collective_phase
from megalite.train.metrics import MetricsSinks, format_validation_lines
from megalite.train.performance import report_memory
from megalite.train.run import TrainState


def print_line(text: str) -> None:
    """One write per line, flushed: ranks share torchrun's stdout, and print()'s separate write of the
    newline lets another rank's line land in the middle."""
    sys.stdout.write(f"{text}\n")
    sys.stdout.flush()


def quiet(*_) -> None:
    """The log of ranks other than the logging rank."""


class Trainer:
    """Everything built for one run: the step and the loop read it as a ``Run`` (run.py lists what they
    read), checkpoints read and restore ``checkpoint_state`` (checkpoint/state.py); also ``buffer`` (the
    flat parameter buffer) and ``background_saves`` (--async-save).

    A context manager: leaving its block tears the run down (``shut_down``). ``print_fn`` prints a line;
    ``log`` is print_fn on the logging rank and silent elsewhere."""

    def __init__(self, config: MegaliteConfig, print_fn=print_line):
        if config.training.save:
            check_writable(config.training.save)       # before any start-up time is spent
        self.config = config
        self.print_fn = print_fn
        started_here = not dist.is_initialized()
        self.parallel, self.device = initialize_distributed(config.parallel,
                                                            config.training.distributed_timeout_minutes,
                                                            experts=bool(config.model.num_experts))
        self.owns_process_group = started_here and dist.is_initialized()
        self.ddp, self.closed = None, False
        self.background_saves: BackgroundSaves | None = None
        try:
            self._build()
        except CollectiveFailure:
            raise                                      # the group is broken: the caller exits without teardown
        except BaseException:
            self.shut_down(clean=False)
            raise

    def _build(self) -> None:
        """Everything after the process group: model, optimizer, schedule, pipeline, checkpoint state."""
        config = self.config
        self.log = self.print_fn if self.parallel.is_logging_rank else quiet
        set_matmul_precision(config.training.tf32, self.device)
        self.state = TrainState()
        self.last_saved_iteration: int | None = None
        self._build_model()
        # the global gradient norm is taken over TP/PP (and DP shards)
        self.optimizer = build_optimizer(self.ddp, config.optimizer, self.parallel, config.model)
        self.optimizer.qk_clip = build_qk_clip(self.chunks, self.buffer, self.ddp.named_params, config.model,
                                               self.parallel)
        self.scheduler = LRScheduler(config.optimizer, config.training.train_iters)
        self.pipeline = self._build_pipeline_comm()
        self.async_pipeline = build_async_pipeline(config, self.parallel, self.ddp, self.pipeline,
                                                   chunk_forward(self.chunks, self.device))
        self.timers = Timers(config.training.timing_log_level, self.device)
        self.background_saves = BackgroundSaves(self.log) if config.training.async_save else None
        self.checkpoint_state = CheckpointState(config, self.parallel, self.device, self.chunks, self.ddp,
                                                self.optimizer, self.scheduler, self.state, self.model.tp.rng,
                                                self.async_pipeline)

    # ---- the lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is not None and issubclass(kind, CollectiveFailure):
            return                       # the process group is broken: tearing it down would hang or abort
        self.shut_down(clean=kind is None)

    def shut_down(self, clean: bool = True) -> None:
        """Tear the run down: wait for a background save, close the data-parallel backend (no collective
        left in flight), and destroy the process group if this Trainer started it. ``clean``: every rank
        got here (a normal end), so they first meet in a barrier; after an error a rank does not wait
        for the others, and a background save's error does not hide the one being raised."""
        try:
            if clean:
                self.poll_saves(wait=True)
                self.close()
            else:                        # the error being raised is the one to report, not the teardown's
                if self.background_saves is not None:
                    with contextlib.suppress(Exception):
                        self.background_saves.wait()
                with contextlib.suppress(Exception):
                    self.close()
        finally:
            if self.owns_process_group and dist.is_initialized():
                if clean:
                    dist.barrier()
                dist.destroy_process_group()
            self.owns_process_group = False

    def _build_model(self) -> None:
        """This rank's model chunks inside the data-parallel wrapper (``chunks``, ``model``, ``ddp``,
        ``buffer``), compiled with --compile."""
        config, parallel, device = self.config, self.parallel, self.device
        seed = set_seed(config.training.seed, parallel.pp_rank)     # dropout's: each pipeline stage its own
        tp = build_tensor_parallel(parallel, config.parallel.sequence_parallel, seed, device,
                                   config.model.num_query_groups)
        tp.gemm_recipe = gemm_recipe_for(config.model, device, DTYPES[config.model.params_dtype],
                                         parallel.run.kernel_device(device))
        cp = build_context_parallel(parallel, tuple(config.parallel.cp_comm_type),
                                    config.parallel.hierarchical_context_parallel_sizes)
        moe = build_moe_context(parallel, config.model.moe_token_dispatcher_type, tp.sequence_parallel) \
            if config.model.num_experts else None
        num_chunks = rules.check_layout(config)
        # sharded start-up: the chunks are built without storage; building the data-parallel backend
        # materialises only this rank's elements (its TP shard, or its ZeRO-3 chunk of it) on the device
        chunks = build_model_chunks(config.model, config.training.seed, tp, parallel.pp_rank, parallel.pp_size,
                                    num_chunks, cp, meta=True,
                                    stage_layers=stage_layers_of(config.model.num_layers, config.parallel),
                                    placement=stage_placement(config.parallel.pipeline_schedule), moe=moe)
        model = chunks[0]
        ddp = build_data_parallel(chunks, config.parallel, parallel, config.num_microbatches, device,
                                  owner_cost(config.model, config.optimizer))
        # after the data-parallel wrapper: its hooks stay on the modules, only each layer's forward is compiled
        compile_layers(chunks, config, device, self.print_fn if parallel.is_logging_rank else quiet)
        self.chunks, self.model, self.ddp, self.buffer = chunks, model, ddp, ddp.buffer

    def _build_pipeline_comm(self) -> PipelineComm | None:
        """The stage-to-stage exchange of activations when pp > 1 (None otherwise)."""
        config, parallel = self.config, self.parallel
        if parallel.pp_size == 1:
            return None
        tp, cp = self.model.tp, self.model.cp
        seq = config.model.seq_length // cp.size // (tp.size if tp.sequence_parallel else 1)
        return PipelineComm(parallel.group("pp"), parallel.pp_rank, parallel.pp_size,
                            (seq, config.training.micro_batch_size, config.model.hidden_size),
                            DTYPES[config.model.params_dtype], self.device, run=parallel.run)

    # ---- the run ---------------------------------------------------------------------------------
    def train(self) -> TrainState:
        """The whole run: --load, the data loaders, the loop, then the final checkpoint and evaluations."""
        config = self.config
        tokenizer = build_tokenizer(config.data)
        rng = self.load()
        train_iter, valid_iter, test_iter = build_data_iterators(self, tokenizer)
        if rng is not None:      # after the data loaders, which draw from the generator when created
            restore_rng(rng, self.model.tp.rng)
        sinks = (MetricsSinks(config.training, dataclasses.asdict(config), self.log) if self.parallel.is_logging_rank
                 else None)
        report_parameters(self)
        report_memory(self.ddp, self.optimizer, self.parallel.rank, self.print_fn, self.parallel.run)
        try:
            with self.parallel.run.value_reads():
                loop.train(self, train_iter, valid_iter, self.log, sinks)
            self.ddp.wait_for_param_gather()
            if not self.state.exit_reason:       # on an early exit: saved already, no final evaluation
                self._finish(valid_iter, test_iter)
            self.poll_saves(wait=True)
            self.close()
        finally:
            if sinks is not None:
                sinks.close()
                if sinks.metrics_path:
                    self.log(f"metrics written to {sinks.metrics_path}")
        return self.state

    def _finish(self, valid_iter, test_iter) -> None:
        """After --train-iters: the last checkpoint and the end-of-training evaluations."""
        t = self.config.training
        if t.save and self.state.iteration > 0 and self.state.iteration != self.last_saved_iteration:
            self.save()
        if valid_iter is not None and t.eval_iters > 0:
            loss = self.evaluate(valid_iter, t.eval_iters)
            self.log(format_validation_lines("at the end of training for val data", {"lm loss": loss}))
        if test_iter is not None and t.eval_iters > 0:
            loss = self.evaluate(test_iter, t.eval_iters)
            self.log(format_validation_lines("at the end of training for test data", {"lm loss": loss}))

    def evaluate(self, data_iterator, num_batches: int) -> float:
        """The mean loss over ``num_batches`` global batches, on every rank (loop.evaluate)."""
        return loop.evaluate(self, data_iterator, num_batches)

    def close(self) -> None:
        """No collective left in flight when the process groups go (once; nothing before ddp is built)."""
        if self.ddp is not None and not self.closed:
            self.ddp.close()
            self.closed = True

    # ---- checkpoints -----------------------------------------------------------------------------
    def save(self, non_persistent: bool = False) -> None:
        """Save to --save, or the non-persistent directory (every rank: a collective); with --async-save,
        start saving in the background."""
        start, t = time.perf_counter(), self.config.training
        destination = locations.non_persistent(t) if non_persistent else locations.persistent(t)
        with collective_phase("saving a checkpoint", t.distributed_timeout_minutes):
            if self.background_saves is not None:
                self.background_saves.save(self.checkpoint_state, destination)    # says when taken and published
            else:
                path = save_checkpoint(self.checkpoint_state, destination)
                self.log(f" > saved checkpoint at iteration {self.state.iteration} to {path} "
                         f"({time.perf_counter() - start:.2f} s)")
        if not non_persistent:
            self.last_saved_iteration = self.state.iteration

    def poll_saves(self, wait: bool = False) -> None:
        """Report a background save that has finished (no collective), or with ``wait`` block until none is
        in flight (every way the run ends); raise the error of one that failed."""
        if self.background_saves is None:
            return
        with collective_phase("saving a checkpoint in the background", self.config.training.distributed_timeout_minutes):
            self.background_saves.wait() if wait else self.background_saves.poll()

    def load(self):
        """--load: weights, optimizer and position of a previous run (the newest complete checkpoint,
        persistent or not: locations.py); returns the RNG states, restored later. A --load directory
        without a checkpoint yet is a fresh start when it is also the --save directory (the usual "--save X
        --load X" job script re-run after a crash); anywhere else it is a mistake."""
        t = self.config.training
        if not t.load:
            return None
        with collective_phase("loading a checkpoint", t.distributed_timeout_minutes):
            path = locations.resume_directory(t, self.device, self.log)
            if path is None and t.save and os.path.abspath(t.load) == os.path.abspath(t.save):
                self.log(f" > no checkpoint in {t.load} yet: starting from scratch")
                return None
            path = path or t.load              # load_checkpoint says what is wrong with it
            rng = load_checkpoint(self.checkpoint_state, path, load_optimizer=not t.no_load_optim,
                                  load_rng=not t.no_load_rng, finetune=t.finetune, log=self.log)
        if not locations.is_non_persistent(t, path):       # else the final save must still be made
            self.last_saved_iteration = self.state.iteration
        if t.batch_size_schedule and not t.finetune:
            self._restore_lr_position(path)
        return rng

    def _restore_lr_position(self, path: str) -> None:
        """Under a batch-size schedule the LR position is fractional (step.advance_lr_schedule); the
        scheduler's own loader keeps whole steps, so take the exact value from the checkpoint, or without
        its optimizer state (--no-load-optim) from the samples consumed."""
        t = self.config.training
        if t.no_load_optim:
            self.scheduler.num_steps = self.state.consumed_train_samples / t.global_batch_size
            return
        saved = CheckpointReader(path).metadata.get("scheduler") or {}
        if "num_steps" in saved:
            self.scheduler.num_steps = float(saved["num_steps"])


def build_trainer(config: MegaliteConfig, print_fn=None) -> Trainer:
    """The built Trainer, not yet trained (tests and tools drive train_step themselves)."""
    return Trainer(config, print_fn or print_line)


def pretrain(config: MegaliteConfig, print_fn=print_line) -> TrainState:
    """A whole run: Trainer(config).train() in its ``with`` block."""
    with Trainer(config, print_fn) as trainer:
        return trainer.train()


def report_parameters(trainer: Trainer) -> None:
    """The parameter count's start-up line: the whole model's, or this rank's part where the run backend
    has no peers to count the rest."""
    batch = (f"global batch {trainer.config.training.global_batch_size} = {trainer.config.num_microbatches} "
             f"micro-batches of {trainer.config.training.micro_batch_size} x data-parallel {trainer.parallel.dp_size}")
    trainer.log(trainer.parallel.run.parameter_line(lambda: trainer.ddp.buffer.numel_unpadded,
                                                    lambda: count_model_parameters(trainer), batch))


def count_model_parameters(trainer: Trainer) -> int:
    """The whole model's parameters (full, unsharded shapes; vocabulary padded), whatever the layout:
    each pipeline stage counts its own chunks once (one TP/CP/DP replica), the tied output copy not
    again, and the stages' counts are summed. Collective: every rank calls it."""
    p = trainer.parallel
    counts_here = p.tp_rank == 0 and p.cp_rank == 0 and p.dp_rank == 0
    local = (sum(math.prod(full_shape(e.param)) for e in param_entries(trainer.chunks) if e.stored_here)
             if counts_here else 0)
    if p.world_size == 1:
        return local
    total = torch.tensor([local], dtype=torch.int64, device=trainer.device)
    torch.distributed.all_reduce(total)
    return int(total.item())


# ---- data ----------------------------------------------------------------------------------------
# How loader workers start: spawned, each a fresh interpreter that holds none of the rank's memory.
# Workers forked from the rank would share its pages copy-on-write, and every page the rank writes
# afterwards (each optimizer step writes all of its parameters and state) is copied while the workers keep
# the old one: the workers end up holding a stale copy of the rank's whole state. Not from a fork server:
# its workers are its children, and torch's workers exit when their parent goes, so a SIGTERM to every
# process of a job step (Slurm's time limit) would kill the fork server and the rank's data with it.
WORKER_START = "spawn"


def build_data_iterators(trainer: Trainer, tokenizer):
    """(train, valid, test) iterators over this data-parallel rank's micro-batches, from the samples
    already consumed; None where the split is empty."""
    cfg, t = trainer.config, trainer.config.training
    evaluations = t.train_iters // t.eval_interval + 1 if t.eval_iters > 0 else 0
    num_samples = (t.train_iters * t.global_batch_size,
                   evaluations * t.eval_iters * t.global_batch_size,
                   t.eval_iters * t.global_batch_size)
    train, valid, test = build_train_valid_test_datasets(cfg.data, tokenizer, num_samples, t.seed,
                                                         trainer.parallel.run)
    workers = cfg.data.num_workers

    def iterator(dataset, consumed: int):
        if dataset is None:
            return None
        sampler = MegatronPretrainingSampler(len(dataset), consumed, t.micro_batch_size,
                                             trainer.parallel.dp_rank, trainer.parallel.dp_size)
        loader = DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                            multiprocessing_context=WORKER_START if workers > 0 else None,
                            pin_memory=trainer.device.type == "cuda",
                            persistent_workers=workers > 0, worker_init_fn=ignore_stop_signals)
        return shut_down_workers_at_exit(iter(loader)) if workers > 0 else iter(loader)

    return (iterator(train, trainer.state.consumed_train_samples),
            iterator(valid, trainer.state.consumed_valid_samples), iterator(test, 0))


def ignore_stop_signals(_worker_id: int) -> None:
    """Data-loader workers ignore SIGTERM/SIGINT. torchrun and SLURM signal every process of a rank,
    and a worker dying first would kill the rank before --exit-signal-handler could save; the rank
    shuts its workers down itself."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def shut_down_workers_at_exit(iterator):
    """Stop the workers of a multi-process loader's iterator when the interpreter exits with it still
    alive (an uncaught exception's traceback holds it, or a script keeps it in a global).

    Without this the exit hangs for good: multiprocessing's own exit hook SIGTERMs the workers, which
    ignore SIGTERM (ignore_stop_signals), and then joins them. torch registers such a hook itself only
    for pinned-memory loaders. atexit runs hooks last-registered first, so this one runs before
    multiprocessing's and before torch marks the interpreter as exiting (after which the shut-down is a
    no-op). The weak reference lets an iterator that goes away earlier shut down as usual."""
    ref = weakref.ref(iterator)

    def shut_down():
        alive = ref()
        if alive is not None:
            alive._shutdown_workers()      # what the iterator's __del__ calls; there is no public name

    atexit.register(shut_down)
    return iterator
