"""Memory per device of a layout: the largest pipeline rank's peak, in four parts.

- weights, gradients, optimizer state: parameters on the rank x bytes per parameter of the sharding
  strategy (the ZeRO paper's 16, 4 + 12/d, 2 + 14/d, 16/d bytes with 2-byte gradients). megalite keeps
  fp32 gradients for every precision (grad_buffer.py, like Megatron's distributed optimizer), so bf16
  costs 2 + 4 + 12 = 18 B/param, 6 + 12/d with the distributed optimizer. d is DP x CP for the dense
  parameters and EDP (Layout.expert_shards) for MoE experts, which only those ranks hold alike; with
  hybrid sharding (--num-distributed-optimizer-instances K) d is one instance's share of them, d / K
  (Layout.zero_shards, expert_zero_shards).
- activations: what autograd keeps for backward, per layer and micro-batch, times the micro-batches
  a pipeline rank holds at once (1F1B: p - rank; interleaved: 2(p-1-rank) + (v-1)p + 1 model chunks),
  plus the temporaries of backward's fullest moment: through a layer's MLP (``layer_backward_bytes``)
  or, on the last stage, the loss and the output layer (``output_layer_bytes``). The per-layer sum
  follows Korthikanti et al. 2022 (34sbh + 5as^2b bytes per layer at 16 bits) term by term, adapted to
  what megalite's layers really keep (see ``layer_activation_bytes``).
- data-parallel temporaries at that same moment, counted with the weights and gradients: ZeRO-2/3's
  per-bucket gradient staging, ZeRO-3's just-in-time gathered units, gloo's collective copies
  (``data_parallel_transients``). The peak is the fullest of a step's moments (``rank_memory``).
- FP8 (--fp8-format) keeps no activation copy; backward through an FP8 layer adds the quantisation of its
  largest GEMM's operands, and --fp8-param-gather FP8 copies of the weights and FP8 gathers (fp8.py).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megalite.config.schema import ASYNC_SCHEDULES, ModelConfig
from megalite.optim.rules import RULES
from megalite.parallel.data.ddp import MAX_IN_FLIGHT, MAX_REDUCTIONS_IN_FLIGHT
from megalite.parallel.pipeline.pipedream import versions_behind
from megalite.config.pipeline_split import SplitFlags
from megalite.planning.buckets import Param, backward_tensors, buckets_of, top_down_layers
from megalite.planning.deepseek import mla_saved_elements, mtp_depth_bytes, mtp_depths
from megalite.planning.experts import moe_activation_bytes, moe_backward_bytes
from megalite.planning.fp8 import fp8_layer_numbers, fp8_weight_copies, gathered_layer_bytes, gemm_copy_bytes
from megalite.planning.muon import matrix_elements
from megalite.planning.inputs import (GPU_KERNELS, Kernels, Layout, Workload, holds_embedding, holds_head,
                                      layer_experts, layer_tensors, local_attention_heads, rank_layers,
                                      rank_moe_layers, stage_parameters, token_counts)

GRAD_BYTES = 4          # megalite accumulates and reduces gradients in fp32 at every precision (grad_buffer.py)


def state_bytes_per_parameter(param_bytes: int, sharding: str, dp: int, grad_bytes: int = GRAD_BYTES,
                              optimizer: str = "adam", matrix: bool = False) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter (the ZeRO paper's accounting).

    The update rule (--optimizer) keeps its named state tensors in fp32 (Adam: m and v, 8 B; Muon: one
    momentum, 4 B, for a ``matrix`` it steps, AdamW's two moments for the rest), plus an fp32 master copy
    unless the weights are fp32 (4 B). With
    2-byte gradients this is the ZeRO paper's 16, 4 + 12/d, 2 + 14/d, 16/d; with megalite's fp32
    gradients and bf16 weights it is Megatron's 18 and 6 + 12/d (distributed optimizer)."""
    rule = RULES[optimizer]
    state = 4 * len(rule.matrix_state_names if matrix else rule.state_names) + (0 if param_bytes == 4 else 4)
    weights_shards, grads_shards, optimizer_shards = {
        "no_shard": (1, 1, 1), "optim": (1, 1, dp), "optim_grads": (1, dp, dp),
        "optim_grads_params": (dp, dp, dp)}[sharding]
    return param_bytes / weights_shards, grad_bytes / grads_shards, state / optimizer_shards



