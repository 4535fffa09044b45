"""Start-up materialisation of parameters built on the meta device: the one place and moment it happens.

A model built with ``GPTModel(meta=True)`` has storage-less parameters whose record (``param_meta``)
carries ``init_values(start, end, device)``: the fp32 initial values of the flat elements [start, end)
of the parameter's TP-local tensor, a function of the seed, the parameter's global name and each
element's position only.

A data-parallel backend only states its layout: which elements of each parameter this rank keeps and
the 1-D storage they land in (``LocalElements``): its ZeRO chunk of a bucket (ddp.py's buffer, equal
slices or whole parameters), its FSDP2 row shard (fsdp2.py), every element without sharding.
``materialise`` runs once over the rank's model chunks, after the backend is built and before training
uses it: it gives storage to what is still on the meta device (FSDP2's shards, this rank's only),
moves buffers built for real (rotary tables) to the device with their values, and fills each stated
range from ``init_values``, a bounded chunk at a time. So no rank ever builds a whole parameter it
does not keep, and every layout starts from the single process's values bit for bit. On the meta
device itself (a dry run without storage) nothing is filled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from megalite.parallel.param_meta import mark, param_meta

INIT_CHUNK = 1 << 22          # elements drawn at a time: bounds the start-up temporaries


@dataclass(frozen=True, eq=False)
class LocalElements:
    """Elements [start, end) of ``param``'s flattened TP-local tensor that this rank keeps, and the 1-D
    storage they land in (``target``, end - start elements). ``param``'s record gives their values."""
    param: nn.Parameter
    start: int
    end: int
    target: torch.Tensor


class StatesElements(Protocol):
    """A layout that says where this rank keeps which elements. Asked after ``materialise`` has given
    storage to what was still on the meta device, since FSDP2's shards exist only then."""

    def local_elements(self) -> list[LocalElements]: ...


@torch.no_grad()
def materialise(models: list[nn.Module], layout: StatesElements, device: torch.device) -> None:
    """Give the rank's model chunks their storage on ``device`` and fill every element ``layout`` keeps
    with its initial value (module docstring). Afterwards no parameter's record keeps ``init_values``."""
    for model in models:
        _allocate(model, device)
    elements = layout.local_elements()
    for piece in elements:
        fill_initial(piece.target, param_meta(piece.param).init_values, piece.start, piece.end)
    for param in [piece.param for piece in elements] + [p for m in models for p in m.parameters()]:
        mark(param, init_values=None)      # filled once, here: a later read would be a second start-up


def _allocate(model: nn.Module, device: torch.device) -> None:
    """Uninitialised storage on ``device`` for parameters still on the meta device (``to_empty``; under
    FSDP2 each is this rank's shard); tensors with storage (buffers built for real, parameters a backend
    placed) move to ``device`` keeping their values. Records are kept: a tensor ``to_empty`` or ``to``
    swaps in carries none."""
    records = {name: param_meta(p) for name, p in model.named_parameters()}
    meta = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if meta and device.type != "meta":
        if len(meta) != len(records):      # to_empty would drop the values of the others
            raise ValueError(f"parameters {meta[:3]}... are on the meta device beside parameters with storage")
        kept = {name: b for name, b in model.named_buffers() if b.device.type != "meta"}
        model.to_empty(device=device)
        for name, b in kept.items():
            owner, _, key = name.rpartition(".")
            model.get_submodule(owner)._buffers[key] = b.to(device)
    else:
        model.to(device)
    for name, param in model.named_parameters():
        mark(param, **vars(records[name]))


@torch.no_grad()
def fill_initial(target: torch.Tensor, init_values, start: int, end: int) -> None:
    """target (1-D, end - start elements) <- initial values [start, end) of one parameter, drawn on the
    target's device a bounded chunk at a time. A target without storage (on the meta device)
    takes no values."""
    if target.device.type == "meta":
        return
    if init_values is None:
        raise ValueError("a parameter on the meta device needs init_values(start, end) to be materialised")
    for lo in range(start, end, INIT_CHUNK):
        hi = min(end, lo + INIT_CHUNK)
        target[lo - start:hi - start].copy_(init_values(lo, hi, device=target.device))
