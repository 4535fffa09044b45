"""Asynchronous pipeline schedules with weight stashing: PipeDream and PipeDream-2BW.

Both run 1F1B without flushes: a stage never waits for the pipeline to drain between global batches.
On pipeline stage s of p (0 = first), w = p - 1 - s warm-up forwards lead the backwards, and the
stage's action stream over the whole run is F(0..w-1), then pairs (F(j + w), B(j)) for every
micro-batch j, the forwards stopping at the run's last micro-batch. Micro-batches are numbered over
the run: j = t*m + i is micro-batch i of global batch t (m micro-batches per global batch). Step t is
the pairs of j = t*m .. t*m + m - 1; the forwards it contains therefore run up to w micro-batches of
batch t + 1, which stay "in flight" (activations kept) into step t + 1. Gradients are accumulated
over the m backwards of batch t, then every stage updates at the same point of its stream, right
after B(t*m + m - 1) (the update's collectives, clipping's global norm and the tied embedding's sum,
run there), so a step's update is the accumulated gradient of one global batch, as in synchronous
training, only computed on older weights.

Each step runs on the one executor with the other schedules' p2p and posting order: its actions are
orders.async_step_order's, numbered from the step's first micro-batch; the one message that would
cross the step boundary (the next step's first forward input, which the previous stage sends in this
step) is received at the step's end and held over the update.

Versions. W(k) is a stage's weights after k updates (W(0) the initial ones). A micro-batch's backward
always uses the version its own forward used (weight stashing), so its gradient is exact for the
weights it saw. The update is W(t+1) = W(t) - eta * (AdamW direction of) G(t), G(t) the gradient of
batch t accumulated as above.

- ``pipedream`` (Narayanan et al. 2019, SOSP, with gradient accumulation over m micro-batches; m = 1
  is the paper's per-micro-batch update): a forward uses the newest version its stage has. On stage
  s, micro-batch j uses W(v), v = max(0, floor((j - w)/m)), in forward and backward. Staleness is per
  stage: ceil(w/m) updates at most (for m = 1 the paper's W(t+1) = W(t) - eta grad f(W1(t-p+1), ...,
  Wp(t)): the first stage p-1 updates stale, the last stage none). Versions kept on stage s:
  1 + ceil(w/m) (p - s for m = 1), live weights included.
- ``pipedream-2bw`` (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training"): every
  micro-batch of batch t uses W(max(t - 1, 0)) on every stage (the paper's version
  max(floor((k-1)/m) - 1, 0) for 1-indexed micro-batch k), so W(t+1) = W(t) - eta grad f(W(t-1)):
  one update of delay, the same on every stage. Versions kept on every stage: 2 (the one batch t + 1
  uses while W(t+1) waits for it). Needs m >= p - 1 (the paper asks m >= p): batch t + 1's first
  forward on stage 0 must come after batch t - 1's last backward there.

Memory: besides the versions, a stage holds the activations of at most w + 1 micro-batches, as in
1F1B. A version is a copy of the rank's flat parameter buffer (its TP shard; with ZeRO-1/2 every
data-parallel rank holds the whole buffer). Switching versions swaps the buffer's contents with a
stashed copy in place: autograd saved the parameters (which are views of the buffer with version
counters of their own), so a backward reads whatever the buffer holds, and the version is switched
back before it runs. Between steps the buffer holds the newest version (what evaluation, logging and
checkpoints see); the stashed older versions are saved with the optimizer state ("optimizer.
pipedream_behind{k}.NAME": NAME's value k updates ago) so resuming is exact: the in-flight forwards
are re-run on the restored versions.

Not supported (one-line errors in config/validate.py: ``check_async_schedule``): virtual stages,
context parallelism, ZeRO-3 and --overlap-param-gather (parameters not all present in the buffer after
a step), batch-size ramp-up (the version rule assumes a fixed m). With dropout, a resumed run re-draws
the in-flight micro-batches' dropout masks, so it is exact only without dropout.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from megalite.config import validate as rules
from megalite.config.schema import ASYNC_SCHEDULES
from megalite.parallel.pipeline.executor import StepHooks, run_pipeline_schedule
from megalite.parallel.pipeline.plan import async_step_plan
from megalite.parallel.pipeline.orders import Action

SWAP_CHUNK = 1 << 22                        # elements swapped at a time (bounds the temporary)


def warmup_forwards(pp: int, stage: int) -> int:
    return pp - 1 - stage


def version_of(schedule: str, pp: int, stage: int, m: int, j: int) -> int:
    """The weight version (updates applied) micro-batch ``j`` uses on ``stage``, forward and backward."""
    if schedule == "pipedream":
        return max(0, (j - warmup_forwards(pp, stage)) // m)
    return max(0, j // m - 1)


def versions_behind(schedule: str, pp: int, stage: int, m: int) -> int:
    """Older versions a stage keeps between steps, beside the newest."""
    if schedule == "pipedream":
        return math.ceil(warmup_forwards(pp, stage) / m)
    return 1


def _swap_(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the contents of two flat tensors with a bounded temporary."""
    for lo in range(0, a.numel(), SWAP_CHUNK):
        hi = min(a.numel(), lo + SWAP_CHUNK)
        tmp = a[lo:hi].clone()
        a[lo:hi].copy_(b[lo:hi])
        b[lo:hi].copy_(tmp)


