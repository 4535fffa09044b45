"""Muon on FSDP2's row shards (optim/muon_redistribute.py), the parts that need no process group: a shard's
runs of rows in logical matrices, and the all-to-all sizes every rank derives on its own (what one rank sends
a peer is what the peer expects from it). tests/distributed/test_muon_parallel.py runs it against serial."""
import pytest
import torch

from megalite.optim.muon_matrices import Matrix
from megalite.optim.muon_redistribute import Redistribution, row_shard


def test_a_row_shard_keeps_its_rows_runs_and_ratios():
    whole = Matrix("w", (10, 4), (10, 4), blocks=[], row_runs=[(0, 6, 1.0), (6, 10, 2.0)])
    assert row_shard(whole, 4, 8).row_runs == [(0, 2, 1.0), (2, 4, 2.0)]
    assert row_shard(whole, 4, 8).local_shape == (4, 4)
    assert row_shard(whole, 6, 10).row_runs == [(0, 4, 2.0)]
    assert row_shard(whole, 10, 10).row_runs == [] and row_shard(whole, 10, 10).local_shape == (0, 4)


@pytest.mark.parametrize("owners, counts", [
    ([1, 0, 1], [[4, 2], [3, 3], [0, 5]]),
    ([2, 0, 1, 0], [[4, 4, 2], [3, 3, 3], [6, 0, 0], [1, 1, 1]]),
])
def test_every_send_size_is_the_receivers_expectation(owners, counts):
    ranks = len(counts[0])
    matrices = [Matrix(f"m{k}", (sum(c), 1), (sum(c), 1), [], []) for k, c in enumerate(counts)]
    plans = [Redistribution(matrices, owners, counts, None, r, ranks, torch.device("cpu")) for r in range(ranks)]
    for r in range(ranks):
        for p in range(ranks):
            assert plans[r].sends[p] == plans[p].receives[r], (r, p)
        assert plans[r].owned == [k for k, o in enumerate(owners) if o == r]
        assert sum(plans[r].sends) == sum(c[r] for c in counts)                     # all its rows go out
        assert sum(plans[r].receives) == sum(sum(counts[k]) for k in plans[r].owned)  # whole owned matrices
