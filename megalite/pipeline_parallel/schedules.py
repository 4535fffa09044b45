"""Forward/backward schedules over the micro-batches of one global batch.

Every schedule calls ``loss_fn(batch) -> (loss, num_tokens)`` per micro-batch, where ``loss`` is the
mean per-token loss of that micro-batch, and backpropagates ``loss * loss_scale / num_microbatches``
so the accumulated gradient is that of the mean over micro-batches (Megatron's default).
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch


def forward_backward_no_pipelining(loss_fn: Callable, data_iterator: Iterator, num_microbatches: int,
                                   loss_scale: float = 1.0, forward_only: bool = False) -> list[float]:
    """Gradient accumulation on one stage; returns each micro-batch's mean loss."""
    losses = []
    for _ in range(num_microbatches):
        batch = next(data_iterator)
        if forward_only:
            with torch.no_grad():
                loss, _ = loss_fn(batch)
        else:
            loss, _ = loss_fn(batch)
            (loss * (loss_scale / num_microbatches)).backward()
        losses.append(loss.detach())
    return [float(x) for x in torch.stack(losses)]


# ---- pipeline schedules ------------------------------------------------------------------------
# A schedule is, per pipeline rank, an ordered list of actions: F(chunk, micro-batch) or B(chunk,
# micro-batch). One executor runs any of them: it receives what an action needs from the previous
# (forward) or next (backward) virtual stage, computes, and sends the result on. Virtual stage
# v = chunk * pp + rank; the first virtual stage embeds, the last computes the loss.

@dataclass(frozen=True)
class Action:
    kind: str          # "F" or "B"
    chunk: int
    microbatch: int


def gpipe_order(pp: int, rank: int, num_microbatches: int) -> list[Action]:
    """All forwards, then all backwards (GPipe)."""
    m = range(num_microbatches)
    return [Action("F", 0, i) for i in m] + [Action("B", 0, i) for i in m]


def one_f_one_b_order(pp: int, rank: int, num_microbatches: int) -> list[Action]:
    """1F1B: pp - rank - 1 warm-up forwards, then alternate forward/backward, then drain backwards."""
    warmup = min(pp - rank - 1, num_microbatches)
    order = [Action("F", 0, i) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [Action("F", 0, warmup + i), Action("B", 0, i)]
    order += [Action("B", 0, i) for i in range(num_microbatches - warmup, num_microbatches)]
    return order


def interleaved_order(pp: int, rank: int, num_microbatches: int, chunks: int) -> list[Action]:
    """Interleaved 1F1B (Megatron): micro-batches go through the chunks in groups of pp.

    The k-th forward runs chunk (k // pp) % chunks on micro-batch (k // (pp*chunks)) * pp + k % pp;
    backwards visit the chunks in reverse. Warm-up: (pp - rank - 1) * 2 + (chunks - 1) * pp forwards.
    """
    total = num_microbatches * chunks

    def action(kind: str, k: int) -> Action:
        chunk = (k // pp) % chunks
        if kind == "B":
            chunk = chunks - 1 - chunk
        return Action(kind, chunk, (k // (pp * chunks)) * pp + k % pp)

    warmup = min((pp - rank - 1) * 2 + (chunks - 1) * pp, total)
    order = [action("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [action("F", warmup + i), action("B", i)]
    order += [action("B", k) for k in range(total - warmup, total)]
    return order


def forward_only_order(order: list[Action]) -> list[Action]:
    return [a for a in order if a.kind == "F"]


ACTIVATION_TAG, GRADIENT_TAG = 1, 2


@dataclass
class PipelineRecord:
    """What ran when on this rank, for timelines (tools/plot_pipeline.py) and bubble measurements."""
    rank: int
    events: list = field(default_factory=list)      # (kind, chunk, microbatch, start, end)
    wait_seconds: float = 0.0                         # time spent waiting to receive

    def add(self, kind: str, chunk: int, microbatch: int, start: float, end: float) -> None:
        self.events.append((kind, chunk, microbatch, start, end))


def run_pipeline_schedule(order: list[Action], forward_fn: Callable, batches: list, comm, num_chunks: int,
                          loss_scale: float = 1.0, forward_only: bool = False,
                          record: PipelineRecord | None = None) -> list[float]:
    """Execute ``order`` on this pipeline rank; returns the micro-batch losses on the last stage.

    ``forward_fn(chunk, input_tensor, batch, is_last_stage)`` returns the chunk's output activation,
    or on the last virtual stage the micro-batch's mean loss. Losses are backpropagated scaled by
    ``loss_scale / num_microbatches``.
    """
    pp, rank = comm.size, comm.rank
    num_microbatches = len(batches)
    first = lambda chunk: chunk == 0 and rank == 0                              # noqa: E731
    last = lambda chunk: chunk == num_chunks - 1 and rank == pp - 1             # noqa: E731
    stash: dict = {}                 # (chunk, mb) -> (input tensor, output tensor)
    pending: list = []               # sends waiting to go out with the next receive
    losses: list = []

    def receive(src: int | None, tag: int):
        nonlocal pending
        start = time.perf_counter()
        received = comm.exchange(pending, src, tag=tag)
        if record is not None:
            record.wait_seconds += time.perf_counter() - start
        pending = []
        return received

    for action in order:
        chunk, mb = action.chunk, action.microbatch
        start = time.perf_counter()
        if action.kind == "F":
            x = None if first(chunk) else receive(comm.prev_rank, ACTIVATION_TAG)
            start = time.perf_counter()
            if x is not None and not forward_only:
                x.requires_grad_()
            with torch.no_grad() if forward_only else nullcontext():
                out = forward_fn(chunk, x, batches[mb], last(chunk))
            if last(chunk):
                losses.append(out.detach())
                out = out * (loss_scale / num_microbatches)
            else:
                pending.append((out.detach(), comm.next_rank, ACTIVATION_TAG))
            if not forward_only:
                stash[(chunk, mb)] = (x, out)
        else:
            grad = None if last(chunk) else receive(comm.next_rank, GRADIENT_TAG)
            start = time.perf_counter()
            x, out = stash.pop((chunk, mb))
            torch.autograd.backward(out, grad_tensors=grad)
            if not first(chunk):
                pending.append((x.grad, comm.prev_rank, GRADIENT_TAG))
        if record is not None:
            record.add(action.kind, chunk, mb, start, time.perf_counter())
    if pending:
        comm.exchange(pending, None)
    comm.flush()
    return [float(x) for x in torch.stack(losses)] if losses else []
