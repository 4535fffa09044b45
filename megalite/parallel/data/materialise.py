"""Start-up materialisation of parameters built on the meta device: one rank's elements, from their record.

A model built with ``GPTModel(meta=True)`` has storage-less parameters whose record (``param_meta``)
carries ``init_values(start, end, device)``: the fp32 initial values of the flat elements [start, end)
of the parameter's TP-local tensor, a function of the seed, the parameter's global name and each
element's position only. The data-parallel backends decide which elements a rank keeps (its ZeRO-3
chunk of a bucket in grad_buffer.py, its FSDP2 row shard in fsdp2.py, everything otherwise) and call
``fill_initial`` for exactly those, so no rank ever builds a whole parameter it does not keep and every
layout starts from the single process's values bit for bit.
"""
from __future__ import annotations

import torch

INIT_CHUNK = 1 << 22          # elements drawn at a time: bounds the start-up temporaries


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
