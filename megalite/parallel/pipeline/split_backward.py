"""A stage's backward split into B (input gradient) and W (weight gradients) on the autograd graph itself,
for the zero-bubble schedules (Qi et al. 2024): W fills the pipeline's idle slots.

Only B is on the critical path: the previous stage waits for the input gradient, nobody waits for the
weight gradients. Working on the graph covers every layer (tensor-parallel linears, the custom norm
functions, ring attention) without a special weight-gradient kernel:

- the *input path* is the set of graph nodes from which the stage's input is reachable; every other
  node hangs off it in a *weight branch* that ends in parameters;
- B runs autograd only towards the input (``backward(..., inputs=[x])``: the engine skips weight
  branches) and records, with a pre-hook, the gradient arriving at each input-path node that has a
  weight branch;
- W runs backward from each such node with the recorded gradient, restricted to that node's own
  parameters (``inputs=``), so nothing of B is recomputed and the gradients reach the parameters through
  autograd's own accumulation: main_grad, the bf16 accumulation hook and the data-parallel reduction
  hooks (parallel/data/ddp.py) see them exactly as after a plain backward.

A custom autograd Function with a parameter input on the input path (the tensor-parallel linears, the
experts, RMSNorm) asks the engine which of its gradients the pass wants (``input_grads_to_compute``), so B
computes no weight gradient there and W no input gradient, as the built-in ops (matmul) already do. The
GEMMs either pass runs are therefore the layers' own: B's input GEMMs and W's deferred weight GEMMs are
calls to each layer's GemmPrecision (megalite/precision/gemm.py), fused into main_grad where the weight
is marked for it, exactly as in a plain backward.

On the first stage there is no input to differentiate towards: B is empty and W is the whole backward.

Memory: the graph (activations) of a micro-batch lives until its W, not its B; the ZB-H1 order keeps at
most as many micro-batches in flight as 1F1B.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

_will_engine_execute_node = getattr(torch._C, "_will_engine_execute_node", None)   # probe: private, may be absent


def input_grads_to_compute(ctx) -> tuple[bool, ...]:
    """``ctx.needs_input_grad``, less the inputs whose gradient the running backward pass will discard.

    ``ctx.needs_input_grad`` is fixed when the forward runs; a backward restricted with ``inputs=`` needs
    fewer (B wants only the stage input's gradient, W only a layer's weight gradients). The engine discards
    a gradient whose next node it will not run, so computing it is wasted work: for the norms a pass over
    [.., h], for the sequence-parallel linear a whole matmul and its all-gather.

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


@dataclass
class WeightGradients:
    """What W needs: per weight-branch root, its recorded output gradients and its own parameters."""
    roots: list = field(default_factory=list)       # [(node, {output index: gradient}, [parameters])]
    whole: tuple | None = None                       # (output, gradient): no input, W is the whole backward


def _children(node) -> list:
    return [child for child, _ in node.next_functions if child is not None]


def _reaches(root, target) -> dict:
    """node -> whether ``target`` is reachable from it (iterative: graphs are hundreds of nodes deep)."""
    reach: dict = {}
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if node in reach:
            continue
        if expanded:
            reach[node] = node is target or any(reach[c] for c in _children(node))
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node) if c not in reach)
    return reach


def _parameters_below(nodes: list) -> list[torch.Tensor]:
    params, seen, stack = [], set(), list(nodes)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)    # probe: only AccumulateGrad nodes (a leaf tensor) have it
        if variable is not None:
            params.append(variable)
        stack.extend(_children(node))
    return params


def _record_weight_branches(output: torch.Tensor, target) -> tuple[WeightGradients, list]:
    """The input-path nodes of ``output``'s graph that have weight branches, each with a pre-hook that
    records the gradient B passes through it; returns what W needs and the hooks to remove."""
    reach = _reaches(output.grad_fn, target)
    pending, hooks, owner = WeightGradients(), [], {}
    for node, on_input_path in reach.items():
        if not on_input_path or node is target:
            continue
        params = _parameters_below([c for c in _children(node) if not reach[c]])
        if not params:
            continue
        for p in params:
            if id(p) in owner:
                raise RuntimeError("zero-bubble schedules need each parameter used once per stage; "
                                   f"a parameter of shape {tuple(p.shape)} is used twice")
            owner[id(p)] = node
        grads: dict = {}
        pending.roots.append((node, grads, params))

        def record(grad_outputs, grads=grads):
            grads.update({i: g for i, g in enumerate(grad_outputs) if g is not None})
        hooks.append(node.register_prehook(record))
    return pending, hooks


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None,
                   input_tensor: torch.Tensor | None) -> tuple[torch.Tensor | None, WeightGradients]:
    """B: the gradient of ``input_tensor`` (None on the first stage) and what W needs later."""
    if grad_output is None:
        grad_output = torch.ones_like(output)
    if input_tensor is None:
        return None, WeightGradients(whole=(output, grad_output))
    pending, hooks = _record_weight_branches(output, get_gradient_edge(input_tensor).node)
    try:
        # backward() into input_tensor.grad rather than autograd.grad(): only then can a custom backward ask
        # the engine which of its gradients are wanted (input_grads_to_compute) and skip the weights' here
        input_tensor.grad = None
        torch.autograd.backward(output, grad_output, inputs=[input_tensor], retain_graph=True)
    finally:
        for hook in hooks:
            hook.remove()
    grad_input, input_tensor.grad = input_tensor.grad, None
    return grad_input, pending


def backward_weight(pending: WeightGradients) -> None:
    """W: accumulate the parameters' gradients (into .grad / main_grad, through autograd's hooks)."""
    if pending.whole is not None:
        torch.autograd.backward(pending.whole[0], grad_tensors=pending.whole[1])
        return
    for node, grads, params in pending.roots:
        if not grads:
            continue                       # no gradient reached this node (e.g. a masked-out branch)
        edges = [GradientEdge(node, i) for i in grads]
        torch.autograd.backward(edges, grad_tensors=list(grads.values()), inputs=params)