class WeightVersions:
    """The weight versions of one stage: the live buffer ``flat`` holds version ``loaded``; ``stash``
    holds copies of the others still needed. ``newest`` = updates applied so far."""

    def __init__(self, flat: torch.Tensor, newest: int = 0):
        self.flat, self.newest, self.loaded = flat, newest, newest
        self.stash: dict[int, torch.Tensor] = {}
        self.oldest_needed = newest

    @torch.no_grad()
    def use(self, version: int) -> None:
        if version == self.loaded:
            return
        slot = self.stash.pop(version)
        if self.loaded >= self.oldest_needed:
            _swap_(self.flat, slot)
            self.stash[self.loaded] = slot
        else:
            self.flat.copy_(slot)          # the loaded version is no longer needed
        self.loaded = version

    def drop_older_than(self, version: int) -> None:
        self.oldest_needed = version
        for v in [v for v in self.stash if v < version]:
            del self.stash[v]

    @torch.no_grad()
    def before_update(self, keep_newest: bool) -> None:
        """Put the newest version in the buffer for the optimizer; keep a copy when batches in flight
        (or the next batch, under 2BW) still use it."""
        self.use(self.newest)
        if keep_newest:
            self.stash[self.newest] = self.flat.clone()

    def after_update(self, oldest_needed: int) -> None:
        self.newest += 1
        self.loaded = self.newest
        self.drop_older_than(oldest_needed)

    def count(self) -> int:
        """Versions held now, the live buffer included."""
        return 1 + len(self.stash)


