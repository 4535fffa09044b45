"""Replay every rank's schedule order with given action costs: the bubble an order leaves by itself.

The executor (schedules.run_pipeline_schedule) runs one order per rank; sends never block and an action
waits only for its input. Replaying the orders under that rule with a cost per action gives the step's
timeline with no communication time and no jitter. With unit costs this is the theory of REFERENCE §6
(tests check the orders reach it); with the per-action times measured on a real run
(bench/bench_pipeline.py) it is what the order can do on that model's unequal stages, so the gap between
it and the measured bubble is the machine's: transfer latency and the spread of identical actions.

Messages are matched as NCCL matches them, in posting order per sender, receiver and communicator, tags
ignored; zbv sends gradients in a second communicator (p2p.py), so there they match per kind. A replay
that would deliver a message to the wrong receive, or deadlock, raises.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megalite.pipeline_parallel.schedules import Action, StageMap, schedule_order, stage_placement


@dataclass
class Replay:
    busy: list[float]          # per rank: time spent computing
    span: float                # the step's wall time: the last action's end, every rank starting at 0

    @property
    def bubble(self) -> float:
        """Mean over ranks of 1 - busy/span: what tools/plot_pipeline.py measures on a real run."""
        return sum(1.0 - b / self.span for b in self.busy) / len(self.busy)


def replay_schedule(schedule: str, pp: int, num_microbatches: int, num_chunks: int,
                    cost: Callable[[int, Action], float]) -> Replay:
    """Run the ranks' orders with ``cost(rank, action)`` seconds per action."""
    orders = [schedule_order(schedule, pp, r, num_microbatches, num_chunks) for r in range(pp)]
    maps = [StageMap(pp, r, num_chunks, stage_placement(schedule)) for r in range(pp)]
    per_kind = schedule == "zbv"
    sent: dict = {}            # (src, dst, channel) -> [(arrival, (kind, virtual stage, micro-batch))] in send order
    taken: dict = {}           # (src, dst, channel) -> messages received so far
    clock, position, busy = [0.0] * pp, [0] * pp, [0.0] * pp
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while position[r] < len(orders[r]):
                action = orders[r][position[r]]
                start = clock[r]
                source = maps[r].source(action)
                if source is not None:
                    channel = (source.rank, r, source.tag if per_kind else 0)
                    queue, n = sent.get(channel, []), taken.get(channel, 0)
                    if len(queue) <= n:
                        break                                       # its input is not sent yet
                    arrival, message = queue[n]
                    wanted = (action.kind, maps[source.rank].stage[source.chunk], action.microbatch)
                    if message != wanted:
                        raise RuntimeError(f"{schedule} pp={pp} m={num_microbatches}: rank {r} {action} would "
                                           f"receive {message}")
                    taken[channel] = n + 1
                    start = max(start, arrival)
                clock[r] = start + cost(r, action)
                busy[r] += clock[r] - start
                if _sends(action, maps[r]):
                    to = maps[r].destination(action.kind, action.chunk)
                    sent.setdefault((r, to.rank, to.tag if per_kind else 0), []).append(
                        (clock[r], (action.kind, maps[r].stage[action.chunk], action.microbatch)))
                position[r] += 1
                progress = True
    if any(position[r] < len(orders[r]) for r in range(pp)):
        raise RuntimeError(f"{schedule} pp={pp} m={num_microbatches} deadlocks")
    return Replay(busy, max(clock))


def _sends(action: Action, stages: StageMap) -> bool:
    """A forward sends its output unless its chunk is the last stage; a backward its input gradient
    unless its chunk is the first. W sends nothing."""
    if action.kind == "F":
        return not stages.last(action.chunk)
    return action.kind == "B" and not stages.first(action.chunk)
