"""ZeRO's overlap on NCCL's path (Comm.holds_temporaries, parallel/data/bucket_comm.py), under the
NCCL-semantics tier on 2 ranks, against gloo's path in the same ranks (the tier's switch,
MEGALITE_FORCE_NCCL_COLLECTIVE_PATH, picks the path).

ZeRO-1/2/3 with --overlap-grad-reduce --overlap-param-gather train to the same losses on both paths,
and to the single process's. The recorded order of each bucket collective's issue and wait (the ranges
``bucket_comm.traced`` names in a profile) against the units' forward passes is NCCL's: no parameter
all-gather is issued or waited on between the optimizer step and the next forward; each is waited on in
the forward pre-hook of the first unit that uses its bucket; a backward's last ZeRO-2/3 reduce-scatter
is still in flight when the next micro-batch's forward starts. gloo's path keeps its bounds, which the
same records show: all but MAX_IN_FLIGHT gathers waited on at the step, reductions at backward's end.
"""
from __future__ import annotations

import contextlib
import os

import pytest

from dp_workloads import batches, layout_flags, train_losses
from harness import run_ranks

ENV = "MEGALITE_FORCE_NCCL_COLLECTIVE_PATH"
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
STEPS = 3


@contextlib.contextmanager
def recording(events: list):
    """Record the name of every bucket collective's issue and wait ("param all-gather bucket 2", "wait
    reduce-scatter bucket 0") as ``bucket_comm.traced`` opens its profiler range."""
    from megalite.parallel.data import bucket_comm, ddp
    original = bucket_comm.traced

    def traced(what, bucket):
        events.append((what, bucket.index))
        return original(what, bucket)
    bucket_comm.traced = ddp.traced = traced
    try:
        yield
    finally:
        bucket_comm.traced = ddp.traced = original


def run_path(world: int, strategy: str, nccl_path: bool) -> dict:
    """STEPS steps on one path: the losses, and the events in order, with ("forward", unit) when a unit's
    forward starts (before the data-parallel pre-hooks) and ("step", n) before each step."""
    from megalite.train.command_line import parse_args
    from megalite.train.step import train_step
    from megalite.train.trainer import build_trainer
    os.environ[ENV] = "1" if nccl_path else "0"
    trainer = build_trainer(parse_args(layout_flags(strategy, True), world_size=world))
    ddp, events, losses = trainer.ddp, [], []
    for i, unit in enumerate(ddp.units):
        unit.module.register_forward_pre_hook(lambda module, args, i=i: events.append(("forward", i)), prepend=True)
    data = batches(trainer, STEPS)
    with recording(events):
        for n in range(STEPS):
            events.append(("step", n))
            losses.append(float(train_step(trainer, data)[0]))
        ddp.wait_for_param_gather()
    return {"losses": losses, "events": events, "holds_temporaries": ddp.comm.holds_temporaries,
            "unit_buckets": [[b.index for b in u.buckets] for u in ddp.units],
            "microbatches": trainer.config.num_microbatches}


def both_paths(rank: int, world: int) -> dict:
    return {(s, nccl): run_path(world, s, nccl) for s in STRATEGIES for nccl in (True, False)}


@pytest.fixture(scope="module")
def runs():
    serial = train_losses(layout_flags("no_shard", False), 1, STEPS)["losses"]
    return serial, run_ranks(2, both_paths, nccl=True)


def step_events(r: dict, n: int) -> list:
    """The events of step n: from its ("step", n) marker to the next step's."""
    events = r["events"]
    return events[events.index(("step", n)):events.index(("step", n + 1))]


def segments(events: list) -> list[list]:
    """``events`` cut at each ("forward", i) marker: [the events before the first forward, then each
    forward's marker followed by what ran until the next]."""
    out = [[]]
    for event in events:
        if event[0] == "forward":
            out.append([])
        out[-1].append(event)
    return out


