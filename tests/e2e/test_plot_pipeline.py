"""tools/plot_pipeline.py's figures from recorded steps: the order replayed with the measured action times,
and the spread of identical forwards (bench/bench_pipeline.py reports both beside the measured bubble)."""
import os
import sys

import pytest

from megalite.parallel.pipeline.executor import PipelineRecord
from megalite.parallel.pipeline.orders import schedule_order

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
from plot_pipeline import forward_spread, replayed_bubble_share  # noqa: E402


def recorded(schedule: str, pp: int, m: int, chunks: int, seconds) -> list[PipelineRecord]:
    """Records as a run would leave them, back to back, each action taking ``seconds(rank, kind, n)``
    (n: how many actions of that kind the rank ran before)."""
    records = []
    for rank in range(pp):
        record, clock, count = PipelineRecord(rank), 0.0, {}
        for action in schedule_order(schedule, pp, rank, m, chunks):
            n = count[action.kind] = count.get(action.kind, -1) + 1
            duration = seconds(rank, action.kind, n)
            record.add(action.kind, action.chunk, action.microbatch, clock, clock + duration)
            clock += duration
        records.append(record)
    return records


@pytest.mark.parametrize("m", [4, 8])
def test_equal_stages_replay_to_theory(m):
    one_f_one_b = recorded("1f1b", 2, m, 1, lambda rank, kind, n: {"F": 1.0, "B": 2.0}[kind])
    assert replayed_bubble_share(one_f_one_b, "1f1b") == pytest.approx(1 / (m + 1))
    zero_bubble = recorded("zb-h1", 2, m, 1, lambda rank, kind, n: 1.0)
    assert replayed_bubble_share(zero_bubble, "zb-h1") <= 1 / (3 * m + 1) + 1e-9
    interleaved = recorded("1f1b", 2, m, 2, lambda rank, kind, n: {"F": 0.5, "B": 1.0}[kind])
    assert replayed_bubble_share(interleaved, "1f1b", vpp=2) == pytest.approx(1 / (2 * m + 1))


def test_replay_uses_each_ranks_median_time():
    """A slower last stage (the output layer and the loss) leaves a bubble beyond theory; one outlier
    action does not move the medians."""
    def seconds(rank, kind, n):
        if rank == 0 and kind == "F" and n == 3:
            return 50.0                                 # one slow forward: jitter, not the stage's cost
        return {"F": 1.0, "B": 2.0}[kind] * (1.5 if rank == 1 else 1.0)
    slow_last = recorded("1f1b", 2, 8, 1, seconds)
    # rank 1's 8 x 4.5 of work bounds the step: 1 (rank 0's first forward) + 36 + 2 (rank 0's last backward)
    span = 1 + 36 + 2
    assert replayed_bubble_share(slow_last, "1f1b") == pytest.approx(((1 - 24 / span) + (1 - 36 / span)) / 2)


def test_forward_spread_is_the_coefficient_of_variation_of_identical_forwards():
    steady = recorded("1f1b", 2, 4, 1, lambda rank, kind, n: 1.0)
    assert forward_spread(steady) == 0.0
    alternating = recorded("1f1b", 2, 4, 1, lambda rank, kind, n: (1.0 if n % 2 else 3.0) if kind == "F" else 2.0)
    assert forward_spread(alternating) == pytest.approx(0.5)         # stdev 1 over mean 2, on both ranks


def test_asynchronous_schedules_have_no_order_to_replay():
    records = recorded("1f1b", 2, 4, 1, lambda rank, kind, n: 1.0)
    assert replayed_bubble_share(records, "pipedream") is None
    assert replayed_bubble_share(records, "pipedream-2bw") is None