# ---- activations ----------------------------------------------------------------------------------
def norm_saved_bytes(model: ModelConfig, elements: float, dtype_bytes: int) -> float:
    """Bytes a norm keeps for backward over ``elements`` input elements: its input (plus per-token
    statistics, not counted)."""
    return dtype_bytes * elements


def attention_saved_elements(model: ModelConfig, tp: int, tokens: int) -> float:
    """Elements SelfAttention keeps for backward for ``tokens`` tokens on one TP rank (compute dtype):
    q, the unexpanded k and v (GQA runs on grouped K/V; views of the fused QKV output only when all
    three are, else copies, so the QKV output is never kept whole beside them) and the output, which
    the output projection's input is a view of. Selective recomputation, where it applies (the math
    attention), keeps the same tensors, as the checkpoint's inputs."""
    if model.multi_latent_attention:
        return mla_saved_elements(model, tp, tokens)
    heads, groups = local_attention_heads(model, tp)
    return tokens * (2 * heads + 2 * groups) * model.kv_channels


def layer_activation_bytes(workload: Workload, layout: Layout, kernels: Kernels, moe: bool = False) -> float:
    """Bytes one transformer layer (``moe``: an MoE layer) keeps for backward for one micro-batch on one rank.

    Korthikanti et al. count, per layer at 16 bits, sbh(34 + 5as/h) bytes: layernorm inputs 4sbh;
    attention 11sbh + 5as^2b (QKV input 2, Q and K 4, V 2, projection input 2, dropout mask 1, and
    the scores: softmax 2as^2b, its dropout mask as^2b and output 2as^2b); a 4h MLP 19sbh (fc1
    input 2, GeLU input 8, fc2 input 8, dropout mask 1). What megalite's TransformerLayer keeps:

    - norms: each keeps its input [s/t, b, h] (sequence-parallel shard);
    - QKV and fc1 inputs: the [s/t, b, h] shard too (the column-parallel linear gathers the sequence
      again in backward, as Megatron);
    - attention: ``attention_saved_elements`` (no s^2 term: flash kernels) + an fp32 log-sum-exp
      per token and head; selective recomputation leaves a fused kernel alone (recomputing it would
      keep the same), so it changes the count only for the math attention (attention dropout where
      ``kernels`` has no flash dropout): there it keeps the checkpoint's q, k, v and no scores;
    - MLP: SwiGLU keeps fc1's output (2f/t) and the fc2 input (f/t), silu being recomputed in
      backward; GELU keeps fc1's output and the activation, 2f/t;
    - hidden dropout (p > 0): two 1-byte masks over [s/t, b, h];
    - an MoE layer's MLP: experts.moe_activation_bytes in place of the MLP's terms.
    Full recomputation keeps only the layer's input [s/t, b, h] (Korthikanti: 2sbh, /t with SP).
    For a GPT layer (MHA, learned positions, 4h GELU MLP) on CUDA this is Korthikanti's 34sbh/t
    without the score terms.
    """
    model, e = workload.model, workload.dtype_bytes
    math_attention = model.attention_dropout > 0 and not kernels.flash_attention_dropout
    if math_attention and layout.recompute == "none":
        raise ValueError("attention dropout on this device runs the math attention (s x s scores), which "
                         "this estimate does not model; use attention_dropout 0 or recomputation")
    tokens, sp_tokens = token_counts(workload, layout)
    h = model.hidden_size
    if layout.recompute == "full":
        return sp_tokens * h * e
    heads, _ = local_attention_heads(model, layout.tp)
    ffn = model.ffn_hidden_size // layout.tp
    norms = 2 * norm_saved_bytes(model, sp_tokens * h, e)
    linear_inputs = 2 * sp_tokens * h * e
    attention = attention_saved_elements(model, layout.tp, tokens) * e
    if not math_attention:
        attention += tokens * heads * 4                                   # log-sum-exp, fp32
    mlp = moe_activation_bytes(workload, layout) if moe else (3 if model.gated_linear_unit else 2) * tokens * ffn * e
    dropout = 2 * sp_tokens * h if model.hidden_dropout > 0 else 0
    return norms + linear_inputs + attention + mlp + dropout


