"""The one executor of the synchronous pipeline schedules: it runs a rank's plan (plan.py) over its
model chunks.

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
from megalite.parallel.pipeline.zero_bubble import backward_input, backward_weight


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
        self.local: dict = {}          # (kind, chunk, micro-batch) -> tensor handed between two chunks here

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
        """Action k's input: received (waited only now), handed over locally, or None."""
        index = self.plan.receive_of.get(k)
        if index is None:
            source = self.plan.stages.source(action)
            return None if source is None else self.local.pop((action.kind, action.chunk, action.microbatch))
        self._issue(self.cursor.through(index))
        self.post_ahead()
        start = time.perf_counter()
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


def run_pipeline_schedule(plan: RankPlan, forward_fn: Callable, batches: list, comm, loss_scale: float = 1.0,
                          forward_only: bool = False, record: PipelineRecord | None = None) -> list[float]:
    """Execute ``plan`` on this pipeline rank; returns the micro-batch losses of the last virtual stage if
    this rank holds it, else [].

    ``forward_fn(chunk, input_tensor, batch, is_last_stage)`` returns the chunk's output activation, or on
    the last virtual stage the micro-batch's mean loss. Losses are backpropagated scaled by ``loss_scale /
    num_microbatches``. A B action whose W also appears in the order computes only the input gradient; its
    W computes the weight gradients (zero_bubble.py). ``forward_only``: the plan holds forwards only
    (plan.rank_plan(..., forward_only=True)) and runs without autograd.
    """
    stages, num_microbatches = plan.stages, len(batches)
    split = {(a.chunk, a.microbatch) for a in plan.order if a.kind == "W"}
    transfers = _Transfers(plan, comm, record)
    stash: dict = {}                 # (chunk, mb) -> (input tensor, output tensor)
    weight_grads: dict = {}          # (chunk, mb) -> zero_bubble.WeightGradients
    losses: list = []
    for k, action in enumerate(plan.order):
        chunk, mb = action.chunk, action.microbatch
        transfers.post_ahead()
        received = transfers.take(k, action)
        start = time.perf_counter()
        if action.kind == "F":
            x = received
            if x is not None and not forward_only:
                x.requires_grad_()
            with torch.no_grad() if forward_only else nullcontext():
                out = forward_fn(chunk, x, batches[mb], stages.last(chunk))
            if stages.last(chunk):
                losses.append(out.detach())
                out = out * (loss_scale / num_microbatches)
            else:
                transfers.give(k, "F", chunk, mb, out.detach())
            if not forward_only:
                stash[(chunk, mb)] = (x, out)
        elif action.kind == "B":
            x, out = stash.pop((chunk, mb))
            if (chunk, mb) in split:
                grad_input, weight_grads[(chunk, mb)] = backward_input(out, received, x)
            else:
                torch.autograd.backward(out, grad_tensors=received)
                grad_input = None if x is None else x.grad
            if not stages.first(chunk):
                transfers.give(k, "B", chunk, mb, grad_input)
        else:
            backward_weight(weight_grads.pop((chunk, mb)))
        if record is not None:
            record.add(action.kind, chunk, mb, start, time.perf_counter())
    comm.flush()
    return [float(x) for x in torch.stack(losses)] if losses else []
