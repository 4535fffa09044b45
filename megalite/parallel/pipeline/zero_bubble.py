"""Zero-bubble pipelining (Qi et al. 2024): a stage's backward split into B (input gradient) and W
(weight gradients), so W can fill the pipeline's idle slots.

Only B is on the critical path: the previous stage waits for the input gradient, nobody waits for the
weight gradients. The split works on the autograd graph itself, so every layer (tensor-parallel
linears, the custom norm functions, ring attention) is covered without a special weight-gradient
kernel:

- the *input path* is the set of graph nodes from which the stage's input is reachable; every other
  node hangs off it in a *weight branch* that ends in parameters;
- B runs autograd only towards the input (``backward(..., inputs=[x])``: the engine skips
  weight branches) and records, with a pre-hook, the gradient arriving at each input-path node that
  has a weight branch;
- W runs backward from each such node with the recorded gradient, restricted to that node's own
  parameters (``inputs=``), so nothing of B is recomputed and the gradients reach the parameters
  through autograd's own accumulation: main_grad, the bf16 accumulation hook and the data-parallel
  reduction hooks (distributed/ddp.py) see them exactly as after a plain backward.

A custom autograd function with a parameter input on the input path (sequence-parallel linear, RMSNorm)
asks the engine which of its gradients the pass wants (autograd_outputs.py), so B computes no weight
gradient there and W no input gradient, as the built-in ops (matmul) already do.

On the first stage there is no input to differentiate towards: B is empty and W is the whole backward.

Memory: the graph (activations) of a micro-batch lives until its W, not its B; the ZB-H1 order keeps
at most as many micro-batches in flight as 1F1B (Qi et al.: "the same peak memory as 1F1B").
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from megalite.config.schema import ZERO_BUBBLE_SCHEDULES
from megalite.errors import UserError



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
        variable = getattr(node, "variable", None)       # AccumulateGrad: a leaf tensor
        if variable is not None:
            params.append(variable)
        stack.extend(_children(node))
    return params


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None,
                   input_tensor: torch.Tensor | None) -> tuple[torch.Tensor | None, WeightGradients]:
    """B: the gradient of ``input_tensor`` (None on the first stage) and what W needs later."""
    if grad_output is None:
        grad_output = torch.ones_like(output)
    if input_tensor is None:
        return None, WeightGradients(whole=(output, grad_output))
    target = get_gradient_edge(input_tensor).node
    reach = _reaches(output.grad_fn, target)
    pending = WeightGradients()
    hooks = []
    owner: dict = {}
    for node, on_input_path in reach.items():
        if not on_input_path or node is target:
            continue
        branches = [c for c in _children(node) if not reach[c]]
        params = _parameters_below(branches)
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
    try:
        # backward() into input_tensor.grad rather than autograd.grad(): only then can a custom backward ask
        # the engine which of its gradients are wanted (autograd_outputs.py) and skip the weights' here
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


# ---- configuration ---------------------------------------------------------------------------------
def check_zero_bubble(parallel, model, dp_size: int = 1) -> None:
    """One-line UserErrors for combinations the zero-bubble schedules do not support."""
    schedule = parallel.pipeline_schedule
    if schedule not in ZERO_BUBBLE_SCHEDULES:
        return
    flag = f"--pipeline-schedule {schedule}"
    if parallel.pipeline_model_parallel_size < 2:
        raise UserError(f"{flag} needs --pipeline-model-parallel-size > 1")
    if getattr(parallel, "data_parallel_sharding_strategy", "no_shard") == "optim_grads_params":
        raise UserError(f"{flag} does not compose with ZeRO-3 (--data-parallel-sharding-strategy optim_grads_params): "
                        "its weight-gradient pass runs after ZeRO-3 has freed the layer's gathered parameters; "
                        "use optim_grads")
    if getattr(parallel, "use_torch_fsdp2", False):
        raise UserError(f"{flag} does not compose with --use-torch-fsdp2: FSDP2 reduces a layer's gradients when its "
                        "input gradient is done, before the deferred weight-gradient pass")
    if getattr(model, "recompute_granularity", None) == "full":
        raise UserError(f"{flag} does not compose with --recompute-granularity full: the deferred weight-gradient "
                        "pass would recompute each layer's forward a second time; use selective or none")
    given = [name for name, value in (
        ("--num-layers-per-virtual-pipeline-stage", getattr(parallel, "num_layers_per_virtual_pipeline_stage", None)),
        ("--num-virtual-stages-per-pipeline-rank", getattr(parallel, "num_virtual_stages_per_pipeline_rank", None)))
        if value is not None]
    if schedule == "zb-h1" and given:
        raise UserError(f"{flag} runs one model chunk per rank; drop {given[0]} (or use --pipeline-schedule zbv, "
                        "two chunks per rank)")
    if schedule == "zbv":
        if getattr(parallel, "num_layers_per_virtual_pipeline_stage", None) is not None:
            raise UserError(f"{flag} places two chunks per rank itself; drop --num-layers-per-virtual-pipeline-stage")
        vpp = getattr(parallel, "num_virtual_stages_per_pipeline_rank", None)
        if vpp not in (None, 2):
            raise UserError(f"{flag} needs two chunks per rank, not --num-virtual-stages-per-pipeline-rank {vpp}")
        strategy = getattr(parallel, "data_parallel_sharding_strategy", None) or "no_shard"   # None: not given
        sharded = dp_size > 1 and (getattr(parallel, "use_distributed_optimizer", False) or strategy != "no_shard")
        if sharded and not getattr(model, "untie_embeddings_and_output_weights", True):
            raise UserError(f"{flag} keeps both copies of the tied embedding on rank 0 and sums their gradients there, "
                            "which gradients sharded over data-parallel ranks (--use-distributed-optimizer / ZeRO) do not allow; add "
                            "--untie-embeddings-and-output-weights")
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            if getattr(parallel, name, None) is not None:
                raise UserError(f"{flag} puts the first and last virtual stages on rank 0; give per-stage layer "
                                f"counts with --pipeline-model-parallel-layout instead of --{name.replace('_', '-')}")


def schedule_split(split, schedule: str):
    """The split flags a schedule implies: zbv builds two chunks per rank (SplitFlags from stages.py)."""
    if schedule == "zbv" and split.virtual_stages_per_rank is None and split.layout is None:
        return replace(split, virtual_stages_per_rank=2)
    return split