def output_layer_bytes(workload: Workload, layout: Layout, kernels: Kernels) -> tuple[float, float]:
    """(kept for backward, extra at the peak) of the last stage's head for one micro-batch.

    Kept: the final norm's input, the output layer's [s/t, b, h] input (its sequence shard) and the fp32
    (log-)softmax over this rank's vocabulary shard [s, b, V/t]. Extra, the larger of two moments:

    - the loss (vocabulary-parallel, or at one TP rank the same without its all-reduces): it works in
      place but, during forward, holds the logits (compute dtype) and their fp32 copy next to the softmax;
    - the output layer's backward: the softmax has become the logits' gradient (cast to the compute
      dtype); next to it the gradient of the layer's input [s, b, h] and of its weight [V/t, h], and
      with sequence parallelism the input all-gathered again and the reduce-scattered input gradient
      (plus, on gloo, the reduce-scatter's copy of its input)."""
    model, e = workload.model, workload.dtype_bytes
    tokens, sp_tokens = token_counts(workload, layout)
    h, vocab_rows = model.hidden_size, workload.padded_vocab(layout.tp) // layout.tp
    logits = tokens * vocab_rows
    kept = norm_saved_bytes(model, sp_tokens * h, e) + sp_tokens * h * e + 4 * logits
    loss = logits * (e + (4 if e != 4 else 0))
    linear = logits * (e - 4) + tokens * h * e + vocab_rows * h * e
    if layout.sp:
        linear += tokens * h * e + sp_tokens * h * e + (tokens * h * e if kernels.collective_copies else 0)
    return kept, max(loss, linear)


def layer_backward_bytes(workload: Workload, layout: Layout, kernels: Kernels, moe: bool = False) -> float:
    """The most bytes that backward through one layer holds beyond the activations the layers keep:
    the gradient arriving at the layer's output [s/t, b, h] and the largest of three moments of its MLP
    (``moe``: of its experts, experts.moe_backward_bytes, or of its shared expert, a dense MLP of its size).

    - the activation's backward: _SwiGLUFunction.backward works in the compute dtype; next to the
      gradient of fc2's input (f/t) it holds only the gradient of fc1's output (2f/t), which each of
      its passes writes in place: 3f/t elements per token. GELU's backward holds two f/t gradients.
      fc2's input (f/t), kept for fc2, is freed by then.
    - fc2's backward: the gradient of its input next to that of its weight [h, f/t] (and with
      sequence parallelism the all-gathered output gradient [s, b, h]; gloo gathers through a copy).
    - fc1's backward: the gradient of its output, of its input ([s, b, h]) and of its weight, with fc2's
      input and fc1's output freed; with sequence parallelism also the input all-gathered again, the
      reduce-scattered input gradient and gloo's copy of the reduce-scatter's input.
    This is the largest moment of a layer's backward: attention's is smaller (no s x s scores)."""
    _, sp_tokens = token_counts(workload, layout)
    arriving = sp_tokens * workload.model.hidden_size * workload.dtype_bytes
    if not moe:
        return arriving + mlp_backward_bytes(workload, layout, kernels, workload.model.ffn_hidden_size)
    shared = workload.model.moe_shared_expert_intermediate_size or 0
    return arriving + max(moe_backward_bytes(workload, layout),
                          mlp_backward_bytes(workload, layout, kernels, shared) if shared else 0.0)


