"""What QK-clip (--qk-clip) and --log-max-attention-logit need of an attention module: its per-head max
attention logit over a training step (``MaxLogits``), and which rows of which weights carry each head's
queries and keys (``QKRows``).

The max logit of head h is the largest pre-softmax score q.k x scale over the batch, its queries and the
keys the mask lets each query see (causality, documents, the window; sinks carry no key and are not
scores). The fused attention kernels do not return it, so ``max_logits`` runs a second q k^T pass, one
block of at most BLOCK x BLOCK positions at a time (never an s x s tensor), skipping the blocks the causal
rule or the window leave empty. It runs under no_grad on the detached q and k, on the training forward
only, and reads nothing on the host: the per-head maxima stay on the device and are max-accumulated over
the step's micro-batches (a recomputed forward records the same values again, which a max absorbs).

Under context parallelism a rank holds its queries' positions but attends to keys of every rank: the keys
are all-gathered over the context-parallel group first (an extra all-gather per layer when recording), so
each rank's maxima are complete for its own queries; the optimizer's all-reduce MAX over data x context
parallelism completes them. Under tensor parallelism each rank records its own heads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite.model.attention.mask import MaskSpec, Relation
from megalite.parallel.context.ring_attention import ContextParallel

BLOCK = 512                     # query and key positions per block of the max-logit pass


def _blocks(spans: list[tuple[int, int]]):
    """(first row, first position, rows) of each block of at most BLOCK rows, for a tensor whose rows are
    the runs of consecutive positions ``spans`` = [(first position, rows)] in row order."""
    row = 0
    for position, length in spans:
        for start in range(0, length, BLOCK):
            yield row + start, position + start, min(BLOCK, length - start)
        row += length


def _visible(mask: MaskSpec, q: tuple[int, int], k: tuple[int, int], batch: int, device) -> torch.Tensor | None | bool:
    """Which keys at positions [k0, k1) the queries at [q0, q1) see: False for none, None for all (no
    documents), else bool [batch or 1, q1 - q0, k1 - k0]."""
    span = mask.span_relation(q, k)
    if span == Relation.EMPTY:
        return False
    if span == Relation.FULL and mask.cu_seqlens is None:
        return None
    q_pos, k_pos = torch.arange(*q, device=device), torch.arange(*k, device=device)
    samples = range(batch) if mask.cu_seqlens is not None else range(1)
    return torch.stack([mask.visible(i, q_pos, k_pos) for i in samples])


@torch.no_grad()
def max_logits(q: torch.Tensor, k: torch.Tensor, mask: MaskSpec, scale: float, q_spans: list[tuple[int, int]],
               k_spans: list[tuple[int, int]]) -> torch.Tensor:
    """fp32 [heads]: the largest q.k x scale of each query head over the batch and the query/key pairs the
    mask lets through (-inf where none). q [s, b, heads, d], k [t, b, groups, d] (query head h uses key
    group h // (heads / groups)); ``q_spans`` / ``k_spans``: their rows' positions, as _blocks reads them."""
    b, heads, groups = q.shape[1], q.shape[2], k.shape[2]
    best = torch.full((groups, heads // groups), float("-inf"), dtype=torch.float32, device=q.device)
    for q_row, q_pos, n in _blocks(q_spans):
        q_block = q[q_row:q_row + n].float().view(n, b, groups, -1, q.shape[-1]).permute(1, 2, 3, 0, 4)
        for k_row, k_pos, m in _blocks(k_spans):
            visible = _visible(mask, (q_pos, q_pos + n), (k_pos, k_pos + m), b, q.device)
            if visible is False:
                continue
            k_block = k[k_row:k_row + m].float().permute(1, 2, 3, 0).unsqueeze(2)       # [b, groups, 1, d, m]
            scores = torch.matmul(q_block, k_block).mul_(scale)                         # [b, groups, hpg, n, m]
            if visible is not None:
                scores.masked_fill_(~visible[:, None, None], float("-inf"))
            torch.maximum(best, scores.amax(dim=(0, 3, 4)), out=best)
    return best.view(heads)


class MaxLogits:
    """The per-head max logit of one attention layer over the training step so far on this rank: ``value``,
    fp32 [local heads] on the device, or None before the step's first forward; ``take`` hands it over and
    starts the next step."""

    def __init__(self):
        self.value: torch.Tensor | None = None

    def record(self, q: torch.Tensor, k: torch.Tensor, mask: MaskSpec, scale: float,
               cp: ContextParallel | None) -> None:
        """Fold one forward's q [s, b, heads, d] against k [t, b, groups, d] into ``value``; with ``cp`` both
        are this rank's sequence chunks, and the keys of every rank are gathered first."""
        s, t = q.shape[0], k.shape[0]
        q_spans, k_spans = [(t - s, s)], [(0, t)]
        if cp is not None:
            k = k.detach().contiguous()
            gathered = k.new_empty(cp.size * t, *k.shape[1:])
            dist.all_gather_into_tensor(gathered, k, group=cp.group)
            k, q_spans = gathered, _chunk_spans(cp, cp.rank, s)
            k_spans = [span for rank in range(cp.size) for span in _chunk_spans(cp, rank, t)]
        step = max_logits(q.detach(), k.detach(), mask, scale, q_spans, k_spans)
        self.value = step if self.value is None else torch.maximum(self.value, step)

    def take(self) -> torch.Tensor | None:
        value, self.value = self.value, None
        return value


def _chunk_spans(cp: ContextParallel, rank: int, rows: int) -> list[tuple[int, int]]:
    """The (first position, rows) of each sequence chunk CP rank ``rank`` holds, ``rows`` rows in all."""
    ids = cp.chunk_ids(rank)
    size = rows // len(ids)
    return [(i * size, size) for i in ids]


@dataclass
class QKRows:
    """Where one attention layer's heads live in its weights, for QK-clip. A *unit* is what one rescale
    factor eta covers: a query group under GQA (its key is shared by the group's query heads), a head
    under MLA. ``head_unit``: long [local heads], each head's unit. ``rows``: per parameter to rescale,
    (parameter, long [rows] the unit of each row, fp32 [rows] the power of eta each row takes: alpha for
    query rows, 1 - alpha for key rows, 1 for MLA's RoPE query rows, 0 for rows left as they are).
    ``sharers``: with more TP ranks than key heads, (TP group, first TP rank, ranks) of the ranks that hold
    the other query heads of this rank's one group (and a copy of its key), whose maxima its unit's max
    takes too; None where every rank holds whole groups."""
    units: int
    head_unit: torch.Tensor
    rows: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]
    sharers: tuple | None = None


def per_head_rows(powers: list[float], sizes: list[int], units: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(unit, power) of each row of a weight laid out per unit as consecutive parts of ``sizes`` rows,
    part i taking eta^powers[i]."""
    per_unit = torch.cat([torch.full((n,), p, dtype=torch.float32) for p, n in zip(powers, sizes)])
    unit = torch.arange(units).repeat_interleave(sum(sizes))
    return unit.to(device), per_unit.repeat(units).to(device)
