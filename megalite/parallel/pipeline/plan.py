"""The order in which each pipeline rank posts its sends and receives, so that the schedules run on NCCL.

NCCL runs the sends and receives between two ranks on one stream in posting order; each holds the stream
until its counterpart on the other rank is reached (a send is not promised a buffer), and tags are
ignored: the n-th send from a to b meets the n-th receive on b from a. gloo forgives any order, NCCL hangs:
in 1F1B at pp=2 with a receive posted ahead, rank 0's stream holds (send a0, recv g0, send a1) while rank
1's holds (recv a0, recv a1, send g0), and each waits on an operation queued behind the other's.

The rule used here: every rank posts its messages in one global order that all ranks compute alike, the
order in which a unit-cost replay of the schedule sends them (simulate.dataflow_replay; ties by sender
rank, then by the sender's action). Then every stream, whether NCCL gives one per rank pair (single
isend / irecv) or one per rank, holds its operations in that global order, so the earliest unfinished
message heads both its sender's and its receiver's stream and completes once both posted it. Both do
in time: a send is posted right after the action that produces it, and every operation before a message
in the order belongs to an action that ran earlier in the replay, so a rank reaches it before it needs
any later message. Receives may still be posted ahead of need (the transfer overlaps the computation),
in order, up to the next send this rank has not produced yet: ``PostingCursor``.

``stream_replay`` checks the result the way NCCL would run it (no timing: posting decisions depend only on
the orders), and the tests run it for every schedule and layout; the NCCL-semantics test tier runs the
executor itself under the same rules.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from megalite.parallel.pipeline.orders import (Action, StageMap, async_step_order, forward_only_order,
                                                  interleaved_stage, schedule_order, stage_placement)
from megalite.parallel.pipeline.simulate import dataflow_replay

RECEIVE_AHEAD = 1          # receives in flight beyond the one the next receiving action waits on


@dataclass(frozen=True)
class Post:
    send: bool
    action: int            # index in the rank's order of the action that produces (send) or consumes (recv) it
    peer: int              # pipeline rank at the other end


@dataclass
class RankPlan:
    """One rank's schedule: its actions, its chunks' virtual stages, and its posts in posting order."""
    order: list[Action]
    stages: StageMap
    posts: list[Post]
    receive_of: dict = field(default_factory=dict)     # action index -> index of the post it waits on
    send_of: dict = field(default_factory=dict)        # action index -> index of the post carrying its output
    source_action: dict = field(default_factory=dict)  # receive's post index -> the sender's action index


def build_plans(orders: list[list[Action]], maps: list[StageMap]) -> list[RankPlan]:
    """Every rank's plan for these orders."""
    _, messages = dataflow_replay(orders, maps, lambda rank, action: 1.0)
    plans = [RankPlan(orders[r], maps[r], []) for r in range(len(orders))]
    for m in messages:
        sender, receiver = plans[m.sender], plans[m.receiver]
        sender.send_of[m.sender_action] = len(sender.posts)
        sender.posts.append(Post(True, m.sender_action, m.receiver))
        receiver.receive_of[m.receiver_action] = len(receiver.posts)
        receiver.source_action[len(receiver.posts)] = m.sender_action
        receiver.posts.append(Post(False, m.receiver_action, m.sender))
    return plans


@lru_cache(maxsize=64)
def schedule_plans(schedule: str, pp: int, num_microbatches: int, num_chunks: int,
                   forward_only: bool = False) -> tuple[RankPlan, ...]:
    """Every rank's plan for a synchronous --pipeline-schedule (forward_only: evaluation's forwards)."""
    orders = [schedule_order(schedule, pp, r, num_microbatches, num_chunks) for r in range(pp)]
    if forward_only:
        orders = [forward_only_order(order) for order in orders]
    maps = [StageMap(pp, r, num_chunks, stage_placement(schedule)) for r in range(pp)]
    return tuple(build_plans(orders, maps))


def rank_plan(schedule: str, pp: int, rank: int, num_microbatches: int, num_chunks: int,
              forward_only: bool = False) -> RankPlan:
    return schedule_plans(schedule, pp, num_microbatches, num_chunks, forward_only)[rank]


def async_step_plan(pp: int, rank: int, num_microbatches: int, fresh: bool, remaining: int) -> RankPlan:
    """This rank's plan for one step of an asynchronous schedule (orders.async_step_order): ``fresh``
    for a stream's first step, ``remaining`` micro-batches left in the run from the step's first."""
    return _async_step_plans(pp, num_microbatches, fresh, min(remaining, num_microbatches + pp))[rank]


