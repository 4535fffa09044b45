"""Where the parts a rank holds sit in a checkpoint's stored tensors.

A checkpoint stores every tensor at its full shape under its global name; a rank holds flat ranges of
TP-local parameters (its slots of the flat parameter buffer, its optimizer's pieces). ``shard_positions``
maps a TP-local parameter's rows and columns to the full tensor's (viewed 2-D), without building anything
full-size. A flat range of the local parameter is then a few rectangles ("boxes") of the full tensor: per
run of local rows that are consecutive full rows (fused QKV / SwiGLU shards have several runs), a partial
first row, a block of whole rows and a partial last row. Each box is one stored piece (sharded.py writes
them and reads them back). The vocabulary is stored at the tokenizer's true size: padding rows are
neither written nor read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megalite.checkpoint.files import Box
from megalite.parallel.param_meta import full_shape, param_meta
from megalite.parallel.tensor.layers import shard_positions

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass
class ParamEntry:
    buffer_name: str      # the parameter's key in the flat buffer ("chunk1.decoder.layers.0..." with virtual stages)
    global_name: str      # its name in the whole model, as stored
    param: nn.Parameter
    stored_here: bool     # False for the tied output-layer copy of the word embeddings (stored once)


def param_entries(chunks: list[nn.Module]) -> list[ParamEntry]:
    entries = []
    for c, chunk in enumerate(chunks):
        prefix = f"chunk{c}." if len(chunks) > 1 else ""
        for name, param in chunk.named_parameters():
            if param.requires_grad:
                entries.append(ParamEntry(prefix + name, chunk.global_name(name), param,
                                          not param_meta(param).shared))
    return entries


def stored_shape(global_name: str, shape: tuple, vocab_size: int) -> tuple:
    """The vocabulary is stored at the tokenizer's true size (its padding depends on the TP size)."""
    if global_name in VOCAB_PARAMS and vocab_size > 0:
        return (vocab_size, *shape[1:])
    return tuple(shape)


def pad_vocabulary(full: torch.Tensor, global_name: str, padded_shape: tuple) -> torch.Tensor:
    if global_name in VOCAB_PARAMS and full.shape[0] < padded_shape[0]:
        padding = full.new_zeros(padded_shape[0] - full.shape[0], *full.shape[1:])
        return torch.cat([full, padding])
    return full


@dataclass
class Placement:
    """Where a TP-local parameter (viewed 2-D) sits in its stored tensor (viewed 2-D)."""
    runs: list[tuple[int, int, int]]   # (first local row, end local row, its first full row): consecutive rows
    col0: int                          # local columns are full columns [col0, col0 + width)
    width: int
    stored_rows: int                   # full rows from here on are vocabulary padding, not stored


def placement(param: nn.Parameter, global_name: str, vocab_size: int) -> Placement:
    rows, cols, _ = shard_positions(param)
    col0, width = int(cols[0]), len(cols)
    if not torch.equal(cols, torch.arange(col0, col0 + width)):
        raise ValueError(f"{global_name}: a TP shard must hold one block of columns")
    breaks = (torch.nonzero(rows[1:] != rows[:-1] + 1).flatten() + 1).tolist()
    runs = [(i0, i1, int(rows[i0])) for i0, i1 in zip([0] + breaks, breaks + [len(rows)])]
    return Placement(runs, col0, width, stored_shape(global_name, full_shape(param), vocab_size)[0])


def boxes(place: Placement, lo: int, hi: int) -> list[tuple[int, Box]]:
    """The local flat range [lo, hi) as (local flat offset of the box's first element, box) pairs.
    Within a box, local element offset + i * width + j is stored element (r0 + i, c0 + j): a box is
    either part of one row or whole rows."""
    out, w = [], place.width
    for i0, i1, first_row in place.runs:
        s, e = max(lo, i0 * w), min(hi, i1 * w)
        while s < e:
            i, j = divmod(s, w)
            row = first_row + i - i0
            if j == 0 and e - s >= w:                 # whole rows
                n = (e - s) // w * w
                box = (row, row + n // w, place.col0, place.col0 + w)
            else:                                     # the part of one row in the range
                n = min(w - j, e - s)
                box = (row, row + 1, place.col0 + j, place.col0 + j + n)
            r1 = min(box[1], place.stored_rows)       # drop vocabulary padding
            if box[0] < r1:
                out.append((s, (box[0], r1, box[2], box[3])))
            s += n
    return out


def box_view(flat: torch.Tensor, start: int, box: Box) -> torch.Tensor:
    """The box's elements, which begin at ``flat[start]``, as a 2-D view [rows, columns]."""
    r0, r1, c0, c1 = box
    return flat[start:start + (r1 - r0) * (c1 - c0)].view(r1 - r0, c1 - c0)


def overlap(start: int, end: int, other_start: int, other_end: int) -> tuple[int, int]:
    return max(start, other_start), min(end, other_end)


def optimizer_ranges(optimizer, slot):
    """(start, end, piece, master, named state, cut) for each of the optimizer's pieces (state.py's
    ShardedOptimizer) overlapping the flat range of ``slot``: [start, end) in the flat layout, ``cut`` the
    same range within the piece."""
    for piece, master in zip(optimizer.pieces, optimizer.master_pieces):
        start, end = overlap(slot.start, slot.end, piece.start, piece.end)
        if start < end:
            cut = slice(start - piece.start, end - piece.start)
            yield start, end, piece, master, optimizer.named_state(master), cut


def held_params(buffer, start: int, end: int) -> list[tuple[int, int, torch.Tensor]]:
    """The parts of the flat range [start, end) whose parameter values this rank holds, as (start,
    end, values): all of it, or under ZeRO-3 its chunks of the buckets."""
    if buffer.param_data is not None:
        return [(start, end, buffer.param_data[start:end])]
    parts = []
    for bucket in buffer.buckets:
        chunk_start, chunk_end = buffer.local_range(bucket)
        lo, hi = overlap(start, end, chunk_start, chunk_end)
        if lo < hi:
            parts.append((lo, hi, buffer.local_param_chunk(bucket)[lo - chunk_start:hi - chunk_start]))
    return parts

