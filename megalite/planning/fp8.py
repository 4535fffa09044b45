"""FP8 GEMMs (--fp8-format, --fp8-recipe) in the planner: their speed, the copies they make and the
FP8 parameter gathers (--fp8-param-gather).

Which GEMMs: the linears and experts of the transformer layers that ``ModelConfig.fp8_layer`` puts in FP8
(all of them, less those --first-last-layers-bf16 keeps out); the output head, the router, the norms and
core attention stay in the model's precision.

Speed: those GEMMs run at the FP8 tensor-core peak (``Hardware.peak_flops("fp8")``: twice the bf16 one),
and core attention at the model precision's peak: an FP8 layer's compute time is its attention share
at the model's peak plus the rest at the FP8 peak (``layer_time_factor``). Quantisation's own
element-wise passes are not counted.

Memory, as a dry run measures it (its step's peak by category; tests/unit/planning/test_plan_fp8_dry_run.py
holds the two together): the recipes (precision/fp8.py) quantise both operands of every GEMM anew, and the
linears save their inputs for backward in the model's precision (not the FP8 copy), so FP8 adds no
activation copy to what a step keeps. It adds the quantisation of the GEMM that runs, freed when it returns
(``gemm_copy_bytes``: the layer's largest GEMM, by the quantiser's own count,
precision/fp8_quant.gemm_working_bytes). With --fp8-param-gather each rank keeps an FP8 copy of its chunk
of the FP8 weights, ZeRO-1/2 the whole FP8 weights between steps (``fp8_weight_copies``), and ZeRO-3
gathers a layer's FP8 weights at a byte each (``gathered_layer_bytes``). Left out: delayed scaling's amax
histories and scales (4 bytes x 3 operands x (history length + 2) per linear), and the scales gathered
weights carry beside the bytes (blockwise: 4 bytes per 128 x 128 block). Where the two differ: the
quantisation is added to the layer's fullest backward moment (memory.layer_backward_bytes), while it runs
in fc1's backward, whose other temporaries are fewer, so the activations are high by up to the difference
(a few per cent of a step's peak on a tiny Llama, the measured FP8 increase never more than this one).

Communication: with --fp8-param-gather and a recipe whose weight scales serve W and W^T alike
(``PARAM_GATHER_RECIPES``: tensorwise, delayed, blockwise) the ZeRO-1 / ZeRO-3 parameter all-gathers move the FP8
layers' dense weights at one byte per element plus their scales (``scale_bytes``), everything else (expert
weights too) in the model's precision (``gathered_bytes``); gradients are reduced in fp32 as before.
"""
from __future__ import annotations

from megalite.config.fp8_fields import FP8_BLOCKS, PARAM_GATHER_RECIPES
from megalite.config.schema import ModelConfig
from megalite.planning.deepseek import mla_tensors
from megalite.planning.inputs import (Hardware, Layout, Workload, expert_parameters, local_attention_heads,
                                      rank_layer_numbers, token_counts)
from megalite.precision.fp8_quant import gemm_working_bytes


def scale_bytes(recipe: str, k: int) -> float:
    """Bytes of scales per FP8 element of a weight whose rows are ``k`` long: one fp32 per tensor (about
    none), per row (rowwise), per 128 x 128 block (blockwise), one E8M0 byte per 1 x 32 block (MXFP8)."""
    if recipe.startswith("rowwise"):
        return 4 / k
    if recipe == "blockwise":
        return 4 / FP8_BLOCKS["blockwise"] ** 2
    if recipe == "mxfp8":
        return 1 / FP8_BLOCKS["mxfp8"]
    return 0.0


def fp8_layer_numbers(workload: Workload, layout: Layout, pp_rank: int) -> list[int]:
    """The 1-based numbers of pipeline rank ``pp_rank``'s layers whose GEMMs run in FP8."""
    return [n for chunk in rank_layer_numbers(workload, layout, pp_rank) for n in chunk
            if workload.model.fp8_layer(n)]


def layer_gemm_weights(model: ModelConfig, tp: int, experts: tuple[int, int] | None = None) -> int:
    """Elements of one transformer layer's GEMM weights on one rank (its linears, and for an MoE layer
    (``experts`` = (EP, ETP)) its experts and shared expert; norms, biases and the router left out)."""
    h, d = model.hidden_size, model.kv_channels
    if model.multi_latent_attention:
        attention = sum(mla_tensors(model, tp)) - (h if model.add_bias_linear else 0)
        if model.qk_layernorm:
            norm = 2 if model.normalization == "LayerNorm" else 1
            attention -= norm * (model.kv_lora_rank + (model.q_lora_rank or 0))
    else:
        heads, groups = local_attention_heads(model, tp)
        attention = (heads + 2 * groups) * d * h + heads * d * h
    halves = 2 if model.gated_linear_unit else 1
    if experts is None:
        return attention + (halves + 1) * model.ffn_hidden_size // tp * h
    shared = (model.moe_shared_expert_intermediate_size or 0) // tp
    return attention + expert_parameters(model, *experts) + (halves + 1) * shared * h