def mlp_backward_bytes(workload: Workload, layout: Layout, kernels: Kernels, ffn_hidden_size: int) -> float:
    """The fullest of a tensor-parallel MLP's three backward moments (``layer_backward_bytes``)."""
    model, e = workload.model, workload.dtype_bytes
    tokens, sp_tokens = token_counts(workload, layout)
    h, f = model.hidden_size, ffn_hidden_size // layout.tp
    fc1_out = 2 * f if model.gated_linear_unit else f
    copies = kernels.collective_copies
    if model.gated_linear_unit:
        activation = tokens * 3 * f * e
    else:
        activation = tokens * f * e
    fc2 = tokens * f * e + f * h * e + (tokens * h * e * (2 if copies else 1) if layout.sp else 0)
    fc1 = tokens * h * e + fc1_out * h * e - tokens * f * e
    if layout.sp:
        fc1 += tokens * h * e + sp_tokens * h * e + (tokens * h * e if copies else 0)
    return max(activation, fc2, fc1)


def chunks_in_flight(layout: Layout, pp_rank: int, num_microbatches: int) -> int:
    """Forward passes of (model chunk, micro-batch) whose backward has not run yet, at most, on a
    pipeline rank (orders.py): 1F1B runs p - rank - 1 warm-up forwards and one more before its
    first backward; interleaved 1F1B 2(p - rank - 1) + (v - 1)p warm-up forwards. Stage 0 thus holds
    p micro-batches of L/p layers (1F1B), L(1 + (p-1)/(pv)) layers' worth when interleaved.
    GPipe holds all m; ZB-H1, PipeDream and PipeDream-2BW hold 1F1B's; ZB-V holds 2p chunks of L/2p
    layers on every rank, 1F1B's first stage (Qi et al. 2024)."""
    if layout.pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return num_microbatches * layout.vpp
    if layout.schedule == "zbv":
        return min(2 * layout.pp, 2 * num_microbatches)
    if layout.vpp == 1:
        return min(layout.pp - pp_rank, num_microbatches)
    warmup = 2 * (layout.pp - pp_rank - 1) + (layout.vpp - 1) * layout.pp
    return min(warmup + 1, num_microbatches * layout.vpp)


def loss_chunk_in_flight(layout: Layout, num_microbatches: int) -> int:
    """Micro-batches through the last virtual stage (the loss's, and the MTP depths') whose backward has
    not run, at most, on the rank that holds it (orders.py): GPipe holds all m; every other schedule
    runs that stage's backward right after its forward - 1F1B and its zero-bubble and asynchronous forms
    have no warm-up on the last rank, interleaved 1F1B's (which runs any schedule with virtual stages
    but ZB-V) warm-up there is the other chunks' first (v - 1)p forwards, and ZB-V's rank 0 alternates
    F and B of its second chunk."""
    return num_microbatches if layout.schedule == "gpipe" and layout.vpp == 1 else 1