@lru_cache(maxsize=64)
def _async_step_plans(pp: int, num_microbatches: int, fresh: bool, remaining: int) -> tuple[RankPlan, ...]:
    orders = [async_step_order(pp, r, num_microbatches, fresh, remaining) for r in range(pp)]
    maps = [StageMap(pp, r, 1, interleaved_stage, held=None if fresh or r == 0 else pp - 1 - r) for r in range(pp)]
    return tuple(build_plans(orders, maps))


class PostingCursor:
    """Which of a rank's posts go out now. Posts go out strictly in plan order; a send only once its
    action produced it; receives ahead of need while no unproduced send comes first, at most
    ``receive_ahead`` of them beyond those already waited for."""

    def __init__(self, posts: list[Post], receive_ahead: int = RECEIVE_AHEAD):
        self.posts, self.receive_ahead = posts, receive_ahead
        self.next = 0                  # the first post not issued yet
        self.open = 0                  # receives issued and not yet waited for
        self.produced: set = set()

    def through(self, index: int) -> range:
        """Issue every post up to ``index`` (the caller issues them in this order)."""
        issued = range(self.next, max(self.next, index + 1))
        for i in issued:
            if self.posts[i].send and i not in self.produced:
                raise RuntimeError(f"pipeline plan: post {i} is a send not produced yet, before post {index}")
            self.open += not self.posts[i].send
        self.next = issued.stop
        return issued

    def produce(self, index: int) -> range:
        """The send at ``index`` exists: issue it (and the receives the plan puts before it)."""
        self.produced.add(index)
        return self.through(index)

    def waited(self) -> None:
        self.open -= 1

    def ahead(self) -> range:
        """Receives that may go out now, ahead of need."""
        stop = self.next
        while (stop < len(self.posts) and not self.posts[stop].send
               and self.open + (stop - self.next) < self.receive_ahead + 1):
            stop += 1
        return self.through(stop - 1)


def stream_replay(plans: list[RankPlan], receive_ahead: int = RECEIVE_AHEAD, per: str = "pair") -> None:
    """Run every rank's plan as the executor does, under NCCL's rules: one FIFO stream per rank pair
    (``per="pair"``, as single isend / irecv run) or one per rank (``per="rank"``, stricter); an operation
    completes when its counterpart heads the peer's stream. Raises on a deadlock, or where a message would
    reach another receive than the one meant for it."""
    streams: dict = {}             # (rank, stream) -> [(post index, message, is send, peer)] in posting order
    done = [set() for _ in plans]
    cursors = [PostingCursor(p.posts, receive_ahead) for p in plans]
    position = [0] * len(plans)

    def stream(r: int, peer: int) -> tuple:
        return (r, (min(r, peer), max(r, peer)) if per == "pair" else "all")

    def issue(r: int, indices: range) -> None:
        for i in indices:
            post = plans[r].posts[i]
            message = (r, post.action) if post.send else (post.peer, plans[r].source_action[i])
            streams.setdefault(stream(r, post.peer), []).append((i, message, post.send, post.peer))

    def match() -> bool:
        moved = False
        for (r, _), queue in list(streams.items()):
            while queue:
                i, message, is_send, peer = queue[0]
                other = streams.get(stream(peer, r), [])
                if not other or other[0][3] != r or other[0][2] == is_send:
                    break
                if other[0][1] != message:
                    raise RuntimeError(f"a message from rank {r if is_send else peer} would reach a receive meant "
                                       "for another (NCCL matches in posting order)")
                done[r].add(i)
                done[peer].add(other[0][0])
                queue.pop(0)
                other.pop(0)
                moved = True
        return moved

    def advance(r: int) -> bool:
        plan, cursor, k = plans[r], cursors[r], position[r]
        needed = plan.receive_of.get(k)
        if needed is not None:
            issue(r, cursor.through(needed))
            issue(r, cursor.ahead())
            if needed not in done[r]:
                return False
            cursor.waited()
        if k in plan.send_of:
            issue(r, cursor.produce(plan.send_of[k]))
        issue(r, cursor.ahead())
        position[r] += 1
        return True

    progress = True
    while progress:                     # until neither an action nor a message can move
        progress = False
        for r in range(len(plans)):
            while position[r] < len(plans[r].order) and advance(r):
                progress = True
        progress = match() or progress
    stuck = {r: plans[r].order[position[r]] for r in range(len(plans)) if position[r] < len(plans[r].order)}
    if stuck or any(len(done[r]) < len(p.posts) for r, p in enumerate(plans)):
        raise RuntimeError(f"the plans deadlock under NCCL's rules (one stream per {per}): ranks wait at {stuck}, "
                           f"{sum(map(len, streams.values()))} operations never complete")
