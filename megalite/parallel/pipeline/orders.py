"""Pipeline schedules as orders of actions, and where each virtual stage sits.

A schedule is, per pipeline rank, an ordered list of actions: F(chunk, micro-batch), B(chunk,
micro-batch), for the zero-bubble schedules W(chunk, micro-batch) (then B is the input gradient only),
and for the asynchronous schedules H(micro-batch): receive a forward's input and hold it over the weight
update into the next step. One executor runs any of them: it receives what an action needs from the previous (forward)
or next (backward) virtual stage, computes, and sends the result on (executor.py, posting in the order
of plan.py). Virtual stage v = chunk * pp + rank (interleaved placement) or the V placement of zbv; the
first virtual stage embeds, the last computes the loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Action:
    kind: str          # "F", "B", "W" or "H"
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


def zero_bubble_h1_order(pp: int, rank: int, num_microbatches: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2024): 1F1B whose backwards compute only the input gradient (B), each weight
    gradient (W) following ``rank`` backwards later, so the W's fill the idle slots at the end of the
    pipeline (the placement of torch.distributed.pipelining's ZB1P). At most pp - rank micro-batches
    are in flight, as in 1F1B; bubble about (p-1)/(3m+p-1) with equal F, B and W times."""
    m = num_microbatches
    warmup = min(pp - rank - 1, m)
    order = [Action("F", 0, i) for i in range(warmup)]
    weights = 0
    for i in range(m):
        if warmup + i < m:
            order.append(Action("F", 0, warmup + i))
        order.append(Action("B", 0, i))
        if i >= rank:
            order.append(Action("W", 0, weights))
            weights += 1
    order += [Action("W", 0, i) for i in range(weights, m)]
    return order


def zbv_order(pp: int, rank: int, num_microbatches: int) -> list[Action]:
    """ZB-V (Qi et al. 2024, section 6): two chunks per rank placed in a V (chunk 0 is virtual stage
    rank, chunk 1 is 2*pp - 1 - rank, see v_shape_stage), the order of torch.distributed.pipelining's
    ScheduleZBVZeroBubble. Zero bubble when F, B and W take equal time; 1F1B's activation memory."""
    n = max(2 * pp - 1, num_microbatches)       # built for at least 2p-1 micro-batches, the rest dropped
    forwards, backwards, order = [0, 0], [0, 0], []

    def forward(chunk: int) -> None:
        order.append(Action("F", chunk, forwards[chunk]))
        forwards[chunk] += 1

    def backward(chunk: int, with_weight: bool = True) -> None:
        order.append(Action("B", chunk, backwards[chunk]))
        if with_weight:
            order.append(Action("W", chunk, backwards[chunk]))
        backwards[chunk] += 1

    for _ in range(2 * (pp - rank) - 1):
        forward(0)
    for _ in range(rank):
        forward(1)
        forward(0)
    for _ in range(pp - rank):
        forward(1)
        backward(1)
    while forwards[1] < forwards[0] or forwards[0] < n:
        if forwards[0] < n:
            forward(0)
        backward(0)
        forward(1)
        backward(1)
    weights = list(backwards)
    for _ in range(rank):
        backward(0, with_weight=False)
        backward(1, with_weight=False)
    for _ in range(pp - rank):
        backward(0, with_weight=False)
        order.append(Action("W", 0, weights[0]))
        weights[0] += 1
    order += [Action("W", 1, i) for i in range(weights[1], backwards[1])]
    order += [Action("W", 0, i) for i in range(weights[0], backwards[0])]
    return [a for a in order if a.microbatch < num_microbatches]


def interleaved_stage(rank: int, chunk: int, pp: int) -> int:
    """Virtual stage of a rank's chunk, interleaved placement (Megatron): chunk * pp + rank."""
    return chunk * pp + rank


def v_shape_stage(rank: int, chunk: int, pp: int) -> int:
    """Virtual stage of a rank's chunk, V placement (zbv): rank, then 2 * pp - 1 - rank, so rank 0 holds
    the first and the last stage and the middle of the model turns around on the last rank."""
    return rank if chunk == 0 else 2 * pp - 1 - rank


