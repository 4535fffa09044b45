"""bench/bench_moe_dispatch.py's measurement: the profile split puts known times where they belong, and at
EP=2 (tiny model, one profiled step) every backward node of an exchange lands in "exchange" and every
expert node in "experts", as many as the dispatcher issues per layer and micro-batch."""
import os
import sys
import time
from collections import Counter

import pytest
import torch

from harness import run_ranks
from megalite_test_utils import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_moe_dispatch as bench  # noqa: E402

SHAPE = bench.QUICK
MICRO_BATCHES = SHAPE.gbs // (SHAPE.mbs * 2)                 # per rank at EP = DP = 2
EXCHANGE_NODES = {"_AllToAllBackward", "_MappingBackward"}     # _Mapping: tensor/mappings.py's gather, reduce-scatter


SLEPT: dict = {}          # label -> seconds a sleep actually took (a loaded machine wakes sleepers late)


def _sleep(label: str, seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    SLEPT[label] = time.perf_counter() - start


class _Sleeps(torch.autograd.Function):
    """Identity whose forward and backward each sleep a known time, recorded under ``label``."""

    @staticmethod
    def forward(ctx, x, label: str, forward_s: float, backward_s: float):
        ctx.label, ctx.backward_s = label, backward_s
        _sleep(f"{label} forward", forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _sleep(f"{ctx.label} backward", ctx.backward_s)
        return grad, None, None, None


def test_split_profile_attributes_forward_ranges_and_backward_nodes():
    """Forward: a range's own time less its inner ranges; backward: a node's time to its forward op's range.
    The expected times are the sleeps' own measured durations, which a loaded machine stretches."""
    x = torch.ones(4, requires_grad=True)
    rf = torch.profiler.record_function
    SLEPT.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with rf(bench.STEP_RANGE):
            with rf("moe/dispatch"):
                _sleep("permutation", 0.03)
                with rf("moe/dispatch/exchange"):
                    y = _Sleeps.apply(x, "exchange", 0.02, 0.06)
                with rf("moe/experts"):
                    y = _Sleeps.apply(y, "experts", 0.01, 0.04)
            _sleep("rest", 0.05)
            y.sum().backward()
    split = bench.split_profile(prof.events())
    seconds, nodes = split.seconds, split.nodes
    expected = {"permutation": SLEPT["permutation"], "router": 0.0, "counts": 0.0,
                "exchange": SLEPT["exchange forward"] + SLEPT["exchange backward"],
                "experts": SLEPT["experts forward"] + SLEPT["experts backward"]}
    for category, value in expected.items():
        assert seconds.get(category, 0.0) == pytest.approx(value, abs=0.005), (category, seconds, SLEPT)
    others = sum(seconds.get(c, 0.0) for c in bench.CATEGORIES if c != "rest")
    assert seconds["rest"] == pytest.approx(seconds["step"] - others) and seconds["rest"] >= SLEPT["rest"]
    assert nodes[("exchange", "_SleepsBackward")] == 1 and nodes[("experts", "_SleepsBackward")] == 1
    assert split.collectives == pytest.approx([SLEPT["exchange forward"], SLEPT["exchange backward"]], abs=0.005)


def test_wait_is_each_collectives_time_less_the_least_over_ranks():
    ranks = [{"collectives": [0.1, 0.3, 0.2], "seconds": {"step": 1.0}},
             {"collectives": [0.4, 0.1, 0.2], "seconds": {"step": 2.0}}]
    assert bench.wait_shares(ranks) == pytest.approx([0.2 / 1.0, 0.3 / 2.0])


def _check_rank(result: dict, dispatcher: str) -> None:
    layer_mb = SHAPE.layers * MICRO_BATCHES
    exchange_nodes = sum(n for (category, _), n in result["nodes"].items() if category == "exchange")
    collective_ranges = {"alltoall": 3, "allgather": 2}[dispatcher]           # counts + exchanges per forward
    assert len(result["collectives"]) == collective_ranges * layer_mb + exchange_nodes
    nodes = Counter()
    for (category, name), count in result["nodes"].items():
        if name in EXCHANGE_NODES or name == "_ExpertMLPBackward":
            nodes[(category, name)] += count
    if dispatcher == "alltoall":                 # rows there and back; ETP = 1: no gather
        expected = {("exchange", "_AllToAllBackward"): 2 * layer_mb}
        ranges = 6                               # router, dispatch, counts, 2 x exchange, experts
    else:                                        # tokens and weights gathered (expert ids carry no gradient)
        expected = {("exchange", "_MappingBackward"): 3 * layer_mb}        # and the output reduce-scattered
        ranges = 5                               # router, dispatch, 2 x exchange, experts
    expected[("experts", "_ExpertMLPBackward")] = layer_mb
    assert dict(nodes) == expected
    assert result["ranges_per_step"] == ranges * layer_mb
    shares = bench.shares(result)
    assert all(shares[c] >= 0 for c in bench.CATEGORIES) and sum(shares.values()) == pytest.approx(1.0)
    assert shares["exchange"] > 0 and shares["experts"] > 0 and shares["router"] > 0
    assert (shares["counts"] > 0) == (dispatcher == "alltoall")


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_ep2_profile_splits_the_step_by_dispatcher(dispatcher):
    results = run_ranks(2, bench.profile_steps, SHAPE, dispatcher, 1, 1, 1)
    waits = bench.wait_shares(results)
    assert all(0 <= w <= bench.shares(r)["counts"] + bench.shares(r)["exchange"] for w, r in zip(waits, results))
    for result in results:
        _check_rank(result, dispatcher)
        assert len(result["step"]) == 1 and result["step"][0] > 0
