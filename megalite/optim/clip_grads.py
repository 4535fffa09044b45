"""Gradient clipping over the global L2 norm (Megatron: coefficient max_norm / (norm + 1e-6)).

"Global" means the norm of the whole model's gradient, whatever the layout:
- tensor parallelism: a TP-sharded parameter (``tensor_model_parallel`` in its ``param_meta``) counts on
  every TP rank; a replicated one only on TP rank 0; rows that a TP-sharded parameter replicates over r
  ranks (``replicated_rows = (first_row, end_row, r)``) count 1/r on each;
- pipeline parallelism: every stage counts its own parameters; a second copy of a shared parameter
  (``shared``, e.g. the tied word embedding on the last stage) is not counted;
- ZeRO (sharded gradients): every data-parallel rank counts its own shard.
Each rank sums the squares of what it counts; the sums are all-reduced over the model-parallel group
(tp x pp) and, for sharded gradients, over the data-parallel group.

MoE expert weights (``expert`` in their ``param_meta``) are a class of their own: the expert grid's
EP x ETP ranks hold distinct pieces, replicated over the expert-data-parallel ranks, so each rank counts
its pieces in full and that sum is all-reduced over the expert model-parallel group (etp x ep x pp) and,
for sharded gradients, over the expert-data-parallel group. The norm is the square root of the classes'
summed squares (``norm_over_classes``): every element counts exactly once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel.param_meta import param_meta
from megalite.observe.clocks import waiting


class GradClipper:
    """The global gradient norm of the pieces a rank updates, and clipping by it (module docstring).

    ``norm_classes()``: [(segments per piece, groups)], the dense parameters' class then, with MoE, the
    expert weights'. ``shard_groups``: (dense, expert) groups that hold different shards of the
    gradients (ZeRO), whose shares are summed too; (None, None) when every rank holds them all."""

    def __init__(self, named_params, slots, pieces, parallel, shard_groups: tuple = (None, None)):
        self.parallel, self.shard_groups = parallel, shard_groups
        tp_rank = parallel.tp_rank if parallel is not None else 0
        self.segments = [local_segments(norm_weights(named_params, slots, tp_rank), p.start, p.end) for p in pieces]
        self.expert_segments = None
        if any(param_meta(p).expert for _, p in named_params) or \
                (parallel is not None and parallel.group("expert_mp") is not None):
            experts = expert_norm_weights(named_params, slots)
            self.expert_segments = [local_segments(experts, p.start, p.end) for p in pieces]

    def _dense_groups(self) -> list:
        """Groups over which the dense parameters' squared norm and the overflow flag are summed / maxed."""
        groups = []
        if self.parallel is not None and self.parallel.tp_size * self.parallel.pp_size > 1:
            groups.append(self.parallel.group("mp"))
        return groups + ([self.shard_groups[0]] if self.shard_groups[0] is not None else [])

    def _expert_groups(self) -> list:
        """The same for the expert weights: the expert model-parallel group, and EDP when sharded."""
        p = self.parallel
        if p is None or p.group("expert_mp") is None:
            return []
        groups = [p.group("expert_mp")] if p.ep_size * p.etp_size * p.pp_size > 1 else []
        return groups + ([self.shard_groups[1]] if self.shard_groups[1] is not None else [])

    def norm_classes(self) -> list[tuple[list, list]]:
        classes = [(self.segments, self._dense_groups())]
        if self.expert_segments is not None:
            classes.append((self.expert_segments, self._expert_groups()))
        return classes

    def groups(self) -> list:
        """Every group of every class (where the fp16 overflow flag is maxed)."""
        return [group for _, groups in self.norm_classes() for group in groups]

    def norm(self, grads: list[torch.Tensor]) -> float:
        return norm_over_classes(grads, self.norm_classes())


@torch.no_grad()
def clip_pieces(grads: list[torch.Tensor], max_norm: float, norm: float) -> None:
    if max_norm > 0.0:
        coefficient = max_norm / (norm + 1.0e-6)
        if coefficient < 1.0:
            for g in grads:
                g.mul_(coefficient)


