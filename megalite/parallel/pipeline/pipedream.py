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

Not supported (one-line errors in ``check_async_schedule``): virtual stages, context parallelism,
ZeRO-3 and --overlap-param-gather (parameters not all present in the buffer after a step), batch-size
ramp-up (the version rule assumes a fixed m). With dropout, a resumed run re-draws the in-flight
micro-batches' dropout masks, so it is exact only without dropout.
"""
from __future__ import annotations

import math
import time

import torch

from megalite.config.schema import ASYNC_SCHEDULES
from megalite.errors import UserError

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


def check_async_schedule(config, dp_strategy: str) -> None:
    """One-line UserError for what the asynchronous schedules do not combine with."""
    schedule, par, t = config.parallel.pipeline_schedule, config.parallel, config.training
    flag = f"--pipeline-schedule {schedule}"
    if par.context_parallel_size > 1:
        raise UserError(f"{flag} does not support --context-parallel-size > 1 (not built: the ring attention's "
                        "per-step exchanges are not versioned); use --pipeline-schedule 1f1b")
    if par.num_layers_per_virtual_pipeline_stage or getattr(par, "num_virtual_stages_per_pipeline_rank", None):
        raise UserError(f"{flag} runs one model chunk per rank: drop --num-layers-per-virtual-pipeline-stage / "
                        "--num-virtual-stages-per-pipeline-rank")
    if dp_strategy == "optim_grads_params":
        raise UserError(f"{flag} keeps whole weight versions per stage, which ZeRO-3 "
                        "(--data-parallel-sharding-strategy optim_grads_params) never gathers; use optim or optim_grads")
    if par.overlap_param_gather:
        raise UserError(f"{flag} needs the updated weights in place right after the step to stash them: drop "
                        "--overlap-param-gather")
    if getattr(par, "use_torch_fsdp2", False):
        raise UserError(f"{flag} does not support --use-torch-fsdp2 (one copy of the weights); drop it")
    if t.batch_size_schedule:
        raise UserError(f"{flag} needs a fixed number of micro-batches per step: drop --rampup-batch-size / "
                        "--step-batch-size-schedule")
    pp, m = par.pipeline_model_parallel_size, config.num_microbatches
    if schedule == "pipedream-2bw" and m < pp - 1:
        raise UserError(f"--pipeline-schedule pipedream-2bw needs at least pipeline size - 1 = {pp - 1} micro-batches "
                        f"per step (it has {m}): raise --global-batch-size")


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


class AsyncPipeline:
    """One rank's stage under an asynchronous schedule: its version bookkeeping and its action stream,
    which continues from one training step to the next (see the module docstring)."""

    def __init__(self, schedule: str, flat: torch.Tensor, comm, pp: int, stage: int, num_microbatches: int,
                 train_iters: int, forward_fn):
        self.schedule, self.comm, self.pp, self.stage = schedule, comm, pp, stage
        self.m, self.total = num_microbatches, train_iters * num_microbatches
        self.w = warmup_forwards(pp, stage)
        self.forward_fn = forward_fn
        self.versions = WeightVersions(flat)
        self.in_flight: dict = {}        # micro-batch -> (input, output) kept for its backward
        self.batches: dict = {}          # micro-batch -> batch, for the micro-batches read and not yet done
        self.weights: dict = {}          # per-token loss weights by id(batch)
        self.next_input = None           # the next forward's input, received at the end of the last step
        self.started = False
        self.posted: dict = {}           # ("F" or "B", micro-batch) -> its receive, posted ahead of need
        self.record = None               # a schedules.PipelineRecord to fill (timelines), or None
        self.losses: list = []
        self.next_unread = 0             # the first micro-batch not read from the data iterator yet

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    def version(self, j: int) -> int:
        return version_of(self.schedule, self.pp, self.stage, self.m, j)

    def restart_at(self, iteration: int) -> None:
        """A fresh stream from ``iteration`` (at start-up, or after loading a checkpoint)."""
        self.versions = WeightVersions(self.versions.flat, newest=iteration)
        self.versions.oldest_needed = self.version(iteration * self.m)     # the next backward's version
        self.in_flight, self.batches, self.weights, self.next_input, self.started = {}, {}, {}, None, False
        self.next_unread = iteration * self.m

    # ---- point to point (p2p.py: matched by posting order, as NCCL matches) ---------------------------
    # Between stage s and s + 1 both ends post, in iteration j of s: the activation of F(j + w_s), then
    # the gradient of B(j). Stage s posts that receive after its forward's send; stage s + 1 posts the
    # activation's receive before its backward's send. So each pair's stream holds the same messages in
    # the same order on both ends, and no receive waits behind a send its peer needs first (NCCL's rule:
    # a rank pair's operations run in posting order on one stream).
    def _post(self, kind: str, j: int) -> None:
        """Post the receive F(j) or B(j) needs, so it arrives while this stage computes something else."""
        if (kind, j) not in self.posted:
            self.posted[(kind, j)] = self.comm.post_recv(self.comm.prev_rank if kind == "F" else self.comm.next_rank)

    def _receive(self, kind: str, j: int):
        self._post(kind, j)
        start = time.perf_counter()
        received = self.comm.wait(self.posted.pop((kind, j)))
        if self.record is not None:
            self.record.wait_seconds += time.perf_counter() - start
        return received

    # ---- actions ---------------------------------------------------------------------------------
    def _forward(self, j: int, loss_scale: float) -> None:
        self.versions.use(self.version(j))
        x = None
        if not self.first:
            x, self.next_input = self.next_input, None
            if x is None:
                x = self._receive("F", j)
            x.requires_grad_()
        start = time.perf_counter()
        batch = self.batches[j]
        out = self.forward_fn(0, x, batch, self.last)
        if self.last:
            if self.weights:
                out = out * self.weights[id(batch)]
            self.losses.append(out.detach())
            out = out * (loss_scale / self.m)
        else:
            self.comm.send(out.detach(), self.comm.next_rank)     # at once: never deferred
        self.in_flight[j] = (x, out)
        if self.record is not None:
            self.record.add("F", 0, j, start, time.perf_counter())

    def _backward(self, j: int) -> None:
        self.versions.use(self.version(j))
        grad = None if self.last else self._receive("B", j)
        start = time.perf_counter()
        x, out = self.in_flight.pop(j)
        torch.autograd.backward(out, grad_tensors=grad)
        if not self.first:
            self.comm.send(x.grad, self.comm.prev_rank)
        self.batches.pop(j, None)
        self.versions.drop_older_than(self.version(j + 1))
        if self.record is not None:
            self.record.add("B", 0, j, start, time.perf_counter())

    # ---- one training step -----------------------------------------------------------------------
    def forward_backward(self, iteration: int, read_batch, loss_scale: float = 1.0) -> list[float]:
        """Step ``iteration``'s actions: the backwards of its m micro-batches and the forwards paired
        with them. ``read_batch()`` returns the next global batch's (micro-batches, loss weights)."""
        m, start = self.m, iteration * self.m
        self._read_up_to(start + m + self.w, read_batch)
        self.losses = []
        if not self.started and self.versions.newest != iteration:     # --finetune: iteration 0 again
            self.restart_at(iteration)
        if not self.started:
            for j in range(start, min(start + self.w, self.total)):
                self._forward(j, loss_scale)
            self.started = True
        for j in range(start, start + m):
            if j + self.w < self.total:
                self._forward(j + self.w, loss_scale)
            if not self.last:
                self._post("B", j)                        # after F(j + w)'s send: the pair's order
            if not self.first and j + self.w + 1 < self.total:
                self._post("F", j + self.w + 1)           # before B(j)'s send; arrives while B(j) computes
            self._backward(j)
        return [float(x) for x in torch.stack(self.losses)] if self.losses else []

    def _read_up_to(self, end: int, read_batch) -> None:
        """Read global batches until micro-batch ``end - 1`` (or the run's last) is in hand."""
        while self.next_unread < min(end, self.total):
            batches, weights = read_batch()
            for i, b in enumerate(batches):
                self.batches[self.next_unread + i] = b
            self.weights.update(weights or {})
            self.next_unread += len(batches)

    def before_update(self) -> None:
        """Right before the optimizer step: the newest version in the buffer (copied if still needed)."""
        t = self.versions.newest
        self.versions.before_update(keep_newest=self.version((t + 1) * self.m) <= t)

    def after_update(self, iteration: int) -> None:
        """Right after step ``iteration``'s update: record the new version, receive the next forward's
        input (so no message crosses the step boundary) and let this step's sends complete."""
        self.versions.after_update(self.version((iteration + 1) * self.m))
        next_forward = (iteration + 1) * self.m + self.w
        if not self.first and next_forward < self.total:
            self.next_input = self._receive("F", next_forward)
        if self.comm is not None:
            self.comm.flush()

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
    check_async_schedule(config, getattr(ddp, "strategy", ""))
    return AsyncPipeline(schedule, ddp.buffer.param_data, comm, parallel.pp_size, parallel.pp_rank,
                         config.num_microbatches, config.training.train_iters, forward_fn)
