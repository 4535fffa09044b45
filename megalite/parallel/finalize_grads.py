"""Finishing the gradients after the last backward of a step, before the optimizer reads them.

``finalize_model_grads`` runs, in this order (Megatron-Core's ``finalize_model_grads``):

1. the data-parallel reduction (``DataParallel.finish_grad_sync``): sum over the data-parallel (x
   context-parallel) ranks, divided by their count;
2. the tensor-parallel fix-ups, gradients that are partial per TP rank and summed over TP ranks:
   - with sequence parallelism, replicated parameters (norm weights, row-parallel biases) saw only this
     rank's sequence shard (``sequence_parallel`` in their ``param_meta``);
   - with more TP ranks than KV heads, the K/V rows of the fused QKV weight are replicated across the
     ranks sharing a KV head, each of which saw only its own query heads (``replicated_rows``);
3. the word embedding under pipeline parallelism: its copies on the first and the last stage (the tied
   output layer, or the multi-token prediction depths' copy), marked ``shared_embedding``, sum their
   gradients over the embedding group, so both receive the same update;
4. the MoE routers' step: each router's tokens per expert of the step, summed over the pipeline stage's
   ranks in one all-reduce, move its expert bias (auxiliary-loss-free balancing) and are kept for the
   load statistics of the log (model/moe.py);
5. the FP8 delayed-scaling recipes' step: each one's amaxes of the step, reduced (MAX) over the stage's
   ranks (TP x CP, then DP), enter its amax history and set its scales (precision/fp8.py).

Steps 2 and 3 reduce whatever part of each gradient this rank holds after step 1 (the full gradient,
or a ZeRO / FSDP2 shard: ``DataParallel.all_reduce_param_grads``); without a data-parallel wrapper they
reduce ``param.main_grad``.
"""
from __future__ import annotations

from typing import Iterator, Protocol

import torch
import torch.distributed as dist
from torch import nn

from megalite.parallel.data.protocol import DataParallel
from megalite.parallel.mesh import ParallelState
from megalite.parallel.param_meta import param_meta
from megalite.parallel.tensor.layers import TensorParallel
from megalite.precision.fp8 import Fp8Recipe, finish_delayed_scaling_step


class ModelChunk(Protocol):
    """What the gradient finishing reads of a model chunk (model/gpt.py's GPTModel is one)."""
    tp: TensorParallel
    moe: object                  # the chunks' shared MoEContext (its ``stage_group``), or None

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def moe_routers(self) -> list: ...


def finalize_model_grads(chunks: list[ModelChunk], parallel: ParallelState, ddp: DataParallel | None = None,
                         timers=None) -> None:
    """Steps 1-5 of the module docstring for this rank's model chunks. ``timers`` (observe/clocks.py's
    Timers) times step 1 as ``all-grads-sync``."""
    if ddp is not None:
        if timers is not None:
            timers.start("all-grads-sync", level=1)
        ddp.finish_grad_sync()
        if timers is not None:
            timers.stop("all-grads-sync")
        params = ddp.params
    else:
        params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    finalize_tensor_parallel_grads(params, chunks[0].tp, ddp)
    sync_shared_embedding_grads(chunks, parallel, ddp)
    finish_router_step(chunks)
    recipe = chunks[0].tp.gemm_recipe
    if isinstance(recipe, Fp8Recipe) and recipe.name == "delayed":     # no walk over the modules otherwise
        finish_delayed_scaling_step(chunks, (parallel.group("tp_cp"), parallel.group("dp")))


@torch.no_grad()
def finish_router_step(chunks: list[ModelChunk]) -> None:
    """Step 4: every router's load of the step over the whole pipeline stage, in one all-reduce."""
    routers = [router for chunk in chunks for router in chunk.moe_routers()]
    if not routers:
        return
    loads = torch.stack([router.step_counts for router in routers])
    if chunks[0].moe.stage_group is not None:
        dist.all_reduce(loads, group=chunks[0].moe.stage_group)
    for router, load in zip(routers, loads):
        router.finish_step(load)


def finalize_tensor_parallel_grads(params: list[nn.Parameter], tp: TensorParallel,
                                   ddp: DataParallel | None = None) -> None:
    """Step 2: sum the gradients that are partial per TP rank over the TP ranks that share them."""
    if tp.size == 1:
        return
    all_reduce = ddp.all_reduce_param_grads if ddp is not None else all_reduce_main_grads
    if tp.sequence_parallel:
        all_reduce([(p, None) for p in params if param_meta(p).sequence_parallel], tp.group)
    replicated = [(p, param_meta(p).replicated_rows[:2]) for p in params if param_meta(p).replicated_rows]
    if replicated:
        all_reduce(replicated, tp.kv_replica_group)


def sync_shared_embedding_grads(chunks: list[ModelChunk], state: ParallelState,
                                ddp: DataParallel | None = None) -> None:
    """Step 3: sum the gradients of the word embedding's two copies so both receive the same update."""
    if state.pp_size == 1:
        return
    # in chunk order: the word embedding (first stage), then its copy (last stage)
    params = [p for chunk in chunks for p in chunk.parameters() if param_meta(p).shared_embedding]
    if len(params) == 2:          # zbv: the first and the last virtual stage are both on this rank
        embedding, output = (p.main_grad if ddp is None else ddp.grad_views(p)[0][0] for p in params)
        embedding.add_(output)    # full views: config/validate.py check_zero_bubble refuses sharded gradients here
        output.copy_(embedding)
        return
    all_reduce = ddp.all_reduce_param_grads if ddp is not None else all_reduce_main_grads
    all_reduce([(p, None) for p in params], state.group("embedding"))


def all_reduce_main_grads(selection: list[tuple[nn.Parameter, tuple | None]], group) -> None:
    """Sum ``param.main_grad`` (or rows ``(first, end)`` of it) over ``group``, coalesced in one call."""
    tensors = [p.main_grad if rows is None else p.main_grad[rows[0]:rows[1]] for p, rows in selection]
    if not tensors or group is None:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
