"""The gradients of a pipeline rank in the order backward produces them, and the data-parallel buckets
they fill (grad_buffer.py's layout): the tensors top-down (the head, the multi-token prediction depths,
each layer from linear_fc2 to its input norm, the embedding), one Param each, and where buckets close.
The planner's data-parallel temporaries (memory.data_parallel_transients) walk them.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megalite.parallel.data.ddp import default_bucket_size
from megalite.planning.deepseek import mtp_depths, mtp_glue_tensors, needs_embedding_copy
from megalite.planning.inputs import (Layout, Workload, layer_experts, layer_tensors, moe_tensors, norm_parameters,
                                      rank_layer_numbers, stage_parameters)


def bucket_size(layout: Layout) -> float:
    """Elements of a data-parallel bucket (ddp.default_bucket_size: 40M with overlapped reduction,
    else one bucket for everything, or for each unit with ZeRO-2/3, whose buckets never span two)."""
    return default_bucket_size(layout.shards, layout.overlap_grad_reduce) or math.inf


@dataclass(frozen=True)
class Param:
    unit: int           # 0: the head, 1..: the layers top-down, then the embedding
    size: int
    own_bucket: bool = False  # a tied word embedding: a bucket of its own (grad_buffer.py, shared_embedding)
    expert: bool = False    # an MoE expert weight: buckets hold expert or dense weights, never both


def backward_tensors(workload: Workload, layout: Layout, pp_rank: int) -> list[Param]:
    """Parameters of pipeline rank ``pp_rank`` (one TP rank) in the order their gradients arrive, which
    is the reverse parameter order the gradient buffer lays out: the head (output layer, final norm;
    last stage), each layer top-down from linear_fc2 to the input norm, the embedding (first stage)."""
    model, params = workload.model, stage_parameters(workload, layout, pp_rank)
    h, tied = model.hidden_size, not model.untie_embeddings_and_output_weights
    vocab_rows = workload.padded_vocab(layout.tp) // layout.tp
    tensors = []
    if params.head:
        if model.untie_embeddings_and_output_weights or layout.pp > 1:
            tensors.append(Param(0, vocab_rows * h, own_bucket=tied))
        tensors += [Param(0, n) for n in [h] * (norm_parameters(model) // h)] + mtp_params(workload, layout)
    numbers = top_down_layers(workload, layout, pp_rank)
    layers = len(numbers)
    kinds = {experts: layer_params(model, layout.tp, experts)
             for experts in {layer_experts(model, layout, n) for n in numbers}}
    for i, number in enumerate(numbers):
        tensors += [dataclasses.replace(p, unit=1 + i) for p in kinds[layer_experts(model, layout, number)]]
    if params.embedding:
        if not model.use_rope:
            tensors.append(Param(1 + layers, model.max_position_embeddings * h))
        tensors.append(Param(1 + layers, vocab_rows * h, own_bucket=tied))
    return tensors


def layer_params(model, tp: int, experts: tuple[int, int] | None) -> list[Param]:
    """One layer's tensors top-down (unit 0), its experts' fc1 and fc2 marked: an MoE layer's tensors end
    with router, experts' fc1, fc2 and the shared expert's (moe_tensors)."""
    shared = len(moe_tensors(model, tp, *experts)) - 3 if experts else 0
    return [Param(0, n, expert=experts is not None and shared <= j < shared + 2)
            for j, n in enumerate(layer_tensors(model, tp, experts)[::-1])]


def mtp_params(workload: Workload, layout: Layout) -> list[Param]:
    """The MTP depths' parameters on the last stage, in the order their gradients arrive (with the head's):
    each depth's final norm, layer, eh_proj and input norms; the embedding copy last."""
    model, tensors = workload.model, []
    layer = layer_params(model, layout.tp, layer_experts(model, layout, model.num_layers))
    for _ in range(mtp_depths(model)):
        tensors += layer + [Param(0, n) for n in mtp_glue_tensors(model, layout.tp)]
    if needs_embedding_copy(model, layout.pp):
        tensors.append(Param(0, workload.padded_vocab(layout.tp) // layout.tp * model.hidden_size))
    return tensors


def top_down_layers(workload: Workload, layout: Layout, pp_rank: int) -> list[int]:
    """The layer numbers of pipeline rank ``pp_rank``, last first (the order backward reaches them)."""
    return [n for chunk in reversed(rank_layer_numbers(workload, layout, pp_rank)) for n in reversed(chunk)]


def buckets_of(tensors: list[Param], layout: Layout, per_unit: bool) -> list[int]:
    """The index one past each bucket's last tensor (grad_buffer.ParamAndGradBuffer._layout): a bucket
    closes once it holds ``bucket_size`` elements, before a tied embedding and after it, where expert
    weights meet dense ones, and, for ZeRO-2/3 (``per_unit``), where the unit changes."""
    limit, ends, size = bucket_size(layout), [], 0
    for i, tensor in enumerate(tensors):
        before = tensors[i - 1] if i else None
        if i and (size >= limit or tensor.own_bucket or before.own_bucket or tensor.expert != before.expert
                  or (per_unit and tensor.unit != before.unit)):
            ends.append(i)
            size = 0
        size += tensor.size
    return ends + [len(tensors)]