def kept_activations(workload: Workload, layout: Layout, pp_rank: int, kernels: Kernels) -> float:
    """Bytes pipeline rank ``pp_rank`` keeps for backward at its fullest: the layers of every
    in-flight (chunk, micro-batch), the chunk outputs the pipeline executor keeps to backpropagate
    from, the embedding dropout's noise, and on the last stage the MTP depths (deepseek.mtp_depth_bytes)
    of the micro-batches through the loss's chunk (``loss_chunk_in_flight``)."""
    model, e = workload.model, workload.dtype_bytes
    microbatches = layout.num_microbatches(workload.global_batch_size)
    in_flight = chunks_in_flight(layout, pp_rank, microbatches)
    layers_per_chunk = sum(rank_layers(workload, layout, pp_rank)) / layout.vpp     # (chunks alternate)
    moe_per_chunk = rank_moe_layers(workload, layout, pp_rank) / layout.vpp
    _, sp_tokens = token_counts(workload, layout)
    kept = in_flight * (layers_per_chunk - moe_per_chunk) * layer_activation_bytes(workload, layout, kernels)
    if moe_per_chunk:
        kept += in_flight * moe_per_chunk * layer_activation_bytes(workload, layout, kernels, moe=True)
    stashed_outputs = in_flight - 1 if holds_head(layout, pp_rank) else in_flight
    kept += stashed_outputs * sp_tokens * model.hidden_size * e if layout.pp > 1 else 0
    if holds_embedding(layout, pp_rank) and model.hidden_dropout > 0:
        kept += math.ceil(in_flight / layout.vpp) * sp_tokens * model.hidden_size * dropout_mask_bytes(kernels, e)
    if holds_head(layout, pp_rank) and mtp_depths(model):     # each depth: a layer of the last one's kind, a loss
        layer = layer_activation_bytes(workload, layout, kernels, model.is_moe_layer(model.num_layers))
        depth = mtp_depth_bytes(model, layer, output_layer_bytes(workload, layout, kernels)[0], sp_tokens, e)
        kept += loss_chunk_in_flight(layout, microbatches) * mtp_depths(model) * depth
    return kept


def dropout_mask_bytes(kernels: Kernels, dtype_bytes: int) -> int:
    return kernels.dropout_mask_bytes or dtype_bytes


# ---- data-parallel temporaries (ddp.py, grad_buffer.py) ------------------------------------------
@dataclass(frozen=True)
class Buckets:
    """The data-parallel buckets alive at one moment of backward (elements each)."""
    reducing: list          # complete, their reduce-scatter in flight (not yet finished)
    filling: list           # receiving gradients (at most one)


def buckets_at(workload: Workload, layout: Layout, pp_rank: int, arrived: int, per_unit: bool,
               previous_microbatch: bool, tensors: list[Param] | None = None) -> Buckets:
    """Buckets alive once the first ``arrived`` gradients of this micro-batch's backward are in.
    With --overlap-grad-reduce a complete bucket's reduction runs until ddp.MAX_IN_FLIGHT newer ones
    have started (ZeRO-2/3, ``per_unit``: until the next bucket is complete, MAX_REDUCTIONS_IN_FLIGHT
    + 1 alive), counting the previous micro-batch's last ones, still in flight at the top of the stage,
    when ``previous_microbatch``; without, it runs as soon as the bucket is complete.
    ``tensors``: backward_tensors' list, when the caller has it."""
    tensors = tensors or backward_tensors(workload, layout, pp_rank)
    ends = buckets_of(tensors, layout, per_unit)
    sizes = [sum(t.size for t in tensors[start:end]) for start, end in zip([0] + ends, ends)]
    complete = sum(1 for end in ends if end <= arrived)
    started = arrived > (ends[complete - 1] if complete else 0)
    filling = [sizes[complete]] if complete < len(sizes) and started else []
    if not layout.overlap_grad_reduce:
        return Buckets([], filling)
    done = (sizes if previous_microbatch else []) + sizes[:complete]
    return Buckets(done[-(MAX_REDUCTIONS_IN_FLIGHT + 1 if per_unit else MAX_IN_FLIGHT):], filling)


@dataclass(frozen=True)
class Transients:
    """Data-parallel bytes alive at one moment on top of the (sharded) state."""
    weights: float = 0.0        # gathered parameters, gloo's all-gather copies
    grads: float = 0.0          # gradient staging, reduce-scatter outputs, gloo's reduce-scatter copies

    @property
    def total(self) -> float:
        return self.weights + self.grads


