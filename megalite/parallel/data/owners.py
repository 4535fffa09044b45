"""Which data-parallel rank owns each parameter in the whole-parameter ZeRO layout
(--use-layer-wise-distributed-optimizer), and where the ranks' regions of a bucket lie.

Owners are picked over all the parameters of one shard group (dense or expert weights), greedily, the
largest first, each to the rank with the least so far (ties: the lowest rank), so each rank is within the
largest item of the mean:
- parameters with a cost (Muon's matrices: their Newton-Schulz FLOPs, optim/muon_cost.py) first, balanced
  by cost, the work the owner does for them each step;
- then the rest by size (elements), counting the elements the costed ones already gave each rank, so
  what a rank holds stays balanced too. Without costs (AdamW) every parameter is balanced by size.
How a bucket is split does not change what its collectives move (every rank takes part in each owner's
reduce and broadcast).
"""
from __future__ import annotations


def whole_param_owners(sizes: list[int], ranks: int, costs: list | None = None) -> list[int]:
    """The rank owning each parameter (module docstring); ``costs[i]`` None: balanced by size."""
    costs = costs or [None] * len(sizes)
    owner, held, work = [0] * len(sizes), [0] * ranks, [0] * ranks
    costed = [i for i in range(len(sizes)) if costs[i] is not None]
    for i in sorted(costed, key=lambda i: -costs[i]):
        owner[i] = min(range(ranks), key=lambda r: (work[r], r))
        work[owner[i]] += costs[i]
        held[owner[i]] += sizes[i]
    for i in sorted((i for i in range(len(sizes)) if costs[i] is None), key=lambda i: -sizes[i]):
        owner[i] = min(range(ranks), key=lambda r: (held[r], r))
        held[owner[i]] += sizes[i]
    return owner


def region_offsets(sizes: list[int], owner: list[int], ranks: int) -> tuple[list[int], list[int]]:
    """One bucket in the whole-parameter layout: the ranks' regions back to back in rank order, each as
    long as the parameters its rank owns (``owner``). Returns each parameter's offset in the bucket (a
    rank's parameters in their given order from its region's start) and each rank's region length."""
    share = [0] * ranks
    for size, r in zip(sizes, owner):
        share[r] += size
    filled, offsets = [sum(share[:r]) for r in range(ranks)], []
    for size, r in zip(sizes, owner):
        offsets.append(filled[r])
        filled[r] += size
    return offsets, share
