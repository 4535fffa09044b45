"""The one executor of the pipeline schedules, synchronous and asynchronous: it runs a rank's plan
(plan.py) over its model chunks.

Per action it receives what the action needs from the previous (forward) or next (backward) virtual
stage, computes, and sends the result on. Sends go out as soon as their tensor exists; receives are
posted ahead of need where the plan allows, so transfers overlap computation; every send and receive is
posted in the plan's order, which is what makes the schedule run on NCCL (plan.py says why).
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from megalite.parallel.pipeline.plan import PostingCursor, RankPlan
from megalite.parallel.pipeline.orders import Action
from megalite.parallel.pipeline.split_backward import backward_input, backward_weight
from megalite.observe.clocks import waiting


@dataclass
class PipelineRecord:
    """What ran when on this rank, for timelines (tools/plot_pipeline.py) and bubble measurements."""
    rank: int
    events: list = field(default_factory=list)      # (kind, chunk, microbatch, start, end)
    wait_seconds: float = 0.0                         # time spent waiting to receive

    def add(self, kind: str, chunk: int, microbatch: int, start: float, end: float) -> None:
        self.events.append((kind, chunk, microbatch, start, end))


class _Transfers:
    """This rank's sends and receives, posted through a PostingCursor in the plan's order."""

    def __init__(self, plan: RankPlan, comm, record: PipelineRecord | None):
        self.plan, self.comm, self.record = plan, comm, record
        self.cursor = PostingCursor(plan.posts)
        self.receives: dict = {}       # post index -> PendingReceive
        self.outgoing: dict = {}       # post index -> tensor produced, about to be sent
        self.local: dict = {}          # (kind, chunk, mb) -> tensor handed over here: chunk to chunk, or step to step

    def _issue(self, indices: range) -> None:
        for i in indices:
            post = self.plan.posts[i]
            peer = self.comm.global_rank(post.peer)
            if post.send:
                self.comm.send(self.outgoing.pop(i), peer)
            else:
                self.receives[i] = self.comm.post_recv(peer)

    def post_ahead(self) -> None:
        self._issue(self.cursor.ahead())

    def take(self, k: int, action) -> torch.Tensor | None:
        """Action k's input: received (waited only now), handed over locally or held from the step before
        (StepHooks.start), or None."""
        index = self.plan.receive_of.get(k)
        if index is None:
            source = self.plan.stages.source(action)
            return None if source is None else self.local.pop((action.kind, action.chunk, action.microbatch))
        self._issue(self.cursor.through(index))
        self.post_ahead()
        start = time.perf_counter()
        with waiting():                           # --log-straggler: blocked on the previous/next stage
            tensor = self.comm.wait(self.receives.pop(index))
        self.cursor.waited()
        if self.record is not None:
            self.record.wait_seconds += time.perf_counter() - start
        return tensor

    def give(self, k: int, kind: str, chunk: int, mb: int, tensor: torch.Tensor) -> None:
        """Action k's output, to the neighbouring virtual stage."""
        index = self.plan.send_of.get(k)
        if index is None:
            self.local[(kind, self.plan.stages.destination(kind, chunk).chunk, mb)] = tensor
            return
        self.outgoing[index] = tensor
        self._issue(self.cursor.produce(index))


class StepHooks:
    """What the executor calls around a step's actions. The synchronous schedules need none of it (this
    base does nothing); the asynchronous ones (pipedream.AsyncPipeline) switch weight versions around each
    forward and backward, and carry work from one step into the next: forwards whose backward comes in
    the next step, and the input an H action received for the next step's first forward."""

    def before(self, action: Action) -> None:
        """Right before ``action`` takes its input and runs."""

    def after(self, action: Action) -> None:
        """Right after ``action`` ran and sent its output."""

    def start(self, stash: dict, inputs: dict) -> None:
        """Put what the step before left into the step's ``stash`` ((chunk, micro-batch) -> a forward's
        (input, output), awaiting its backward) and ``inputs`` ((kind, chunk, micro-batch) -> an input
        received earlier), numbered as this step's actions are."""

    def end(self, stash: dict, inputs: dict) -> None:
        """Take what the step leaves: its forwards not backpropagated yet, its H actions' inputs
        (under ("H", chunk, micro-batch))."""


