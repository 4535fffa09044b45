"""The fp32 master weights of the part of the flat layout one rank updates, and their weight decay.

The model's parameters live in one flat layout (parallel/data/protocol.py's FlatLayout: the
ParamAndGradBuffer, or FSDP2's shards). The part a rank updates is a list of ``Piece``s of it: the
whole buffer without ZeRO; this rank's chunk of every bucket with the distributed optimizer
(distrib_optimizer.py). Each piece gets an fp32 master copy (the model's own weights for fp32
models), which the update rule steps and ``copy_back`` writes into the model's dtype.

--decoupled-lr cuts the pieces where the input embedding and output layer begin and end, so each
piece belongs to one learning-rate group (``decoupled``). An update rule acting on whole matrices (Muon)
names the parameters (``whole``) that each become a piece of their own (``whole_names``: per piece, the
parameter it is, or None); a piece holding only part of one is refused, except whole rows of it where the
layout cuts parameters by rows (``row_shards``: FSDP2, whose rule gathers the rows, muon_redistribute.py). Weight decay is decoupled (AdamW: the
master shrinks by lr x weight_decay before the update) and skipped for biases and norm weights, as in
Megatron; ``decay_ranges`` are the decayed ranges of each piece.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megalite.optim.clip_grads import local_segments
from megalite.parallel.data.protocol import FlatLayout


@dataclass
class Piece:
    """A range [start, end) of the flat layout this rank updates, with its parameter and fp32 gradient."""
    start: int
    end: int
    param: torch.Tensor          # model dtype, 1-D view
    grad: torch.Tensor           # fp32, 1-D view


def uses_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Megatron's rule: no decay on biases and on 1-D parameters (norm weights)."""
    return not (name.endswith(".bias") or param.dim() == 1)


def is_embedding_or_output(name: str) -> bool:
    """The parameters --decoupled-lr applies to (Megatron: the input embedding and the output layer)."""
    return name.endswith(("embedding.word_embeddings.weight", "output_layer.weight"))


class MasterWeights:
    """fp32 copies of ``pieces`` (module docstring): ``pieces``, ``masters`` (one per piece),
    ``decoupled`` (per piece: in the --decoupled-lr group), ``whole_names`` and ``decay_ranges`` (per piece)."""

    def __init__(self, buffer: FlatLayout, named_params: list[tuple[str, nn.Parameter]], pieces: list[Piece],
                 split_decoupled: bool, whole: tuple[str, ...] = (), row_shards: bool = False):
        self.pieces, self.decoupled = pieces, [False] * len(pieces)
        if split_decoupled:
            self.pieces, self.decoupled = _split_pieces(pieces, _slot_ranges(
                buffer, named_params, lambda name, _: is_embedding_or_output(name)))
        self.whole_names = [None] * len(self.pieces)
        if whole:
            self._cut_whole(buffer, whole, row_shards)
        self.flat = None             # the masters' one storage, when they are not the model's own weights
        if buffer.param_dtype == torch.float32:
            self.masters = [p.param for p in self.pieces]
        else:
            self.flat, self.masters = _fp32_copies(self.pieces)
        decay = [(s, e, 1.0) for s, e in _slot_ranges(buffer, named_params, uses_weight_decay)]
        self.decay_ranges = [[(lo, hi) for lo, hi, _ in local_segments(decay, p.start, p.end)] for p in self.pieces]

    def _cut_whole(self, buffer: FlatLayout, whole: tuple[str, ...], row_shards: bool) -> None:
        """Each parameter of ``whole`` that a piece holds becomes a piece of its own (``row_shards``: a
        piece inside one is its rows, named by it)."""
        ranges = {(buffer.slots[n].start, buffer.slots[n].end): n for n in whole}
        pieces, decoupled, names = [], [], []
        for piece, flag in zip(self.pieces, self.decoupled):
            inside = None
            for (start, end), name in ranges.items():
                if row_shards and start <= piece.start and piece.end <= end:
                    inside = name
                elif start < piece.end and piece.start < end and not piece.start <= start < end <= piece.end:
                    raise ValueError(f"{name} must lie wholly in one optimizer piece: use the whole-parameter layout")
            finer, _ = _split_pieces([piece], sorted(ranges))
            pieces += finer
            decoupled += [flag] * len(finer)
            names += [inside or ranges.get((p.start, p.end)) for p in finer]
        self.pieces, self.decoupled, self.whole_names = pieces, decoupled, names

    @property
    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.pieces]

    def decay(self, group_lr: dict[bool, float], weight_decay: float) -> None:
        """Decoupled weight decay: every decayed master element times (1 - lr x weight_decay)."""
        for master, ranges, decoupled in zip(self.masters, self.decay_ranges, self.decoupled):
            shrink = 1.0 - group_lr[decoupled] * weight_decay
            for start, end in ranges:
                master[start:end].mul_(shrink)

    def copy_back(self) -> None:
        """The updated masters into the model's parameters (nothing to do for fp32 models)."""
        for master, piece in zip(self.masters, self.pieces):
            if master is not piece.param:
                piece.param.copy_(master)


def _fp32_copies(pieces: list[Piece]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One fp32 tensor holding every piece's values, and its view per piece. Filled piece by piece: a
    list of fp32 copies joined by cat would hold the master twice."""
    flat = torch.empty(sum(p.end - p.start for p in pieces), dtype=torch.float32, device=pieces[0].param.device)
    masters, offset = [], 0
    for p in pieces:
        master = flat[offset:offset + p.end - p.start]
        master.copy_(p.param.detach())
        masters.append(master)
        offset += p.end - p.start
    return flat, masters


def _slot_ranges(buffer: FlatLayout, named_params, select) -> list[tuple[int, int]]:
    """The flat ranges of the parameters ``select(name, param)`` picks, sorted, adjacent ones merged."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted((buffer.slots[n].start, buffer.slots[n].end) for n, p in named_params if select(n, p)):
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _split_pieces(pieces: list[Piece], ranges: list[tuple[int, int]]) -> tuple[list[Piece], list[bool]]:
    """Cut pieces where ``ranges`` (sorted, disjoint flat ranges) begin and end; returns the finer pieces
    and whether each lies inside ``ranges``."""
    out, inside = [], []
    for piece in pieces:
        cuts = sorted({piece.start, piece.end} | {b for r in ranges for b in r if piece.start < b < piece.end})
        for lo, hi in zip(cuts, cuts[1:]):
            a, b = lo - piece.start, hi - piece.start
            out.append(Piece(lo, hi, piece.param[a:b], piece.grad[a:b]))
            inside.append(any(s <= lo and hi <= e for s, e in ranges))
    return out, inside