def data_parallel_transients(workload: Workload, layout: Layout, pp_rank: int, kernels: Kernels,
                             moment: str, depth: int = 0, tensors: list[Param] | None = None) -> Transients:
    """What data parallelism holds at ``moment``: "layer" (backward through the MLP of the stage's
    ``depth``-th layer from the top: linear_fc2's gradients are in), "head" (the loss and the output
    layer's backward, last stage) or "step" (after the last backward, when the full gradient buffer is
    reduced, and after the optimizer step, when parameters are gathered). d data-parallel ranks, e
    bytes per parameter:

    - ZeRO-2/3 reduce every micro-batch's gradients per bucket (``buckets_at``): a full-size fp32
      staging tensor lives from the bucket's first gradient to the end of its reduce-scatter, whose
      output chunk (1/d) lives while it runs (gloo: with copies of (d-1)/d of the input). NCCL leaves a
      backward's last reduction in flight into the next micro-batch (ddp.py); gloo finishes it at the
      end of the backward pass, so its next backward starts with none.
    - ZeRO-3 gathers each unit just in time: a layer's parameters while backward runs through it, the
      head's (with tied embeddings on the same stage, the embedding's too) during the loss; with
      --overlap-param-gather the next unit of backward is prefetched, an all-gather in flight (gloo:
      through a copy of its output). The embedding is not gathered for backward.
    - no_shard / ZeRO-1 reduce the full gradient buffer in place; gloo's ZeRO-1 reduce-scatters copy
      (d-1)/d of each bucket in flight (during the last micro-batch's backward with
      --overlap-grad-reduce, else after it, MAX_IN_FLIGHT at a time). ZeRO-1/2 all-gather the updated
      parameters in place after the step (gloo: through copies of up to MAX_IN_FLIGHT buckets with
      --overlap-param-gather, one at a time without; NCCL: every bucket in flight, nothing extra).
    MoE experts' buckets (never mixed with dense weights) are counted at the dense d too; their own EDP
    group's reductions differ only in the 1/d output chunks and gloo's (d-1)/d copies.
    """
    d, e = layout.zero_shards, workload.dtype_bytes       # hybrid sharding: collectives within an instance
    if layout.shards == 1 or (moment == "step" and layout.sharding == "optim_grads_params"):
        return Transients()
    copies = kernels.collective_copies
    model, params = workload.model, stage_parameters(workload, layout, pp_rank)
    numbers = top_down_layers(workload, layout, pp_rank)
    kinds = {experts: layer_tensors(model, layout.tp, experts)
             for experts in {layer_experts(model, layout, n) for n in numbers}}
    sizes = [kinds[layer_experts(model, layout, n)] for n in numbers]
    layer = max(map(sum, sizes), default=0)
    tensors = tensors or backward_tensors(workload, layout, pp_rank)
    arrived = 0                               # gradients of this micro-batch's backward in by the moment
    if moment == "layer":
        head_tensors = sum(1 for t in tensors if t.unit == 0) if params.head else 0
        fc2_tensors = 2 if model.add_bias_linear else 1
        arrived = head_tensors + sum(len(t) for t in sizes[:depth]) + fc2_tensors
    per_unit = layout.sharding in ("optim_grads", "optim_grads_params")

    def reduce_scatter_copies(buckets) -> float:
        return sum(GRAD_BYTES * n * (d - 1) / d for n in buckets) if copies else 0.0

    if moment == "step":
        if not copies or layout.sharding == "no_shard":
            return Transients()
        ends = buckets_of(tensors, layout, per_unit)
        sizes = sorted((sum(t.size for t in tensors[a:b]) for a, b in zip([0] + ends, ends)), reverse=True)
        gathers = e * sum(sizes[:MAX_IN_FLIGHT if layout.overlap_param_gather else 1])
        reductions = reduce_scatter_copies(sizes[:MAX_IN_FLIGHT]) if layout.sharding == "optim" else 0.0
        return Transients(gathers, 0.0) if gathers >= reductions else Transients(0.0, reductions)

    if not per_unit:                # the full buffer: reductions start during the last micro-batch only
        if layout.sharding == "no_shard" or moment != "layer":
            return Transients()
        reducing = buckets_at(workload, layout, pp_rank, arrived, False, False, tensors).reducing
        return Transients(0.0, reduce_scatter_copies(reducing))

    many = layout.num_microbatches(workload.global_batch_size) > 1
    alive = buckets_at(workload, layout, pp_rank, arrived, True, many and not copies, tensors)
    grads = GRAD_BYTES * (sum(alive.filling) + sum(n * (1 + 1 / d) for n in alive.reducing))
    grads += reduce_scatter_copies(alive.reducing)
    weights = 0.0
    if layout.sharding == "optim_grads_params":
        tied_here = params.embedding and params.head and not workload.model.untie_embeddings_and_output_weights
        head = params.head + (params.embedding if tied_here else 0)
        gathered = gathered_layer_bytes(workload, layout, pp_rank, layer)          # FP8 weights at a byte
        weights = gathered if moment == "layer" else e * head
        layers_below = sum(rank_layers(workload, layout, pp_rank)) - (depth + 1 if moment == "layer" else 0)
        if layout.overlap_param_gather and layers_below > 0:
            weights += gathered * (2 if copies else 1)                          # the prefetched layer
    return Transients(weights, grads)


