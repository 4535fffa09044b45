"""What megalite records about a parameter beyond its tensor: one typed record per parameter.

The tensor-parallel layers record the shard layout, the model records the norm weights, the tied
embedding and the initial values, the data-parallel buffer records gradient-accumulation fusion; the
optimizer, gradient clipping, the gradient fix-ups, initialisation and checkpoints read the record.
``mark(param, field=value, ...)`` sets fields (the record travels with the parameter: a materialised
or sharded replacement copies the parameter's attributes); ``param_meta(param)`` reads it, and a
parameter nobody marked (a plain ``nn.Parameter``) reads as ``ParamMeta()``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

_ATTRIBUTE = "megalite_meta"


@dataclass(frozen=True)
class ParamMeta:
    """One parameter's layout and role.

    - ``full_shape``: the unsharded tensor's shape (None: the parameter's own shape);
    - ``take_shard(full) -> local``: this TP rank's part of a full tensor; ``partition_dim``: the dimension
      the shard selects along (0: whole rows, 1: a block of columns);
    - ``tensor_model_parallel``: the parameter is sharded over TP (it counts on every TP rank in the norm);
    - ``sequence_parallel``: replicated over TP, but its gradient is partial per rank under sequence
      parallelism (summed over TP after backward);
    - ``replicated_rows``: (first_row, end_row, replicas): rows of a TP-sharded weight held identically
      by ``replicas`` TP ranks (K/V rows when TP exceeds the KV heads), summed over those ranks;
    - ``shared_embedding``: the tied word embedding's copy on the first or last pipeline stage (their
      gradients are summed over the embedding group); ``shared``: the second copy (counted once in norms
      and checkpoints);
    - ``is_norm_weight`` / ``norm_init_value``: a norm's weight and the value initialisation fills it with;
    - ``init_values(start, end)``: initial elements [start, end) of a storage-less (meta) parameter;
    - ``fuse_wgrad_into_main_grad``: the matmul adds this weight's gradient into its main_grad;
    - ``expert``: an MoE expert weight, split over the expert grid (EP whole experts, ETP within each)
      and replicated over the expert-data-parallel ranks, not the dense data-parallel ones; its
      ``take_shard`` selects rows and ``take_cols`` (when set) columns of the full tensor viewed 2-D.
    """
    full_shape: tuple | None = None
    take_shard: Callable | None = None
    partition_dim: int = 0
    tensor_model_parallel: bool = False
    sequence_parallel: bool = False
    replicated_rows: tuple | None = None
    shared_embedding: bool = False
    shared: bool = False
    is_norm_weight: bool = False
    norm_init_value: float = 1.0
    init_values: Callable | None = None
    fuse_wgrad_into_main_grad: bool = False
    expert: bool = False
    take_cols: Callable | None = None


_PLAIN = ParamMeta()


def param_meta(param: torch.Tensor) -> ParamMeta:
    """The parameter's record; ``ParamMeta()`` for a parameter nobody marked."""
    return param.__dict__.get(_ATTRIBUTE, _PLAIN)


def mark(param: torch.Tensor, **fields) -> torch.Tensor:
    """Set ``fields`` of the parameter's record (the others keep their values); returns the parameter."""
    setattr(param, _ATTRIBUTE, dataclasses.replace(param_meta(param), **fields))
    return param


def full_shape(param: torch.Tensor) -> tuple:
    """The shape of the unsharded tensor ``param`` is a TP shard of (its own shape when unsharded)."""
    shape = param_meta(param).full_shape
    return tuple(param.shape) if shape is None else shape
