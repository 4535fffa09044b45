"""Which input gradients a custom autograd Function's backward must compute in the running backward pass.

``ctx.needs_input_grad`` is fixed when the forward runs. A backward restricted with ``inputs=`` needs
fewer: the zero-bubble schedules' B pass wants only the stage input's gradient and their W pass only a
layer's weight gradients (pipeline_parallel/zero_bubble.py). The engine discards a gradient whose next
node it will not run, so computing it is wasted work: for the norms a pass over [.., h], for the
sequence-parallel linear a whole matmul and its all-gather.
"""
from __future__ import annotations

import torch

_will_engine_execute_node = getattr(torch._C, "_will_engine_execute_node", None)   # what checkpoint.py uses


def input_grads_to_compute(ctx) -> tuple[bool, ...]:
    """``ctx.needs_input_grad``, less the inputs whose gradient this backward pass will discard.

    ``ctx.next_functions`` has an entry per tensor input only, so the Function's tensor inputs must come
    before its other arguments (true of RMSNorm's and the sequence-parallel linear's)."""
    static = ctx.needs_input_grad
    if _will_engine_execute_node is None:
        return static
    edges = ctx.next_functions
    try:
        wanted = tuple(bool(need and node is not None and _will_engine_execute_node(node))
                       for need, (node, _) in zip(static, edges))
    except RuntimeError:            # torch.autograd.grad() towards a leaf: the engine cannot say, keep all
        return static
    return wanted + tuple(static[len(edges):])
