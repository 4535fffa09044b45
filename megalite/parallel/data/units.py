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


def collect_units(models: list[nn.Module]) -> tuple[list, list, list[Unit]]:
    """Named trainable parameters of ``models`` (names prefixed ``chunk{i}.`` when several), each one's unit
    index (the unit that owns it: a tied output weight belongs to the embedding, the head only uses it),
    and the units in forward order."""
    named, unit_of, units = [], [], []
    for c, model in enumerate(models):
        prefix = f"chunk{c}." if len(models) > 1 else ""
        chain = model_units(model, prefix)
        owner = {}
        for index, unit in enumerate(chain):
            for param in unit.module.parameters():
                owner.setdefault(id(param), index)
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            index = owner.get(id(param), len(chain) - 1)
            chain[index].params.append(param)
            named.append((prefix + name, param))
            unit_of.append(len(units) + index)
        for unit in chain:                               # tied: the head reads the embedding's weight
            unit.params += [p for p in unit.reads if all(p is not q for q in unit.params)]
        units += chain
    return named, unit_of, units


def swap_replacements(models: list[nn.Module], units: list[Unit], named: list, new: dict) -> list:
    """Put the buffer's parameters with storage (``new``: id(meta parameter) -> parameter) in place of the
    meta ones, in the modules, the units and ``named`` (returned)."""
    if not new:
        return named
    for model in models:
        for module in model.modules():
            for key, param in list(module._parameters.items()):
                if param is not None and id(param) in new:
                    module._parameters[key] = new[id(param)]
    for unit in units:
        unit.params = [new.get(id(p), p) for p in unit.params]
    return [(n, new.get(id(p), p)) for n, p in named]


def tensors_in(output) -> list[torch.Tensor]:
    """The tensors in a module's output (nested lists, tuples and dicts)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in tensors_in(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in tensors_in(item)]
    return []
