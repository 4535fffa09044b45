"""Which ranks hold the other parts of a GEMM's operands, so that an FP8 recipe's scales are those of the
single-process run whatever the layout.

A linear y = x W^T has three axes: ``tokens``, ``in`` and ``out``; its GEMMs' operands [M, K] are

    forward      x [tokens, in]     W   [out, in]
    grad_input   g [tokens, out]    W^T [in, out]
    grad_weight  g^T [out, tokens]  x^T [in, tokens]

A tensor-parallel weight is cut along one axis (``split``: ``out`` for a column-parallel linear, ``in`` for
a row-parallel one), and so are the activations and gradients along that axis: a row-parallel input is
[tokens, in / t], a column-parallel output gradient [tokens, out / t]. Sequence parallelism cuts no GEMM
operand of a tensor-parallel linear (the column-parallel input is gathered first, the row-parallel output
gradient too); it cuts ``tokens`` of a linear replicated on the TP ranks that runs on each rank's own
sequence shard (multi-latent attention's down projections). Context parallelism cuts ``tokens``: each CP
rank holds other positions of the same sequences.

A recipe scales in blocks (fp8_quant.py). Where an axis is cut across ranks and one scaling block spans
that axis whole (a block at least the local extent times the ranks: tensorwise always, rowwise along K,
a 1 x 128 tile over fewer than 128 tokens), each rank sees only part of the block, so the block amaxes
are reduced (MAX) over those ranks before the scales are taken: the quantised values are then serial's. A
block that tiles the local extent exactly (the block recipes' widths per TP rank, which the validation
requires to be whole blocks) is whole on each rank and needs nothing.

Data-parallel ranks hold other micro-batches, which the single process quantises one at a time with
their own amaxes: current scaling reduces nothing over them. Nor over expert parallelism: an expert's
weight lives whole on one EP rank, and its rows of each micro-batch are scaled as a tensor of their own
(fp8.py), whichever ranks sent them. Expert tensor parallelism cuts each expert's hidden width like a
tensor-parallel linear (model/moe.py passes its own axes and the ETP group). Delayed scaling reduces its
step's amaxes over every rank of the stage instead (fp8.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

TOKENS, IN, OUT = "tokens", "in", "out"
FORWARD_AXES = ((TOKENS, IN), (OUT, IN))
GRAD_INPUT_AXES = ((TOKENS, OUT), (IN, OUT))
GRAD_WEIGHT_AXES = ((OUT, TOKENS), (IN, TOKENS))


@dataclass(frozen=True)
class GemmLayout:
    """A linear's place in the layout (module docstring): ``weight_group`` of ``weight_ranks`` ranks cuts its
    weight along ``split``; the ``token_groups`` ((group, ranks), ...) hold the other tokens."""
    weight_group: object = None
    weight_ranks: int = 1
    split: str | None = None
    token_groups: tuple = ()

    def cut(self, axis: str) -> tuple[tuple, int]:
        """(groups, ranks in all) that cut ``axis`` across ranks; ((), 1) where it is whole here."""
        if axis == TOKENS:
            return tuple(group for group, _ in self.token_groups), math.prod(ranks for _, ranks in self.token_groups)
        if axis == self.split and self.weight_group is not None:
            return (self.weight_group,), self.weight_ranks
        return (), 1

    def amax_reduction(self, shape: tuple, block: tuple[int, int], axes: tuple[str, str] | None) -> Callable | None:
        """What reduces the block amaxes of an operand of local ``shape`` [M, K] along ``axes``, cut into
        ``block``s: a MAX over each group that cuts an axis one block spans whole (None: nothing to reduce).
        Every rank of a group takes the same branch, so the collectives come in the same order on each."""
        if axes is None:
            return None
        groups = []
        for extent, size, axis in zip(shape, block, axes):
            cut_by, ranks = self.cut(axis)
            if cut_by and size >= extent * ranks:
                groups += cut_by
        if not groups:
            return None

        def reduce(amax: torch.Tensor) -> torch.Tensor:
            for group in groups:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
            return amax
        return reduce


SERIAL = GemmLayout()
