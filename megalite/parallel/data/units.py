"""What the data-parallel wrapper tracks per module unit (ddp.py): the model's ModuleUnits in forward
order with their parameters, buckets and neighbours, and the tensors a hook can attach to."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from megalite.parallel.data.protocol import UnitSource


@dataclass(eq=False)
class Unit:
    """A model's ModuleUnit with what ddp tracks for it: its parameters, the buckets holding any of them,
    its neighbours in forward order, and whether backward is inside it."""
    name: str
    module: nn.Module
    end_module: nn.Module
    params: list = field(default_factory=list)
    buckets: list = field(default_factory=list)
    gather_in_backward: bool = True
    reads: tuple = ()
    next: "Unit | None" = None
    prev: "Unit | None" = None
    in_backward: bool = False


def model_units(model: nn.Module, prefix: str = "") -> list[Unit]:
    """The model's units in forward order (``data_parallel_units``); any other module is one unit."""
    listed = model.data_parallel_units() if isinstance(model, UnitSource) else []
    units = [Unit(prefix + u.name, u.module, u.end_module, gather_in_backward=u.gather_in_backward, reads=u.reads)
             for u in listed] or [Unit(prefix + "model", model, model)]
    for a, b in zip(units, units[1:]):
        a.next, b.prev = b, a
    return units


def tensors_in(output) -> list[torch.Tensor]:
    """The tensors in a module's output (nested lists, tuples and dicts)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in tensors_in(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in tensors_in(item)]
    return []