def norm_weights(named_params, slots, tp_rank: int) -> list[tuple[int, int, float]]:
    """(start, end, weight) segments of the flat buffer layout: how much each gradient element of a dense
    parameter counts in this rank's share of the squared global norm (rules in the module docstring)."""
    segments = []
    for name, param in named_params:
        slot = slots[name]
        meta = param_meta(param)
        if meta.shared or meta.expert:
            continue
        if not meta.tensor_model_parallel:
            if tp_rank == 0:
                segments.append((slot.start, slot.end, 1.0))
            continue
        rows = meta.replicated_rows
        if not rows:
            segments.append((slot.start, slot.end, 1.0))
            continue
        first, end, replicas = rows
        row = param.numel() // param.shape[0]
        lo, hi = slot.start + first * row, slot.start + end * row
        segments += [(slot.start, lo, 1.0), (lo, hi, 1.0 / replicas), (hi, slot.end, 1.0)]
    return _merged(segments)


def expert_norm_weights(named_params, slots) -> list[tuple[int, int, float]]:
    """The segments of the expert weights: each counts in full on every rank that holds it."""
    return _merged([(slots[name].start, slots[name].end, 1.0) for name, param in named_params
                    if param_meta(param).expert])


def _merged(segments) -> list[tuple[int, int, float]]:
    merged: list[tuple[int, int, float]] = []
    for start, end, w in sorted(s for s in segments if s[1] > s[0]):
        if merged and merged[-1][1] == start and merged[-1][2] == w:
            merged[-1] = (merged[-1][0], end, w)
        else:
            merged.append((start, end, w))
    return merged


def local_segments(segments, start: int, end: int) -> list[tuple[int, int, float]]:
    """The weighted segments inside [start, end), as offsets from ``start``."""
    out = []
    for s, e, w in segments:
        lo, hi = max(s, start), min(e, end)
        if lo < hi:
            out.append((lo - start, hi - start, w))
    return out


@torch.no_grad()
def squared_norm(grads: list[torch.Tensor], segments: list[list[tuple[int, int, float]]],
                 groups: list) -> torch.Tensor:
    """The sum over ranks of sum(weight * grad^2) (a 1-element tensor): ``segments[i]`` weights ``grads[i]``;
    the per-rank sums are all-reduced over every group in ``groups``."""
    by_weight: dict[float, list[torch.Tensor]] = {}
    for g, segs in zip(grads, segments):
        for lo, hi, w in segs:
            by_weight.setdefault(w, []).append(torch.linalg.vector_norm(g[lo:hi], 2.0, dtype=torch.float32))
    # weights as Python scalars (a handful of distinct values): a weight tensor built from a list each step
    # would be a host-to-device copy, which on a GPU waits for the stream
    squared = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for w, norms in by_weight.items():
        squared = squared + torch.stack(norms).square().sum() * w
    squared = squared.reshape(1)
    with waiting():
        for group in groups:
            dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
    return squared


def global_grad_norm(grads: list[torch.Tensor], segments: list[list[tuple[int, int, float]]],
                     groups: list) -> float:
    """sqrt of ``squared_norm``: the global norm of one class of parameters."""
    return float(squared_norm(grads, segments, groups).sqrt())


def norm_over_classes(grads: list[torch.Tensor], classes: list[tuple[list, list]]) -> float:
    """The global norm over parameter classes [(segments per grad, groups)] (dense, experts): the square
    root of their summed squares, each all-reduced over its own groups (one host read)."""
    total = sum(squared_norm(grads, segments, groups) for segments, groups in classes)
    return float(total.sqrt())


@torch.no_grad()
def any_not_finite(grads: list[torch.Tensor], groups: list) -> bool:
    """True when any rank of ``groups`` holds an inf/NaN gradient (fp16 overflow check)."""
    # one flag on the device, read once (not a host read per gradient piece)
    flag = torch.zeros(1, device=grads[0].device if grads else "cpu")
    for g in grads:
        flag = torch.maximum(flag, (~torch.isfinite(g)).any().float().reshape(1))
    with waiting():
        for group in groups:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)