# ---- memory per device ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Memory:
    weights: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


def rank_memory(workload: Workload, layout: Layout, pp_rank: int, kernels: Kernels = GPU_KERNELS) -> Memory:
    """Peak bytes on one device of pipeline rank ``pp_rank`` (every TP and DP rank of a stage alike):
    the (sharded) state, plus the fullest moment of a step. Backward through a layer (recomputed
    first under full recomputation) and, on the last stage, the loss and the output layer's
    backward come with every in-flight micro-batch's kept activations; after the last backward only
    the state is left, with the data-parallel reductions and gathers (``data_parallel_transients``)."""
    weights, grads, optimizer = state_bytes(workload, layout, stage_parameters(workload, layout, pp_rank),
                                            matrix_elements(workload, layout, pp_rank))
    weights *= 1 + weight_versions(layout, pp_rank, layout.num_microbatches(workload.global_batch_size))
    weights += fp8_weight_copies(workload, layout, pp_rank)
    kept = kept_activations(workload, layout, pp_rank, kernels)
    # the rank's kinds of layer (dense, MoE): backward through the fullest, each one freed the least
    moe = rank_moe_layers(workload, layout, pp_rank)
    kinds = [kind for kind, count in ((False, sum(rank_layers(workload, layout, pp_rank)) - moe), (True, moe))
             if count]
    through_layer = max(layer_backward_bytes(workload, layout, kernels, kind)
                        + (layer_activation_bytes(workload, dataclasses.replace(layout, recompute="none"), kernels,
                                                  kind) if layout.recompute == "full" else 0.0) for kind in kinds)
    if fp8_layer_numbers(workload, layout, pp_rank):        # the FP8 copies of the running GEMM's operands
        through_layer += gemm_copy_bytes(workload, layout)
    # backward through the chunk's top layers: each one deeper has freed a layer's activations, but may
    # have more data-parallel reductions in flight (beyond MAX_IN_FLIGHT layers nothing changes)
    layers_per_chunk = max(rank_layers(workload, layout, pp_rank))
    freed = min(layer_activation_bytes(workload, layout, kernels, kind) for kind in kinds)
    tensors = backward_tensors(workload, layout, pp_rank) if layout.shards > 1 else None
    moments = [(kept - depth * freed + through_layer,
                data_parallel_transients(workload, layout, pp_rank, kernels, "layer", depth, tensors))
               for depth in range(min(layers_per_chunk, MAX_IN_FLIGHT + 1))]
    moments.append((0.0, data_parallel_transients(workload, layout, pp_rank, kernels, "step", tensors=tensors)))
    if holds_head(layout, pp_rank):
        moments.append((kept + sum(output_layer_bytes(workload, layout, kernels)),
                        data_parallel_transients(workload, layout, pp_rank, kernels, "head", tensors=tensors)))
    activations, transients = max(moments, key=lambda moment: moment[0] + moment[1].total)
    return Memory(weights + transients.weights, grads + transients.grads, optimizer, activations)


