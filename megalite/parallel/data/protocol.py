"""The data-parallel interface: what megalite's own DDP/ZeRO (ddp.py) and PyTorch FSDP2 (fsdp2.py) provide.

Training, the optimizer, gradient finishing (parallel/finalize_grads.py), checkpoints and the memory
report use a data-parallel backend only through ``DataParallel`` and the flat layout it exposes
(``FlatLayout``), so they never ask which backend runs.

The flat layout. Every trainable parameter of the rank's model chunks has a slot, the flat range
[start, end) of its (TP-local) elements in one virtual 1-D layout. The optimizer state, gradient
clipping and checkpoints address elements by that layout. ``buckets`` are the pieces of it whose
gradients and parameters this rank holds as 1-D tensors: ``local_range(b)`` is the range, and
``local_param_chunk(b)`` / ``local_grad_chunk(b)`` the tensors (ParamAndGradBuffer's buckets, or one
FSDP2 shard per parameter). Without optimizer sharding the whole layout is held: ``param_data`` and
``grad_data`` are then the full flat tensors (None otherwise).

The model side. A backend that gathers parameters per module unit (ZeRO-3) or waits for them per unit
asks the model for its units in forward order (``UnitSource.data_parallel_units``, GPTModel's method).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from megalite.parallel.data.materialise import LocalElements


@dataclass(frozen=True)
class ModuleUnit:
    """Modules whose parameters are gathered (ZeRO-3) or waited for together: ``module``'s forward starts
    the unit's use, ``end_module``'s forward ends it. ``reads``: parameters the unit uses that belong to
    an earlier unit (the tied output layer reads the embedding's weight). ``gather_in_backward``: False
    when the unit's backward does not read its parameters (the embedding's reads only the token ids).
    ``layer``: a transformer layer (FSDP2 shards each one on its own)."""
    name: str
    module: nn.Module
    end_module: nn.Module
    gather_in_backward: bool = True
    reads: tuple = ()
    layer: bool = False


@runtime_checkable
class UnitSource(Protocol):
    """A model that lists its module units in forward order (GPTModel)."""

    def data_parallel_units(self) -> list[ModuleUnit]: ...


class FlatLayout(Protocol):
    """The flat view of a rank's parameters and gradients (see the module docstring)."""

    param_dtype: torch.dtype        # the dtype of the parameters the optimizer updates
    compute_dtype: torch.dtype      # the dtype forward and backward run in (fp16: the loss is scaled)
    numel: int
    numel_unpadded: int
    dp_rank: int
    dp_size: int
    slots: dict                     # name -> slot with .start, .end in the flat layout
    buckets: list
    params: list
    param_data: torch.Tensor | None
    grad_data: torch.Tensor | None
    # a bucket holds rows [r0, r1) of one parameter (FSDP2's Shard(0)), not whole parameters: an update
    # rule acting on whole matrices gathers them (optim/muon_redistribute.py)
    row_shards: bool = False

    def local_range(self, bucket) -> tuple[int, int]: ...

    def local_param_chunk(self, bucket) -> torch.Tensor: ...

    def local_grad_chunk(self, bucket) -> torch.Tensor: ...

    def zero_grad(self) -> None: ...

    def param_bytes(self) -> int: ...

    def grad_bytes(self) -> int: ...

    def state_tensors(self, kind: str) -> list[torch.Tensor]: ...

    def transients(self) -> list: ...