def schedule_order(schedule: str, pp: int, rank: int, num_microbatches: int, num_chunks: int) -> list[Action]:
    """This rank's order for a synchronous --pipeline-schedule (1f1b is interleaved with virtual stages)."""
    if schedule == "zbv":
        return zbv_order(pp, rank, num_microbatches)
    if schedule == "zb-h1":
        return zero_bubble_h1_order(pp, rank, num_microbatches)
    if num_chunks > 1:
        return interleaved_order(pp, rank, num_microbatches, num_chunks)
    if schedule == "gpipe":
        return gpipe_order(pp, rank, num_microbatches)
    return one_f_one_b_order(pp, rank, num_microbatches)


def stage_placement(schedule: str):
    """The virtual-stage mapping a schedule runs with."""
    return v_shape_stage if schedule == "zbv" else interleaved_stage


def async_step_order(pp: int, rank: int, num_microbatches: int, fresh: bool, remaining: int) -> list[Action]:
    """One training step of PipeDream / PipeDream-2BW (pipedream.py) on pipeline stage ``rank``, micro-batches
    numbered from the step's first: w = pp - 1 - rank warm-up forwards lead the backwards, so the step is
    the pairs (F(i + w), B(i)) for its m micro-batches, preceded on a ``fresh`` stream (the first step,
    or the first after a restart) by the warm-up F(0..w-1). Forwards stop at the run's end, ``remaining``
    micro-batches from the step's first. F(m + w)'s input, sent by the previous stage in this step, is
    received by H(m + w) at the end and held over the update: the next step's first forward F(w) takes it
    (its StageMap's ``held``), so no message crosses the step boundary, where the update's collectives run."""
    m, w = num_microbatches, pp - 1 - rank
    order = [Action("F", 0, i) for i in range(min(w, remaining))] if fresh else []
    for i in range(m):
        if i + w < remaining:
            order.append(Action("F", 0, i + w))
        order.append(Action("B", 0, i))
    if rank > 0 and m + w < remaining:
        order.append(Action("H", 0, m + w))
    return order


def forward_only_order(order: list[Action]) -> list[Action]:
    return [a for a in order if a.kind == "F"]


@dataclass(frozen=True)
class Transfer:
    """Where an action's input comes from: ``rank`` (pipeline rank) and ``chunk`` of the neighbouring
    virtual stage; ``rank`` is this rank when the neighbour is another chunk here (zbv's turn)."""
    rank: int
    chunk: int


class StageMap:
    """The virtual-stage neighbours of this rank's chunks under a placement. ``held``: the micro-batch
    whose forward takes the input an H action of the step before received (asynchronous schedules)."""

    def __init__(self, pp: int, rank: int, num_chunks: int, placement: Callable, held: int | None = None):
        self.rank, self.pp, self.held = rank, pp, held
        self.stage = [placement(rank, c, pp) for c in range(num_chunks)]
        self.num_stages = pp * num_chunks
        self.where = {placement(r, c, pp): (r, c) for r in range(pp) for c in range(num_chunks)}

    def first(self, chunk: int) -> bool:
        return self.stage[chunk] == 0

    def last(self, chunk: int) -> bool:
        return self.stage[chunk] == self.num_stages - 1

    def source(self, action: Action) -> Transfer | None:
        """Where a forward's activation (F, or H for the next step's) or a backward's gradient comes from;
        this rank for an input handed over locally or held from the step before; None when it needs nothing."""
        if action.kind == "F" and action.microbatch == self.held:
            return Transfer(self.rank, action.chunk)
        if action.kind in ("F", "H") and not self.first(action.chunk):
            return Transfer(*self.where[self.stage[action.chunk] - 1])
        if action.kind == "B" and not self.last(action.chunk):
            return Transfer(*self.where[self.stage[action.chunk] + 1])
        return None

    def destination(self, kind: str, chunk: int) -> Transfer:
        """Where a forward's output (kind F) or a backward's input gradient (kind B) goes."""
        v = self.stage[chunk] + (1 if kind == "F" else -1)
        return Transfer(*self.where[v])