def state_bytes(workload: Workload, layout: Layout, params,
                matrices: tuple[int, int] = (0, 0)) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes of a rank's parameters (``StageParameters``): the dense
    ones sharded over DP x CP, the experts over EDP (ZeRO over the expert-data-parallel group); with
    hybrid sharding over one instance's share of them. Under Muon the (dense, expert) elements of its
    ``matrices`` (muon.matrix_elements) keep its state, the rest AdamW's; the whole-parameter layout it
    shards by gives each rank whole parameters balanced by size, counted at the mean share as the equal
    slices are."""
    dense_matrices, expert_matrices = matrices
    total = [0.0, 0.0, 0.0]
    for count, shards, matrix in ((params.dense - dense_matrices, layout.zero_shards, False),
                                  (params.experts - expert_matrices, layout.expert_zero_shards, False),
                                  (dense_matrices, layout.zero_shards, True),
                                  (expert_matrices, layout.expert_zero_shards, True)):
        if count:
            per = state_bytes_per_parameter(workload.dtype_bytes, layout.sharding, shards,
                                            optimizer=workload.optimizer, matrix=matrix)
            total = [t + count * b for t, b in zip(total, per)]
    return tuple(total)


def weight_versions(layout: Layout, pp_rank: int, num_microbatches: int) -> int:
    """Weight versions a rank keeps beyond its live weights (pipedream.py's weight stashing): PipeDream
    one per update its oldest in-flight micro-batch is behind, ceil((p - 1 - rank) / m) (p - 1 on the first
    stage at m = 1, PipeDream's original); PipeDream-2BW one. Counted in the compute dtype."""
    if layout.pp == 1 or layout.schedule not in ASYNC_SCHEDULES:
        return 0
    return versions_behind(layout.schedule, layout.pp, pp_rank, num_microbatches)


def state_memory(workload: Workload, layout: Layout) -> float:
    """The largest pipeline rank's (sharded) weights, gradients and optimizer state: a lower bound of
    ``estimate_memory``'s total, cheap to compute."""
    return max(sum(state_bytes(workload, layout, stage_parameters(workload, layout, r),
                               matrix_elements(workload, layout, r))) for r in memory_ranks(workload, layout))


def estimate_memory(workload: Workload, layout: Layout, kernels: Kernels = GPU_KERNELS) -> Memory:
    """The device that needs the most: the largest of the pipeline ranks."""
    return max((rank_memory(workload, layout, r, kernels) for r in memory_ranks(workload, layout)),
               key=lambda m: m.total)


def memory_ranks(workload: Workload, layout: Layout) -> set[int]:
    """The pipeline ranks that can need the most: ``outer_ranks``, or every rank of a model with dense and
    MoE layers, whose stages can hold different numbers of MoE layers (--moe-layer-freq)."""
    mixed = workload.model.num_experts and workload.model.moe_layer_freq != 1
    return set(range(layout.pp)) if mixed else outer_ranks(layout)


def outer_ranks(layout: Layout) -> set[int]:
    """The pipeline ranks that can need the most: with even stages the first (most micro-batches in
    flight, the embeddings) and the last (the output layer and the logits), the ranks between hold
    less; with uneven stages or a V placement, any of them."""
    if layout.split != SplitFlags() or layout.schedule == "zbv":
        return set(range(layout.pp))
    return {0, layout.pp - 1}