class DataParallel(abc.ABC):
    """One rank's data-parallel backend over its model chunks.

    Per step: ``zero_grad()`` -> forward/backward over the micro-batches -> ``finish_grad_sync()`` (the
    gradients the optimizer reads then hold the gradient of the mean loss over the global batch) ->
    the optimizer step on ``buffer``'s pieces, then ``start_param_sync()``. ``close()`` at the end.

    Attributes both backends set: ``models`` (the chunks), ``named_params`` (trainable parameters,
    names prefixed ``chunk{i}.`` with several chunks), ``buffer`` (the FlatLayout), ``strategy`` (the
    sharding strategy), ``shard_optimizer`` / ``shard_grads`` / ``shard_params`` (what each rank holds
    only a part of), ``group`` / ``dp_size`` / ``dp_rank`` (the data-parallel x context-parallel group;
    group None in a plain single process) and ``num_microbatches`` (backward passes per step)."""

    models: list[nn.Module]
    named_params: list[tuple[str, nn.Parameter]]
    buffer: FlatLayout
    strategy: str
    shard_optimizer: bool
    shard_grads: bool
    shard_params: bool
    group: object
    dp_size: int
    dp_rank: int
    num_microbatches: int

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_params]

    @abc.abstractmethod
    def zero_grad(self, num_microbatches: int | None = None) -> None:
        """Zero the gradients this rank holds and reset the per-step state; the step that follows runs
        ``num_microbatches`` backward passes (None: as many as the last)."""

    @abc.abstractmethod
    def finish_grad_sync(self) -> None:
        """After the last backward: complete the reductions and divide by the data-parallel size."""

    @abc.abstractmethod
    def start_param_sync(self) -> None:
        """After the optimizer step: share the updated parameters (all-gather) where sharded."""

    @abc.abstractmethod
    def wait_for_param_gather(self) -> None:
        """Complete any parameter all-gather in flight (before reading parameters outside forward)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Wait for every collective in flight and remove the hooks (end of training)."""

    @abc.abstractmethod
    def local_elements(self) -> list[LocalElements]:
        """The elements of each storage-less (meta) parameter this rank keeps and the 1-D storage they
        land in, which materialise.py fills once at start-up; asked after it has given storage to what
        was still on the meta device."""

    @abc.abstractmethod
    def grad_views(self, param: nn.Parameter) -> list[tuple[torch.Tensor, int]]:
        """After ``finish_grad_sync``: the reduced gradient of ``param`` this rank holds, as (1-D view,
        offset of its first element in the flattened TP-local parameter); empty when none is local."""

    @torch.no_grad()
    def all_reduce_param_grads(self, selection: list[tuple[nn.Parameter, tuple | None]], group) -> None:
        """Sum over ``group`` the held gradients of the selected parameters, or of a row range
        ``(first_row, end_row)`` of each (the fix-ups of parallel/finalize_grads.py). The ranks of
        ``group`` hold the same pieces of these parameters (they share a layout), so the pieces line up."""
        all_reduce_held_grads(selection, group, self.grad_views)

    @property
    def shard_group(self):
        """The group over which the dense weights' gradients and optimizer state are split into distinct
        shards (the gradient norm sums over it): the data-parallel group, or with hybrid sharding
        (ddp.py) this rank's instance."""
        return self.group

    def average_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` (a 0-dim tensor on the device, e.g. the loss) over the data-parallel
        (x context-parallel) ranks; stays on the device, so nothing waits for it."""
        if self.group is None:
            return value
        total = value.detach().to(torch.float64).reshape(1).clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return (total / self.dp_size).reshape(())


@torch.no_grad()
def all_reduce_held_grads(selection: list[tuple[nn.Parameter, tuple | None]], group, grad_views) -> None:
    """Sum over ``group``, in one all-reduce, the pieces of the selected parameters' gradients this rank
    holds (``grad_views(param)`` -> [(view, offset in the flattened parameter)]), or of a row range
    ``(first_row, end_row)`` of each."""
    if group is None:
        return
    views = []
    for param, rows in selection:
        lo, hi = 0, param.numel()
        if rows is not None:
            row = param.numel() // param.shape[0]
            lo, hi = rows[0] * row, rows[1] * row
        for view, offset in grad_views(param):
            a, b = max(lo, offset), min(hi, offset + view.numel())
            if a < b:
                views.append(view[a - offset:b - offset])
    if not views:
        return
    flat = torch.cat(views)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for view in views:
        view.copy_(flat[offset:offset + view.numel()])
        offset += view.numel()