class AsyncPipeline(StepHooks):
    """One rank's stage under an asynchronous schedule: its weight versions and its action stream, which
    continues from one training step to the next (see the module docstring). Each step runs on the one
    executor (executor.run_pipeline_schedule) with a plan of plan.async_step_plan; as its StepHooks this
    object switches the weight version around each forward and backward and holds the next step's first
    input over the update."""

    def __init__(self, schedule: str, flat: torch.Tensor, comm, pp: int, stage: int, num_microbatches: int,
                 train_iters: int, forward_fn):
        self.schedule, self.comm, self.pp, self.stage = schedule, comm, pp, stage
        self.m, self.total = num_microbatches, train_iters * num_microbatches
        self.w = warmup_forwards(pp, stage)
        self.forward_fn = forward_fn
        self.versions = WeightVersions(flat)
        self.batches: dict = {}          # micro-batch -> batch, for the micro-batches read and not yet done
        self.in_flight: dict = {}        # (chunk, mb) -> (input, output) of the next step's first backwards
        self.held_input: dict = {}       # the next step's first forward input, received by this step's H
        self.started = False
        self.first_microbatch = 0        # of the running step, over the run
        self.record = None               # an executor.PipelineRecord to fill (timelines), or None
        self.next_unread = 0             # the first micro-batch not read from the data iterator yet

    def version(self, j: int) -> int:
        return version_of(self.schedule, self.pp, self.stage, self.m, j)

    def restart_at(self, iteration: int) -> None:
        """A fresh stream from ``iteration`` (at start-up, or after loading a checkpoint)."""
        self.versions = WeightVersions(self.versions.flat, newest=iteration)
        self.versions.oldest_needed = self.version(iteration * self.m)     # the next backward's version
        self.in_flight, self.held_input, self.started = {}, {}, False
        self.batches = {}
        self.next_unread = iteration * self.m

    # ---- one training step -----------------------------------------------------------------------
    def forward_backward(self, iteration: int, read_batch, loss_scale: float = 1.0) -> torch.Tensor | None:
        """Step ``iteration``'s actions: the backwards of its m micro-batches and the forwards paired
        with them. ``read_batch()`` returns the next global batch's micro-batches."""
        if not self.started and self.versions.newest != iteration:     # --finetune: iteration 0 again
            self.restart_at(iteration)
        start, fresh = iteration * self.m, not self.started
        self._read_up_to(start + self.m + self.w, read_batch)
        self.started, self.first_microbatch = True, start
        remaining = self.total - start
        plan = async_step_plan(self.pp, self.stage, self.m, fresh, remaining)
        batches = [self.batches[start + i] for i in range(min(self.m + self.w, remaining))]
        return run_pipeline_schedule(plan, self.forward_fn, batches, self.comm, loss_scale, record=self.record,
                                     hooks=self)

    def _read_up_to(self, end: int, read_batch) -> None:
        """Read global batches until micro-batch ``end - 1`` (or the run's last) is in hand."""
        while self.next_unread < min(end, self.total):
            batches = read_batch()
            for i, b in enumerate(batches):
                self.batches[self.next_unread + i] = b
            self.next_unread += len(batches)

    # ---- StepHooks: what the executor calls around the actions ------------------------------------
    def before(self, action: Action) -> None:
        if action.kind in ("F", "B"):
            self.versions.use(self.version(self.first_microbatch + action.microbatch))

    def after(self, action: Action) -> None:
        if action.kind == "B":
            j = self.first_microbatch + action.microbatch
            self.batches.pop(j, None)
            self.versions.drop_older_than(self.version(j + 1))

    def start(self, stash: dict, inputs: dict) -> None:
        stash.update(self.in_flight)
        inputs.update(self.held_input)
        self.in_flight, self.held_input = {}, {}

    def end(self, stash: dict, inputs: dict) -> None:
        """Renumber what the step leaves from the next step's first micro-batch, m further on."""
        self.in_flight = {(chunk, mb - self.m): kept for (chunk, mb), kept in stash.items()}
        self.held_input = {("F", chunk, mb - self.m): x for (kind, chunk, mb), x in inputs.items() if kind == "H"}

    # ---- the update ------------------------------------------------------------------------------
    def optimizer_step(self, iteration: int, step: Callable):
        """``step()`` (step ``iteration``'s optimizer update) on the newest weight version, kept as a copy
        while micro-batches in flight (or the next batch, under 2BW) still use it; returns its result."""
        t = self.versions.newest
        self.versions.before_update(keep_newest=self.version((t + 1) * self.m) <= t)
        result = step()
        self.versions.after_update(self.version((iteration + 1) * self.m))
        return result

    # ---- checkpoints -----------------------------------------------------------------------------
    def stashed(self) -> dict[int, torch.Tensor]:
        """k -> the flat weights k updates before the newest, for the versions kept (between steps)."""
        return {k: self.versions.stash[self.versions.newest - k] for k in self.needed_behind()}

    def needed_behind(self) -> list[int]:
        """k for each older version a resumed stream needs."""
        newest = self.versions.newest
        return list(range(1, newest - self.version(newest * self.m) + 1))


def stashed_name(k: int, global_name: str) -> str:
    return f"optimizer.pipedream_behind{k}.{global_name}"


def build_async_pipeline(config, parallel, ddp, comm, forward_fn) -> AsyncPipeline | None:
    """The rank's AsyncPipeline under --pipeline-schedule pipedream / pipedream-2bw, else None."""
    schedule = config.parallel.pipeline_schedule
    if schedule not in ASYNC_SCHEDULES:
        return None
    rules.check_async_schedule(config)
    return AsyncPipeline(schedule, ddp.buffer.param_data, comm, parallel.pp_size, parallel.pp_rank,
                         config.num_microbatches, config.training.train_iters, forward_fn)
