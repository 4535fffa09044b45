"""Replay every rank's schedule order: the bubble an order leaves by itself, and its messages.

``dataflow_replay`` runs the orders with a cost per action, an action starting once its input has
been sent (sends never block). With unit costs this is the theory of the bubble formulas ((p-1)/(m+p-1)
for 1F1B, (p-1)/(3m+p-1) for ZB-H1; tests check the orders reach it); with the per-action times
measured on a real run (bench/bench_pipeline.py) it is what the order can do on that model's unequal
stages, so the gap between it and the measured bubble is the machine's: transfer latency and the
spread of identical actions. It also returns every message in the order it was sent, from which
plan.py derives the order each rank posts its sends and receives in (and checks that order under
NCCL's stream rules).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megalite.parallel.pipeline.orders import Action, StageMap, schedule_order, stage_placement


@dataclass
class Replay:
    busy: list[float]          # per rank: time spent computing
    span: float                # the step's wall time: the last action's end, every rank starting at 0

    @property
    def bubble(self) -> float:
        """Mean over ranks of 1 - busy/span: what tools/plot_pipeline.py measures on a real run."""
        return sum(1.0 - b / self.span for b in self.busy) / len(self.busy)


@dataclass(frozen=True)
class Message:
    """One activation (kind F) or gradient (kind B) between two ranks: who sends it after which of its
    actions, who receives it before which of its actions, and when it was sent in the replay."""
    sender: int
    sender_action: int
    receiver: int
    receiver_action: int
    sent: float


def _sends(action: Action, stages: StageMap) -> bool:
    """A forward sends its output unless its chunk is the last stage; a backward its input gradient
    unless its chunk is the first. W and H send nothing."""
    if action.kind == "F":
        return not stages.last(action.chunk)
    return action.kind == "B" and not stages.first(action.chunk)


def _payload(action: Action, stages: StageMap) -> tuple:
    """What an action sends: (kind, receiving virtual stage, micro-batch)."""
    to = stages.destination(action.kind, action.chunk)
    return action.kind, stages.stage[action.chunk] + (1 if action.kind == "F" else -1), action.microbatch, to.rank


def _wanted(rank: int, action: Action, stages: StageMap) -> tuple | None:
    """What a remote input an action needs: (kind, its own virtual stage, micro-batch, this rank); an H
    action receives a forward's input."""
    source = stages.source(action)
    if source is None or source.rank == rank:
        return None
    return "F" if action.kind == "H" else action.kind, stages.stage[action.chunk], action.microbatch, rank


def dataflow_replay(orders: list[list[Action]], maps: list[StageMap],
                    cost: Callable[[int, Action], float]) -> tuple[Replay, list[Message]]:
    """Run the orders with ``cost(rank, action)`` seconds per action; the replay and the messages in the
    order they were sent (ties: lower sender rank, then earlier action). Raises on a deadlock."""
    pp = len(orders)
    consumer = {_wanted(r, a, maps[r]): (r, k) for r in range(pp) for k, a in enumerate(orders[r])
                if _wanted(r, a, maps[r]) is not None}
    arrived: dict = {}          # payload -> (time sent, sender, sender's action index)
    clock, position, busy = [0.0] * pp, [0] * pp, [0.0] * pp
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while position[r] < len(orders[r]):
                action = orders[r][position[r]]
                start, wanted = clock[r], _wanted(r, action, maps[r])
                if wanted is not None:
                    if wanted not in arrived:
                        break                                        # its input is not sent yet
                    start = max(start, arrived[wanted][0])
                clock[r] = start + cost(r, action)
                busy[r] += clock[r] - start
                if _sends(action, maps[r]) and maps[r].destination(action.kind, action.chunk).rank != r:
                    arrived[_payload(action, maps[r])] = (clock[r], r, position[r])
                position[r] += 1
                progress = True
    if any(position[r] < len(orders[r]) for r in range(pp)):
        raise RuntimeError(f"the orders deadlock: ranks stop at actions {position}")
    messages = [Message(sender, k, consumer[payload][0], consumer[payload][1], sent)
                for payload, (sent, sender, k) in arrived.items()]
    return Replay(busy, max(clock)), sorted(messages, key=lambda m: (m.sent, m.sender, m.sender_action))


def replay_schedule(schedule: str, pp: int, num_microbatches: int, num_chunks: int,
                    cost: Callable[[int, Action], float]) -> Replay:
    """``dataflow_replay`` of a --pipeline-schedule's orders."""
    orders = [schedule_order(schedule, pp, r, num_microbatches, num_chunks) for r in range(pp)]
    maps = [StageMap(pp, r, num_chunks, stage_placement(schedule)) for r in range(pp)]
    return dataflow_replay(orders, maps, cost)[0]