def test_both_paths_train_as_one_process(runs):
    serial, ranks = runs
    for rank, result in enumerate(ranks):
        for strategy in STRATEGIES:
            nccl, gloo = result[(strategy, True)], result[(strategy, False)]
            assert (nccl["holds_temporaries"], gloo["holds_temporaries"]) == (False, True)
            assert nccl["losses"] == gloo["losses"], f"rank {rank} {strategy}: the paths trained differently"
            assert nccl["losses"] == pytest.approx(serial, rel=1e-5), f"rank {rank} {strategy}"


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_nccl_waits_for_each_parameter_gather_in_the_forward_that_needs_it(runs, strategy):
    """The gathers the first step's optimizer started, as the second step's forward meets them."""
    for result in runs[1]:
        r, gloo = result[(strategy, True)], result[(strategy, False)]
        buckets = sorted({b for unit in r["unit_buckets"] for b in unit})
        # from the last micro-batch's forward of step 0 (its backward, the optimizer step) to step 1's forward
        at_step = segments(step_events(r, 0))[-1] + segments(step_events(r, 1))[0]
        assert not [e for e in at_step if "param all-gather" in e[0]], "a gather issued or waited at the step"
        parts = segments(step_events(r, 1))[1:]
        issued = [b for what, b in parts[0] if what == "param all-gather"]
        assert sorted(issued) == buckets, "all issued in the first forward pre-hook"
        waited = set()
        for part in parts:
            (_, unit), needed = part[0], r["unit_buckets"][part[0][1]]
            here = {b for what, b in part if what == "wait param all-gather"}
            assert here == set(needed) - waited, f"unit {unit} waited on {here}, needs {needed}"
            waited |= here
        assert waited == set(buckets)
        at_step = segments(step_events(gloo, 0))[-1] + segments(step_events(gloo, 1))[0]
        assert sorted(b for what, b in at_step if what == "param all-gather") == buckets
        assert len([b for what, b in at_step if what == "wait param all-gather"]) == len(buckets) - 2, \
            "gloo's path waits on all but MAX_IN_FLIGHT at the step"


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_nccl_leaves_the_last_reduction_of_a_backward_in_flight_into_the_next_forward(runs, strategy):
    for result in runs[1]:
        for nccl in (True, False):
            r = result[(strategy, nccl)]
            events = step_events(r, 1)
            starts = [i for i, e in enumerate(events) if e == ("forward", 0)]
            assert len(starts) == r["microbatches"] == 4
            for start in starts[1:]:
                last = max(i for i, (what, _) in enumerate(events[:start]) if what == "reduce-scatter")
                bucket = events[last][1]
                waited = events.index(("wait reduce-scatter", bucket), last)
                assert (waited > start) is nccl, (strategy, nccl, events[last:waited + 1])


# ---- a bucket of one parameter larger than the bucket size: reduced in pieces --------------------------
PIECE_BUCKET = 4000        # elements: the embedding and output layer (200 x 64) each exceed it


def pieces_run(rank: int, world: int) -> dict:
    """ZeRO-2/3 with a bucket size below the largest parameters, on both paths: losses, and the most
    staging elements any piecewise reduction held at once; then the same with every bucket reduced whole
    (the same layout), whose losses the pieces must reproduce bit for bit."""
    from megalite.parallel.data import bucket_comm, ddp
    from megalite.train.command_line import parse_args
    from megalite.train.step import train_step
    from megalite.train.trainer import build_trainer
    out = {}
    for strategy in ("optim_grads", "optim_grads_params"):
        for nccl, whole in ((True, False), (False, False), (True, True)):
            os.environ[ENV] = "1" if nccl else "0"
            if whole:
                ddp.grad_reduction = lambda b, chunk, comm, size: bucket_comm.GradReduction(b, chunk, comm)
            try:
                trainer = build_trainer(parse_args(layout_flags(strategy, True, bucket_size=PIECE_BUCKET),
                                                   world_size=world))
            finally:
                ddp.grad_reduction = bucket_comm.grad_reduction
            data = batches(trainer, STEPS)
            losses = [float(train_step(trainer, data)[0]) for _ in range(STEPS)]
            trainer.ddp.wait_for_param_gather()
            pieces = [r for r in trainer.ddp._reductions.values() if isinstance(r, bucket_comm.PiecewiseReduction)]
            out[(strategy, nccl, whole)] = {"losses": losses, "pieces": len(pieces),
                                            "staged": max((r.staged_peak for r in pieces), default=0),
                                            "largest": max(b.numel for b in trainer.ddp.buckets)}
    return out


@pytest.fixture(scope="module")
def pieces():
    return run_ranks(2, pieces_run, nccl=True)


def test_a_parameter_larger_than_the_bucket_is_reduced_in_bounded_pieces_bit_identically(runs, pieces):
    serial = runs[0]
    for rank, result in enumerate(pieces):
        for strategy in ("optim_grads", "optim_grads_params"):
            what = f"rank {rank} {strategy}"
            whole = result[(strategy, True, True)]
            assert whole["pieces"] == 0 and whole["largest"] > PIECE_BUCKET, what
            for nccl in (True, False):
                r = result[(strategy, nccl, False)]
                assert r["pieces"] >= 2, what          # the embedding, the output layer, the MLP weights
                assert 0 < r["staged"] <= PIECE_BUCKET, what           # not the 12,800-element bucket
                assert r["losses"] == whole["losses"], f"{what} nccl={nccl}: pieces changed the sums"
            assert whole["losses"] == pytest.approx(serial, rel=1e-5), what