def run_pipeline_schedule(plan: RankPlan, forward_fn: Callable, batches: list, comm, loss_scale: float = 1.0,
                          forward_only: bool = False, record: PipelineRecord | None = None,
                          hooks: StepHooks = StepHooks()) -> torch.Tensor | None:
    """Execute ``plan`` on this pipeline rank; returns the micro-batch losses of the last virtual stage
    (stacked, on the device) if this rank holds it, else None.

    ``forward_fn(chunk, input_tensor, batch, is_last_stage)`` returns the chunk's output activation, or on
    the last virtual stage the micro-batch's mean loss; F(chunk, i) runs it on ``batches[i]``. Losses are
    backpropagated scaled by ``loss_scale`` / the step's micro-batches (those it backpropagates). A B
    action whose W also appears in the order computes only the input gradient; its W computes the weight
    gradients (split_backward.py). ``forward_only``: the plan holds forwards only
    (plan.rank_plan(..., forward_only=True)) and runs without autograd. ``hooks``: what the schedule does
    around the actions (StepHooks).
    """
    step = _Step(plan, forward_fn, batches, loss_scale, forward_only)
    transfers = _Transfers(plan, comm, record)
    hooks.start(step.stash, transfers.local)
    for k, action in enumerate(plan.order):
        transfers.post_ahead()
        hooks.before(action)
        received = transfers.take(k, action)
        start = time.perf_counter()
        if action.kind == "H":                  # held for the next step's first forward
            transfers.local[("H", action.chunk, action.microbatch)] = received
            continue
        output = step.run(action, received)
        if output is not None:
            transfers.give(k, action.kind, action.chunk, action.microbatch, output)
        hooks.after(action)
        if record is not None:
            record.add(action.kind, action.chunk, action.microbatch, start, time.perf_counter())
    hooks.end(step.stash, transfers.local)
    if plan.posts:
        with waiting():
            comm.flush()
    return torch.stack(step.losses) if step.losses else None


class _Step:
    """The computation of one step's actions on this rank's chunks, and what lives between them."""

    def __init__(self, plan: RankPlan, forward_fn: Callable, batches: list, loss_scale: float, forward_only: bool):
        self.stages, self.forward_fn, self.batches = plan.stages, forward_fn, batches
        self.forward_only, self.loss_scale = forward_only, loss_scale
        self.num_microbatches = sum(1 for a in plan.order if a.kind == "B" and a.chunk == 0)
        self.split = {(a.chunk, a.microbatch) for a in plan.order if a.kind == "W"}
        self.stash: dict = {}            # (chunk, mb) -> (input tensor, output tensor)
        self.weight_grads: dict = {}     # (chunk, mb) -> split_backward.WeightGradients
        self.losses: list = []

    def run(self, action: Action, received: torch.Tensor | None) -> torch.Tensor | None:
        """Run ``action``; returns what it sends on (an activation or an input gradient), or None."""
        chunk, mb = action.chunk, action.microbatch
        if action.kind == "F":
            return self.forward(chunk, mb, received)
        if action.kind == "B":
            x, out = self.stash.pop((chunk, mb))
            if (chunk, mb) in self.split:
                grad_input, self.weight_grads[(chunk, mb)] = backward_input(out, received, x)
            else:
                torch.autograd.backward(out, grad_tensors=received)
                grad_input = None if x is None else x.grad
            return None if self.stages.first(chunk) else grad_input
        backward_weight(self.weight_grads.pop((chunk, mb)))
        return None

    def forward(self, chunk: int, mb: int, x: torch.Tensor | None) -> torch.Tensor | None:
        last = self.stages.last(chunk)
        if x is not None and not self.forward_only:
            x.requires_grad_()
        with torch.no_grad() if self.forward_only else nullcontext():
            out = self.forward_fn(chunk, x, self.batches[mb], last)
        if last:
            self.losses.append(out.detach())
        if self.forward_only:
            return None if last else out.detach()
        if last:
            out = out * (self.loss_scale / self.num_microbatches)
        self.stash[(chunk, mb)] = (x, out)
        return None if last else out.detach()