def rank_fp8_weights(workload: Workload, layout: Layout, pp_rank: int) -> tuple[int, int]:
    """(dense, expert) elements of pipeline rank ``pp_rank``'s FP8 GEMM weights on one device."""
    model = workload.model
    dense = experts = 0
    for n in fp8_layer_numbers(workload, layout, pp_rank):
        if model.num_experts and model.is_moe_layer(n):
            layer = layer_gemm_weights(model, layout.tp, (layout.ep, layout.expert_tp))
            routed = expert_parameters(model, layout.ep, layout.expert_tp)
            dense, experts = dense + layer - routed, experts + routed
        else:
            dense += layer_gemm_weights(model, layout.tp)
    return dense, experts


def gathers_fp8(workload: Workload) -> bool:
    """Whether the data-parallel gathers move the FP8 layers' dense weights in FP8 (--fp8-param-gather with a
    recipe that takes a gathered weight)."""
    model = workload.model
    return bool(workload.fp8_param_gather and model.fp8_format and model.fp8_recipe in PARAM_GATHER_RECIPES)


def gathered_bytes(workload: Workload, params: int, fp8_params: int) -> float:
    """Bytes of one parameter all-gather of ``params`` elements of which ``fp8_params`` are FP8 weights:
    with --fp8-param-gather those at one byte plus their scales, the rest in the model's precision."""
    if not gathers_fp8(workload):
        return workload.dtype_bytes * params
    fp8 = fp8_params * (1 + scale_bytes(workload.model.fp8_recipe, workload.model.hidden_size))
    return workload.dtype_bytes * (params - fp8_params) + fp8


def fp8_weight_copies(workload: Workload, layout: Layout, pp_rank: int) -> float:
    """Bytes pipeline rank ``pp_rank`` keeps besides its state under --fp8-param-gather (module docstring):
    the FP8 copy of its ZeRO chunk of the FP8 dense weights, quantised for each gather, and under ZeRO-1/2
    the whole FP8 weights gathered, kept from one step to the next."""
    if not gathers_fp8(workload):
        return 0.0
    dense, _ = rank_fp8_weights(workload, layout, pp_rank)
    whole = 0.0 if layout.sharding == "optim_grads_params" else \
        dense * (1 + scale_bytes(workload.model.fp8_recipe, workload.model.hidden_size))
    return dense / layout.zero_shards + whole


def gathered_layer_bytes(workload: Workload, layout: Layout, pp_rank: int, params: int) -> float:
    """Bytes of ZeRO-3's gather of the rank's largest layer, ``params`` elements: with --fp8-param-gather its
    FP8 dense GEMM weights in FP8 (the fewest of the rank's layers' own, none where one of its layers
    is kept out of FP8), the rest in the model's precision."""
    model, numbers = workload.model, [n for chunk in rank_layer_numbers(workload, layout, pp_rank) for n in chunk]
    if not (gathers_fp8(workload) and numbers and all(model.fp8_layer(n) for n in numbers)):
        return gathered_bytes(workload, params, 0)
    fp8 = min(layer_gemm_weights(model, layout.tp, (layout.ep, layout.expert_tp))
              - expert_parameters(model, layout.ep, layout.expert_tp) if model.num_experts and model.is_moe_layer(n)
              else layer_gemm_weights(model, layout.tp) for n in numbers)
    return gathered_bytes(workload, params, fp8)


def gemm_copy_bytes(workload: Workload, layout: Layout) -> float:
    """Bytes of the FP8 quantisation of the largest GEMM of an FP8 layer on one device (module docstring):
    the MLP's fc1 (or its experts', at the mean tokens per expert) in forward (input, then weight), input
    gradient (output gradient, then weight) or weight gradient (output gradient, then input), each operand's
    working copies by precision/fp8_quant.gemm_working_bytes. A dense weight gathered in FP8 comes
    quantised."""
    if not workload.model.fp8_format:
        return 0.0
    model, h = workload.model, workload.model.hidden_size
    tokens, _ = token_counts(workload, layout)             # the tokens a linear's GEMM sees (SP gathered)
    halves = 2 if model.gated_linear_unit else 1
    if model.num_experts:
        width = halves * model.expert_ffn_hidden_size // layout.expert_tp
        tokens = tokens * model.moe_router_topk * layout.ep / model.num_experts
    else:
        width = halves * model.ffn_hidden_size // layout.tp
    weight, x, grad = width * h, tokens * h, tokens * width
    if gathers_fp8(workload) and not model.num_experts:
        weight = 0
    per_element = 1 + scale_bytes(model.fp8_recipe, h)
    return max(gemm_working_bytes(x, weight, per_element), gemm_working_bytes(grad, weight, per_element),
               gemm_working_bytes(grad, x, per_element))


def layer_time_factor(workload: Workload, hardware: Hardware, attention_share: float) -> float:
    """An FP8 layer's compute time over the same layer's in the model's precision, ``attention_share`` of
    its FLOPs being core attention (module docstring)."""
    return attention_share + (1 - attention_share) * hardware.peak_flops(workload.precision) / hardware.peak_flops("fp8")
