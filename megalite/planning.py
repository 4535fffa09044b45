"""Parallel-layout planning: memory per device and step time of a TP x PP x DP layout, and a search.

``tools/plan_parallelism.py`` is the command line; everything here is a pure function of a model
(``ModelConfig``), a workload (sequence length, global batch, precision), a layout and the hardware.

Memory per device (the largest pipeline rank), in four parts:

- weights, gradients, optimizer state: parameters on the rank x bytes per parameter of the sharding
  strategy (REFERENCE §6, ZeRO paper). megalite keeps fp32 gradients for every precision
  (grad_buffer.py, like Megatron's distributed optimizer), so bf16 costs 2 + 4 + 12 = 18 B/param,
  6 + 12/d with the distributed optimizer.
- activations: what autograd keeps for backward, per layer and micro-batch, times the micro-batches
  a pipeline rank holds at once (1F1B: p - rank; interleaved: 2(p-1-rank) + (v-1)p + 1 model chunks),
  plus the output layer's logits on the last stage and the largest temporary of backward. The
  per-layer sum follows Korthikanti et al. 2022 (REFERENCE §6: 34sbh + 5as^2b bytes, 16-bit) term by
  term, adapted to what megalite's layers really keep (see ``layer_activation_bytes``).

Step time: hardware FLOPs (model FLOPs of logging.flops_per_iteration, plus recomputation) over
peak x an efficiency, plus the pipeline bubble (p-1)/(v*m), plus tensor-, pipeline- and
data-parallel traffic (ring formulas of REFERENCE §6) over the NVLink / InfiniBand bandwidth.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Iterator

from megalite.arguments import default_ffn_hidden_size, padded_vocab_size
from megalite.config import MegaliteConfig, ModelConfig
from megalite.errors import UserError
from megalite.logging import flops_per_iteration
from megalite.model.transformer import check_attention_split
from megalite.pipeline_parallel.stages import check_pipeline_split

GiB = 2 ** 30
RECOMPUTE = ("none", "selective", "full")
SHARDING = ("no_shard", "optim", "optim_grads", "optim_grads_params")
PARAM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GRAD_BYTES = 4          # megalite accumulates and reduces gradients in fp32 at every precision (grad_buffer.py)


# ==================================================================================================
# Inputs
# ==================================================================================================
@dataclass(frozen=True)
class Workload:
    model: ModelConfig          # architecture; seq_length is the training sequence, vocab_size the true vocabulary
    global_batch_size: int
    precision: str = "bf16"     # "bf16", "fp16" or "fp32"
    make_vocab_size_divisible_by: int = 128

    @property
    def dtype_bytes(self) -> int:
        return PARAM_BYTES[self.precision]

    def padded_vocab(self, tp: int) -> int:
        return padded_vocab_size(self.model.vocab_size, self.make_vocab_size_divisible_by, tp)


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1                     # model chunks per pipeline rank (interleaved 1F1B when > 1)
    micro_batch_size: int = 1
    recompute: str = "none"          # none | selective | full (uniform, one layer per checkpoint)
    sharding: str = "no_shard"       # no_shard | optim (ZeRO-1) | optim_grads (ZeRO-2) | optim_grads_params (ZeRO-3)
    sequence_parallel: bool = True   # only meaningful with tp > 1

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    def num_microbatches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.micro_batch_size * self.dp)

    def describe(self) -> str:
        vpp = f" VPP={self.vpp}" if self.vpp > 1 else ""
        return (f"TP={self.tp} PP={self.pp}{vpp} DP={self.dp} MBS={self.micro_batch_size} "
                f"recompute={self.recompute} sharding={self.sharding}")


@dataclass(frozen=True)
class Hardware:
    """Defaults: H100 SXM nodes of 8 GPUs. NVLink 4 moves 450 GB/s per direction, NCCL reaches about
    360 GB/s of it; a 400 Gb/s NDR InfiniBand port per GPU is 50 GB/s, about 40 GB/s achieved.
    Peak dense TFLOP/s: 989 bf16/fp16, 67 fp32 (no TF32). ``compute_efficiency`` is the share of peak
    that the matmul-heavy compute reaches (communication and the bubble are counted separately);
    ``usable_memory_fraction`` leaves room for the CUDA context, NCCL buffers and fragmentation."""
    num_gpus: int
    gpu_memory_gb: float
    gpus_per_node: int = 8
    peak_tflops: float | None = None        # None: by precision, as above
    compute_efficiency: float = 0.55
    intra_node_gbps: float = 360.0          # GB/s per GPU over NVLink
    inter_node_gbps: float = 40.0           # GB/s per GPU over InfiniBand
    usable_memory_fraction: float = 0.9

    def peak_flops(self, precision: str) -> float:
        tflops = self.peak_tflops or (67.0 if precision == "fp32" else 989.0)
        return tflops * 1e12

    @property
    def usable_bytes(self) -> float:
        return self.gpu_memory_gb * GiB * self.usable_memory_fraction


@dataclass(frozen=True)
class Kernels:
    """What torch's kernels keep for backward where CUDA and CPU builds differ (the formulas are for
    CUDA; tests measure on CPU).

    - RMSNorm: CUDA runs one fused kernel that keeps its input (and an fp32 1/rms per token); on CPU
      F.rms_norm is composed of elementwise ops that keep the input upcast to fp32 and the fp32
      normalised tensor, 8 bytes per element at any precision. LayerNorm is fused on both.
    - dropout: CUDA's native_dropout keeps a 1-byte mask; CPU keeps a noise tensor in the compute dtype.
    - attention: scaled_dot_product_attention runs a flash kernel that keeps q, k, v, the output and
      the log-sum-exp, never the s x s scores (CUDA with or without dropout; CPU only without
      attention dropout, so CPU estimates require --attention-dropout 0).
    """
    fused_rms_norm: bool = True
    dropout_mask_bytes: int | None = 1      # None: the compute dtype's size
    flash_attention_dropout: bool = True


GPU_KERNELS = Kernels()
CPU_KERNELS = Kernels(fused_rms_norm=False, dropout_mask_bytes=None, flash_attention_dropout=False)


# ==================================================================================================
# Parameters
# ==================================================================================================
def local_attention_heads(model: ModelConfig, tp: int) -> tuple[int, int]:
    """(query heads, KV groups) on one TP rank; with more TP ranks than KV heads each rank keeps a
    replica of its group's K and V (SelfAttention)."""
    return model.num_attention_heads // tp, max(1, model.num_query_groups // tp)


def layer_parameters(model: ModelConfig, tp: int) -> int:
    """Parameters of one transformer layer on one TP rank (TransformerLayer)."""
    h, d = model.hidden_size, model.kv_channels
    heads, groups = local_attention_heads(model, tp)
    ffn = model.ffn_hidden_size // tp
    qkv_rows = (heads + 2 * groups) * d
    count = qkv_rows * h + heads * d * h                            # linear_qkv, linear_proj
    count += (2 * ffn if model.swiglu else ffn) * h + ffn * h        # linear_fc1, linear_fc2
    if model.add_bias_linear or model.add_qkv_bias:
        count += qkv_rows
    if model.add_bias_linear:
        count += h + (2 * ffn if model.swiglu else ffn) + h          # proj and fc2 biases are replicated
    count += 2 * norm_parameters(model)
    return count


def norm_parameters(model: ModelConfig) -> int:
    return model.hidden_size * (2 if model.normalization == "LayerNorm" else 1)


@dataclass(frozen=True)
class StageParameters:
    layers: int            # parameters in this rank's transformer layers
    embedding: int         # word (+ position) embeddings, on the first stage
    head: int              # final norm + output layer, on the last stage
    largest: int           # the largest single tensor (its gradient is a backward temporary)

    @property
    def total(self) -> int:
        return self.layers + self.embedding + self.head


def stage_parameters(workload: Workload, layout: Layout, pp_rank: int) -> StageParameters:
    """Parameters on pipeline rank ``pp_rank`` of one TP rank (build_model_chunks / GPTModel): its
    L/p layers, the embeddings on the first stage, and on the last the final norm plus the output
    layer, which tied embeddings still need as a copy when the first stage is another rank."""
    model, tp = workload.model, layout.tp
    vocab_rows = workload.padded_vocab(tp) // tp
    h = model.hidden_size
    layers = model.num_layers // layout.pp * layer_parameters(model, tp)
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    embedding = 0
    if first:
        embedding = vocab_rows * h + (0 if model.use_rope else model.max_position_embeddings * h)
    head = 0
    if last:
        head = norm_parameters(model)
        if model.untie_embeddings_and_output_weights or not first:
            head += vocab_rows * h
    ffn = model.ffn_hidden_size // tp
    largest = max(vocab_rows * h if first or last else 0, (2 * ffn if model.swiglu else ffn) * h)
    return StageParameters(layers, embedding, head, largest)


def count_parameters(workload: Workload) -> int:
    """Parameters of the whole model as one process builds it (padded vocabulary at TP=1)."""
    return stage_parameters(workload, Layout(), 0).total


def state_bytes_per_parameter(param_bytes: int, sharding: str, dp: int,
                              grad_bytes: int = GRAD_BYTES) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter (REFERENCE §6, ZeRO paper).

    Adam keeps m and v in fp32 (8 B) plus an fp32 master copy unless the weights are fp32 (4 B). With
    2-byte gradients this is the ZeRO paper's 16, 4 + 12/d, 2 + 14/d, 16/d; with megalite's fp32
    gradients and bf16 weights it is Megatron's 18 and 6 + 12/d (distributed optimizer)."""
    optimizer = 8 + (0 if param_bytes == 4 else 4)
    weights_shards, grads_shards, optimizer_shards = {
        "no_shard": (1, 1, 1), "optim": (1, 1, dp), "optim_grads": (1, dp, dp),
        "optim_grads_params": (dp, dp, dp)}[sharding]
    return param_bytes / weights_shards, grad_bytes / grads_shards, optimizer / optimizer_shards


# ==================================================================================================
# Activations
# ==================================================================================================
def norm_saved_bytes(model: ModelConfig, elements: float, dtype_bytes: int, kernels: Kernels) -> float:
    """Bytes a norm keeps for backward over ``elements`` input elements: its input in the compute
    dtype (fused kernels), or 8 bytes per element for CPU's composite RMSNorm (Kernels)."""
    if model.normalization == "RMSNorm" and not kernels.fused_rms_norm:
        return 8 * elements
    return dtype_bytes * elements


def attention_saved_elements(model: ModelConfig, tp: int, tokens: int, recompute: str) -> float:
    """Elements SelfAttention keeps for backward for ``tokens`` tokens on one TP rank (compute dtype).

    The fused QKV output is split into views; q is copied out (a reshape across KV groups) unless
    there is one query head per group; RoPE makes new q and k; with GQA, k and v are repeated to
    every query head before the flash kernel, which keeps q, k, v and its output (the output
    projection's input is a view of it). A view keeps the whole QKV output alive. Selective
    recomputation keeps the checkpoint's inputs instead (q, k, v before the repeat) and the output.
    """
    heads, groups = local_attention_heads(model, tp)
    d = model.kv_channels
    q = tokens * heads * d
    k_before_repeat = tokens * groups * d
    qkv_output = tokens * (heads + 2 * groups) * d
    repeated = heads != groups
    q_is_new_tensor = model.use_rope or repeated
    if recompute == "selective":
        return (qkv_output + (q if q_is_new_tensor else 0)                  # v (and q, k) are views of it
                + (k_before_repeat if model.use_rope else 0) + q)           # + the checkpoint's output
    if repeated:
        return 3 * q + q                                # q, repeated k and v, output
    k_new = k_before_repeat if model.use_rope else 0
    return (q if q_is_new_tensor else 0) + k_new + qkv_output + q           # v is a view of the QKV output


def layer_activation_bytes(workload: Workload, layout: Layout, kernels: Kernels) -> float:
    """Bytes one transformer layer keeps for backward for one micro-batch on one TP rank.

    Korthikanti et al. count, per layer at 16 bits, sbh(34 + 5as/h) bytes: layernorm inputs 4sbh;
    attention 11sbh + 5as^2b (QKV input 2, Q and K 4, V 2, projection input 2, dropout mask 1, and
    the scores: softmax 2as^2b, its dropout mask as^2b and output 2as^2b); a 4h MLP 19sbh (fc1
    input 2, GeLU input 8, fc2 input 8, dropout mask 1). What megalite's TransformerLayer keeps:

    - norms: each keeps its input [s/t, b, h] (sequence-parallel shard) - see ``norm_saved_bytes``;
    - QKV and fc1 inputs: the *all-gathered* [s, b, h] tensor: ColumnParallelLinear gathers the
      sequence before F.linear, which saves what it is given (Megatron keeps the s/t shard and
      gathers again in backward; megalite does not, so these two terms are not divided by t);
    - attention: ``attention_saved_elements`` (no s^2 term: flash kernels) + an fp32 log-sum-exp
      per token and head;
    - MLP: SwiGLU keeps fc1's output (2f/t), silu(gate) (f/t) and the product (f/t), i.e. 4f/t; GELU
      keeps fc1's output and the activation, 2f/t;
    - hidden dropout (p > 0): two masks over [s/t, b, h].
    Full recomputation keeps only the layer's input [s/t, b, h] (Korthikanti: 2sbh, /t with SP).
    For a GPT layer (MHA, learned positions, 4h GELU MLP) on CUDA this is Korthikanti's 34sbh without
    the score terms, plus 4sbh(1 - 1/t) for the gathered inputs under sequence parallelism.
    """
    model, e = workload.model, workload.dtype_bytes
    if model.attention_dropout > 0 and not kernels.flash_attention_dropout and layout.recompute != "full":
        raise ValueError("attention dropout on this device runs the math attention (s x s scores), which "
                         "this estimate does not model; use attention_dropout 0")
    tokens = model.seq_length * layout.micro_batch_size
    sp_tokens = tokens // layout.tp if layout.sp else tokens
    h = model.hidden_size
    if layout.recompute == "full":
        return sp_tokens * h * e
    heads, _ = local_attention_heads(model, layout.tp)
    ffn = model.ffn_hidden_size // layout.tp
    norms = 2 * norm_saved_bytes(model, sp_tokens * h, e, kernels)
    linear_inputs = 2 * tokens * h * e
    attention = attention_saved_elements(model, layout.tp, tokens, layout.recompute) * e
    if layout.recompute != "selective":
        attention += tokens * heads * 4                                   # log-sum-exp, fp32
    mlp = (4 if model.swiglu else 2) * tokens * ffn * e
    dropout = 2 * sp_tokens * h * dropout_mask_bytes(kernels, e) if model.hidden_dropout > 0 else 0
    return norms + linear_inputs + attention + mlp + dropout


def dropout_mask_bytes(kernels: Kernels, dtype_bytes: int) -> int:
    return kernels.dropout_mask_bytes or dtype_bytes


def output_layer_bytes(workload: Workload, layout: Layout, kernels: Kernels) -> tuple[float, float]:
    """(kept for backward, extra at the peak) of the last stage's head for one micro-batch.

    Kept: the final norm's input, the output layer's gathered [s, b, h] input and the fp32
    (log-)softmax over this rank's vocabulary shard [s, b, V/t]. Extra, on top: with one TP rank
    F.cross_entropy's backward holds two more fp32 [s, b, V] tensors (the loss gradient and
    log_softmax's input gradient); the vocabulary-parallel loss works in place but, during forward,
    holds the logits (compute dtype) and their fp32 copy next to the softmax."""
    model, e = workload.model, workload.dtype_bytes
    tokens = model.seq_length * layout.micro_batch_size
    sp_tokens = tokens // layout.tp if layout.sp else tokens
    logits = tokens * workload.padded_vocab(layout.tp) // layout.tp
    kept = (norm_saved_bytes(model, sp_tokens * model.hidden_size, e, kernels)
            + tokens * model.hidden_size * e + 4 * logits)
    if layout.tp == 1:
        extra = 2 * 4 * logits
    else:
        extra = logits * (e + (4 if e != 4 else 0))
    return kept, extra


def layer_backward_bytes(workload: Workload, layout: Layout) -> float:
    """Gradients alive while backward runs through the MLP of one layer: the gradient of the fc1
    output (2f/t with SwiGLU) next to the gathered [s, b, h] gradient of its input."""
    model, e = workload.model, workload.dtype_bytes
    tokens = model.seq_length * layout.micro_batch_size
    ffn = model.ffn_hidden_size // layout.tp
    return tokens * ((2 * ffn if model.swiglu else ffn) + model.hidden_size) * e


def chunks_in_flight(layout: Layout, pp_rank: int, num_microbatches: int) -> int:
    """Forward passes of (model chunk, micro-batch) whose backward has not run yet, at most, on a
    pipeline rank (schedules.py): 1F1B runs p - rank - 1 warm-up forwards and one more before its
    first backward; interleaved 1F1B 2(p - rank - 1) + (v - 1)p warm-up forwards. Stage 0 thus holds
    p micro-batches of L/p layers (1F1B), L(1 + (p-1)/(pv)) layers' worth when interleaved."""
    if layout.pp == 1:
        return 1
    if layout.vpp == 1:
        return min(layout.pp - pp_rank, num_microbatches)
    warmup = 2 * (layout.pp - pp_rank - 1) + (layout.vpp - 1) * layout.pp
    return min(warmup + 1, num_microbatches * layout.vpp)


def activation_memory(workload: Workload, layout: Layout, pp_rank: int, kernels: Kernels,
                      params: StageParameters) -> float:
    """Peak bytes of activations (and backward temporaries) on pipeline rank ``pp_rank``."""
    model, e = workload.model, workload.dtype_bytes
    m = layout.num_microbatches(workload.global_batch_size)
    in_flight = chunks_in_flight(layout, pp_rank, m)
    layers_per_chunk = model.num_layers // (layout.pp * layout.vpp)
    tokens = model.seq_length * layout.micro_batch_size
    sp_tokens = tokens // layout.tp if layout.sp else tokens
    last = pp_rank == layout.pp - 1

    kept = in_flight * layers_per_chunk * layer_activation_bytes(workload, layout, kernels)
    # the pipeline executor keeps each in-flight chunk's output to backpropagate from it
    stashed_outputs = in_flight - 1 if last else in_flight
    kept += stashed_outputs * sp_tokens * model.hidden_size * e if layout.pp > 1 else 0
    if pp_rank == 0 and model.hidden_dropout > 0:
        kept += math.ceil(in_flight / layout.vpp) * sp_tokens * model.hidden_size * dropout_mask_bytes(kernels, e)

    # the current micro-batch's largest moment: the loss and its backward (last stage), or, once the
    # head's tensors are freed, backward through a layer (recomputed first under full recomputation)
    head = sum(output_layer_bytes(workload, layout, kernels)) if last else 0.0
    through_layer = layer_backward_bytes(workload, layout)
    if layout.recompute == "full":
        through_layer += layer_activation_bytes(workload, dataclasses.replace(layout, recompute="none"), kernels)
    weight_gradient = params.largest * e          # a weight's gradient before it is added to the fp32 buffer
    return kept + max(head, through_layer) + weight_gradient


def zero_reduction_buffers(workload: Workload, layout: Layout, params: StageParameters, num_microbatches: int) -> float:
    """ZeRO-2/3 gradient temporaries alive at the activation peak.

    Each micro-batch's gradients of a bucket are collected in a full-size fp32 bucket tensor and
    reduce-scattered into an fp32 chunk; megalite's data-parallel wrapper keeps both until the next
    step's zero_grad (ddp.py ``_retired``, kept alive for gloo's asynchronous collectives). At the
    last micro-batch's loss the m - 1 earlier micro-batches' temporaries are held, 4(1 + 1/d) B/param,
    plus the current micro-batch's first bucket: ZeRO-2's (all parameters, up to Megatron's
    40M-element bucket), ZeRO-3's root unit (embeddings and output layer) or, on a middle pipeline
    stage, its last layer."""
    earlier = (num_microbatches - 1) * GRAD_BYTES * params.total * (1 + 1 / layout.dp)
    if layout.sharding == "optim_grads":
        current = min(params.total, 40_000_000)
    else:
        current = max(params.embedding + params.head, layer_parameters(workload.model, layout.tp))
    return earlier + GRAD_BYTES * current


def gathered_parameters(workload: Workload, layout: Layout, params: StageParameters) -> float:
    """ZeRO-3 full parameters alive at once: the root unit (embeddings, final norm, output layer) from
    its forward until its gradients are reduced, and the layer that backward is going through."""
    per_layer = layer_parameters(workload.model, layout.tp)
    return (params.embedding + params.head + per_layer) * workload.dtype_bytes


# ==================================================================================================
# Memory per device
# ==================================================================================================
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
    """Peak bytes on one device of pipeline rank ``pp_rank`` (every TP and DP rank of a stage alike)."""
    params = stage_parameters(workload, layout, pp_rank)
    per_weight, per_grad, per_optimizer = state_bytes_per_parameter(workload.dtype_bytes, layout.sharding, layout.dp)
    weights, grads = params.total * per_weight, params.total * per_grad
    m = layout.num_microbatches(workload.global_batch_size)
    if layout.sharding in ("optim_grads", "optim_grads_params") and layout.dp > 1:
        grads += zero_reduction_buffers(workload, layout, params, m)
    if layout.sharding == "optim_grads_params" and layout.dp > 1:
        weights += gathered_parameters(workload, layout, params)
    activations = activation_memory(workload, layout, pp_rank, kernels, params)
    return Memory(weights, grads, params.total * per_optimizer, activations)


def estimate_memory(workload: Workload, layout: Layout, kernels: Kernels = GPU_KERNELS) -> Memory:
    """The device that needs the most: the largest of the pipeline ranks."""
    return max((rank_memory(workload, layout, r, kernels) for r in outer_ranks(layout)), key=lambda m: m.total)


def outer_ranks(layout: Layout) -> set[int]:
    """The pipeline ranks that can need the most: the first (most micro-batches in flight, the
    embeddings) and the last (the output layer and the logits); the ranks between hold less."""
    return {0, layout.pp - 1}


# ==================================================================================================
# Step time
# ==================================================================================================
@dataclass(frozen=True)
class StepTime:
    compute: float
    bubble: float
    tensor_parallel: float
    pipeline_parallel: float
    data_parallel: float          # the part not hidden behind backward (--overlap-grad-reduce)
    model_flops: float

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tensor_parallel + self.pipeline_parallel + self.data_parallel


def hardware_flops(workload: Workload, layout: Layout) -> tuple[float, float]:
    """(model FLOPs, FLOPs actually run) of one iteration: recomputation runs forward again, the
    whole layer stack (full) or attention's scores and values, 4*s*nq*d per token and layer
    (selective; logging.flops_per_iteration's attention term)."""
    model = dataclasses.replace(workload.model, padded_vocab_size=workload.padded_vocab(layout.tp))
    model_flops = flops_per_iteration(model, workload.global_batch_size)
    tokens = workload.global_batch_size * model.seq_length
    if layout.recompute == "full":
        head_only = flops_per_iteration(dataclasses.replace(model, num_layers=0), workload.global_batch_size)
        return model_flops, model_flops + (model_flops - head_only) / 3
    if layout.recompute == "selective":
        attention = 4 * model.seq_length * model.num_attention_heads * model.kv_channels * model.num_layers
        return model_flops, model_flops + attention * tokens
    return model_flops, model_flops


def ring_bytes(kind: str, size_bytes: float, ranks: int) -> float:
    """Bytes each rank sends per collective on a ring (REFERENCE §6)."""
    if ranks == 1:
        return 0.0
    factor = 2 * (ranks - 1) / ranks if kind == "all_reduce" else (ranks - 1) / ranks
    return factor * size_bytes


def link_bandwidth(hardware: Hardware, span: int) -> float:
    """Bytes/s of a group whose ranks lie within ``span`` consecutive global ranks."""
    gbps = hardware.intra_node_gbps if span <= hardware.gpus_per_node else hardware.inter_node_gbps
    return gbps * 1e9


def step_time(workload: Workload, layout: Layout, hardware: Hardware) -> StepTime:
    model, e = workload.model, workload.dtype_bytes
    m = layout.num_microbatches(workload.global_batch_size)
    model_flops, flops = hardware_flops(workload, layout)
    compute = flops / (hardware.num_gpus * hardware.peak_flops(workload.precision) * hardware.compute_efficiency)
    bubble = compute * (layout.pp - 1) / (layout.vpp * m)            # REFERENCE §6: (p-1)/(v*m) of ideal time

    # TP: per layer and micro-batch 2 all-reduces of [s, b, h] forward and 2 backward (with SP the
    # same volume as all-gathers + reduce-scatters); full recomputation repeats the forward ones
    activation = model.seq_length * layout.micro_batch_size * model.hidden_size * e
    collectives = 4 + (2 if layout.recompute == "full" else 0)
    tp_bytes = collectives * ring_bytes("all_reduce", activation, layout.tp) * (model.num_layers // layout.pp) * m
    tensor_parallel = tp_bytes / link_bandwidth(hardware, layout.tp)

    # PP: each chunk of each micro-batch sends its activation forward and receives a gradient back
    boundary = activation / (layout.tp if layout.sp else 1)
    pp_bytes = 2 * boundary * m * layout.vpp if layout.pp > 1 else 0.0
    pipeline_parallel = pp_bytes / link_bandwidth(hardware, layout.num_gpus)

    data_parallel = exposed_data_parallel_time(workload, layout, hardware, compute)
    return StepTime(compute, bubble, tensor_parallel, pipeline_parallel, data_parallel, model_flops)


def exposed_data_parallel_time(workload: Workload, layout: Layout, hardware: Hardware, compute: float) -> float:
    """Gradient reduction and parameter gathers (ring formulas, fp32 gradients) that do not overlap.

    Bytes per rank, Psi parameters on the rank: no_shard all-reduce 2(d-1)/d * 4Psi; ZeRO-1
    reduce-scatter (d-1)/d * 4Psi + all-gather (d-1)/d * e*Psi; ZeRO-2 reduce-scatters every
    micro-batch; ZeRO-3 gathers parameters in forward and backward of every micro-batch. With
    --overlap-grad-reduce (recommended) the reduction runs during the last micro-batch's compute, or
    during every micro-batch's for ZeRO-2/3, which communicate each one."""
    d, m = layout.dp, layout.num_microbatches(workload.global_batch_size)
    if d == 1:
        return 0.0
    psi = max(stage_parameters(workload, layout, r).total for r in outer_ranks(layout))
    grads, params = GRAD_BYTES * psi, workload.dtype_bytes * psi
    if layout.sharding == "no_shard":
        sent = ring_bytes("all_reduce", grads, d)
    elif layout.sharding == "optim":
        sent = ring_bytes("reduce_scatter", grads, d) + ring_bytes("all_gather", params, d)
    elif layout.sharding == "optim_grads":
        sent = m * ring_bytes("reduce_scatter", grads, d) + ring_bytes("all_gather", params, d)
    else:
        sent = m * ring_bytes("reduce_scatter", grads, d) + 2 * m * ring_bytes("all_gather", params, d)
    seconds = sent / link_bandwidth(hardware, layout.tp * d)
    overlap_window = compute if layout.sharding in ("optim_grads", "optim_grads_params") else compute / m
    return max(0.0, seconds - overlap_window)


# ==================================================================================================
# Search
# ==================================================================================================
@dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: Memory
    time: StepTime
    fits: bool

    def mfu(self, workload: Workload, hardware: Hardware) -> float:
        return self.time.model_flops / (hardware.num_gpus * hardware.peak_flops(workload.precision) * self.time.total)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layout_problem(workload: Workload, layout: Layout, gpus_per_node: int) -> str | None:
    """Why this layout cannot run (megalite's own checks, or TP leaving the node), or None."""
    model = workload.model
    if layout.tp > gpus_per_node:
        return f"TP {layout.tp} would span nodes ({gpus_per_node} GPUs per node)"
    if workload.global_batch_size % (layout.micro_batch_size * layout.dp):
        return (f"--global-batch-size {workload.global_batch_size} is not divisible by micro-batch size "
                f"{layout.micro_batch_size} x data-parallel size {layout.dp}")
    if layout.vpp > 1 and (model.num_layers // layout.pp) % layout.vpp:
        return f"{model.num_layers // layout.pp} layers per pipeline stage cannot form {layout.vpp} virtual stages"
    try:
        check_attention_split(model.num_attention_heads, model.num_query_groups, layout.tp)
        layers_per_virtual_stage = model.num_layers // (layout.pp * layout.vpp) if layout.vpp > 1 else None
        check_pipeline_split(model.num_layers, layout.pp, layers_per_virtual_stage,
                             layout.num_microbatches(workload.global_batch_size))
    except UserError as error:
        return str(error)
    if model.ffn_hidden_size % layout.tp:
        return f"--ffn-hidden-size {model.ffn_hidden_size} is not divisible by TP {layout.tp}"
    if layout.sp and model.seq_length % layout.tp:
        return f"--sequence-parallel needs --seq-length {model.seq_length} divisible by TP {layout.tp}"
    if layout.dp == 1 and layout.sharding != "no_shard":
        return f"--data-parallel-sharding-strategy {layout.sharding} shards nothing at data-parallel size 1"
    return None


@dataclass(frozen=True)
class Pins:
    """Layout choices fixed by the user; None leaves a dimension to the search."""
    tp: int | None = None
    pp: int | None = None
    layers_per_virtual_stage: int | None = None
    micro_batch_size: int | None = None
    recompute: str | None = None
    sharding: str | None = None

    def allow(self, layout: Layout, num_layers: int) -> bool:
        vpp_layers = num_layers // (layout.pp * layout.vpp) if layout.vpp > 1 else None
        return all(pin is None or pin == value for pin, value in (
            (self.tp, layout.tp), (self.pp, layout.pp), (self.layers_per_virtual_stage, vpp_layers),
            (self.micro_batch_size, layout.micro_batch_size), (self.recompute, layout.recompute),
            (self.sharding, layout.sharding)))

    FLAGS = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
             "layers_per_virtual_stage": "--num-layers-per-virtual-pipeline-stage",
             "micro_batch_size": "--micro-batch-size", "recompute": "--recompute-granularity",
             "sharding": "--data-parallel-sharding-strategy"}

    def describe(self) -> str:
        return " ".join(f"{self.FLAGS[name]} {value}" for name, value in dataclasses.asdict(self).items()
                        if value is not None)


def layouts_of(workload: Workload, num_gpus: int) -> Iterator[Layout]:
    """Every TP x PP x DP split of ``num_gpus`` with every virtual-stage count dividing a stage's
    layers, micro-batch size dividing GBS/DP, recomputation and sharding; sequence parallel on."""
    layers, gbs = workload.model.num_layers, workload.global_batch_size
    for tp in divisors(num_gpus):
        for pp in divisors(num_gpus // tp):
            dp = num_gpus // (tp * pp)
            vpps = divisors(layers // pp) if pp > 1 and layers % pp == 0 else [1]
            micro_batch_sizes = divisors(gbs // dp) if gbs % dp == 0 else [1]
            for vpp in vpps:
                for mbs in micro_batch_sizes:
                    for recompute in RECOMPUTE:
                        for sharding in SHARDING:
                            yield Layout(tp, pp, dp, vpp, mbs, recompute, sharding)


def candidate_layouts(workload: Workload, hardware: Hardware, pins: Pins = Pins()) -> list[Layout]:
    """The layouts megalite accepts on ``hardware``, within ``pins``; a one-line UserError naming
    why when there is none."""
    pinned = [lay for lay in layouts_of(workload, hardware.num_gpus) if pins.allow(lay, workload.model.num_layers)]
    if not pinned:
        raise UserError(f"no layout of {hardware.num_gpus} GPUs has {pins.describe()}: the TP x PP sizes must divide "
                        "the number of GPUs and the virtual stages a stage's layers")
    problems = [(lay, layout_problem(workload, lay, hardware.gpus_per_node)) for lay in pinned]
    valid = [lay for lay, problem in problems if problem is None]
    if not valid:
        reasons = sorted({problem for _, problem in problems})
        more = f" (and {len(reasons) - 1} more reasons)" if len(reasons) > 1 else ""
        raise UserError(f"no layout of {hardware.num_gpus} GPUs suits this model and batch"
                        + (f" with {pins.describe()}" if pins.describe() else "") + f": {reasons[0]}{more}")
    return valid


def evaluate(workload: Workload, layout: Layout, hardware: Hardware, kernels: Kernels = GPU_KERNELS) -> Estimate:
    memory = estimate_memory(workload, layout, kernels)
    return Estimate(layout, memory, step_time(workload, layout, hardware), memory.total <= hardware.usable_bytes)


def plan(workload: Workload, hardware: Hardware, pins: Pins = Pins(), top: int = 5,
         kernels: Kernels = GPU_KERNELS) -> list[Estimate]:
    """The ``top`` fastest layouts that fit, fastest first; a one-line UserError when none does."""
    estimates = [evaluate(workload, layout, hardware, kernels) for layout in candidate_layouts(workload, hardware, pins)]
    feasible = sorted((e for e in estimates if e.fits), key=lambda e: (e.time.total, e.memory.total))
    if not feasible:
        raise UserError(nothing_fits_message(min(estimates, key=lambda e: e.memory.total), hardware))
    return feasible[:top]


def nothing_fits_message(smallest: Estimate, hardware: Hardware) -> str:
    mem = smallest.memory
    state = mem.weights + mem.grads + mem.optimizer
    if state > hardware.usable_bytes:
        advice = (f"the weights, gradients and optimizer state alone take {state / GiB:.1f} GB: add GPUs (the state "
                  "divides over TP x PP, and over DP with ZeRO) or use GPUs with more memory")
    else:
        advice = (f"{mem.activations / GiB:.1f} GB of it are activations: shorten --seq-length, add GPUs or use GPUs "
                  "with more memory")
    return (f"no layout fits {hardware.num_gpus} x {hardware.gpu_memory_gb:g} GB: the smallest needs "
            f"{mem.total / GiB:.1f} GB per device ({smallest.layout.describe()}) of {hardware.usable_bytes / GiB:.1f} "
            f"GB usable; {advice}")


def pretrain_flags(workload: Workload, layout: Layout) -> list[str]:
    """pretrain_gpt.py flags that run ``layout``."""
    flags = ["--tensor-model-parallel-size", str(layout.tp)]
    if layout.sp:
        flags.append("--sequence-parallel")
    flags += ["--pipeline-model-parallel-size", str(layout.pp)]
    if layout.vpp > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(workload.model.num_layers // (layout.pp * layout.vpp))]
    flags += ["--micro-batch-size", str(layout.micro_batch_size), "--global-batch-size", str(workload.global_batch_size)]
    if layout.recompute == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif layout.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    if layout.sharding == "optim":
        flags.append("--use-distributed-optimizer")
    elif layout.sharding != "no_shard":
        flags += ["--data-parallel-sharding-strategy", layout.sharding]
    if layout.dp > 1:
        flags.append("--overlap-grad-reduce")
        if layout.sharding != "no_shard":
            flags.append("--overlap-param-gather")
    if workload.precision != "fp32":
        flags.append(f"--{workload.precision}")
    return flags


# ==================================================================================================
# Hugging Face configs
# ==================================================================================================
LLAMA_LIKE = ("llama", "mistral", "qwen2")


def read_hf_config_json(path: str) -> dict:
    """config.json (or a model directory holding one) as a dict; one-line errors for bad input."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise UserError(f"--hf-config {path}: no such file (give a config.json or a model directory holding one)")
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"--hf-config {file} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise UserError(f"--hf-config {file} is not a JSON object")
    return raw


def model_from_hf_config(raw: dict, seq_length: int, source: str = "--hf-config") -> ModelConfig:
    """A ModelConfig from a Llama / Mistral / Qwen2 / GPT-2 config.json (the fields hf_conversion.py
    maps; RoPE scaling is irrelevant to memory and time, so it is not refused here)."""
    model_type = raw.get("model_type")
    try:
        if model_type in LLAMA_LIKE:
            return _llama_like(raw, model_type, seq_length)
        if model_type == "gpt2":
            return _gpt2(raw, seq_length)
    except KeyError as e:
        raise UserError(f"{source}: {model_type} config has no {e.args[0]!r}") from None
    raise UserError(f"{source}: model_type {model_type!r} is not supported (supported: "
                    f"{', '.join(LLAMA_LIKE + ('gpt2',))})")


def _llama_like(raw: dict, model_type: str, seq_length: int) -> ModelConfig:
    h, nq = raw["hidden_size"], raw["num_attention_heads"]
    return ModelConfig(
        num_layers=raw["num_hidden_layers"], hidden_size=h, num_attention_heads=nq,
        ffn_hidden_size=raw["intermediate_size"], kv_channels=raw.get("head_dim") or h // nq,
        num_query_groups=raw.get("num_key_value_heads") or nq, seq_length=seq_length,
        max_position_embeddings=raw.get("max_position_embeddings", seq_length),
        padded_vocab_size=raw["vocab_size"], vocab_size=raw["vocab_size"], position_embedding_type="rope",
        normalization="RMSNorm", swiglu=True, add_bias_linear=False, add_qkv_bias=model_type == "qwen2",
        untie_embeddings_and_output_weights=not raw.get("tie_word_embeddings", False),
        attention_dropout=float(raw.get("attention_dropout", 0.0)), hidden_dropout=0.0)


def _gpt2(raw: dict, seq_length: int) -> ModelConfig:
    h, heads = raw["n_embd"], raw["n_head"]
    return ModelConfig(
        num_layers=raw["n_layer"], hidden_size=h, num_attention_heads=heads,
        ffn_hidden_size=raw.get("n_inner") or 4 * h, kv_channels=h // heads, num_query_groups=heads,
        seq_length=seq_length, max_position_embeddings=raw.get("n_positions", 1024),
        padded_vocab_size=raw["vocab_size"], vocab_size=raw["vocab_size"], openai_gelu=True,
        untie_embeddings_and_output_weights=not raw.get("tie_word_embeddings", True),
        attention_dropout=float(raw.get("attn_pdrop", 0.1)), hidden_dropout=float(raw.get("resid_pdrop", 0.1)))


def model_from_flags(num_layers: int, hidden_size: int, num_attention_heads: int, vocab_size: int,
                     seq_length: int, ffn_hidden_size: int | None = None, num_query_groups: int | None = None,
                     kv_channels: int | None = None, swiglu: bool = False, **options) -> ModelConfig:
    """A ModelConfig from Megatron's model flags, with pretrain_gpt.py's defaults (arguments.py)."""
    if kv_channels is None and hidden_size % num_attention_heads:
        raise UserError(f"--hidden-size {hidden_size} must be divisible by --num-attention-heads "
                        f"{num_attention_heads} (or give --kv-channels)")
    groups = num_query_groups or num_attention_heads
    if num_attention_heads % groups:
        raise UserError(f"--num-attention-heads {num_attention_heads} must be divisible by --num-query-groups {groups}")
    return ModelConfig(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        ffn_hidden_size=ffn_hidden_size or default_ffn_hidden_size(hidden_size, swiglu),
        kv_channels=kv_channels or hidden_size // num_attention_heads, num_query_groups=groups,
        seq_length=seq_length, max_position_embeddings=options.pop("max_position_embeddings", None) or seq_length,
        padded_vocab_size=vocab_size, vocab_size=vocab_size, swiglu=swiglu, **options)


def workload_and_layout(config: MegaliteConfig) -> tuple[Workload, Layout]:
    """The planner's view of a parsed pretrain_gpt.py command line (arguments.parse_args)."""
    opt, par, train = config.optimizer, config.parallel, config.training
    precision = "bf16" if opt.bf16 else "fp16" if opt.fp16 else "fp32"
    chunks = 1
    if par.num_layers_per_virtual_pipeline_stage:
        chunks = config.model.num_layers // (par.pipeline_model_parallel_size * par.num_layers_per_virtual_pipeline_stage)
    # arguments.py has padded the vocabulary for this TP size already: keep it as it is (pad to 1)
    model = dataclasses.replace(config.model, vocab_size=config.model.padded_vocab_size)
    workload = Workload(model, train.global_batch_size, precision, make_vocab_size_divisible_by=1)
    layout = Layout(par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.data_parallel_size, chunks,
                    train.micro_batch_size, config.model.recompute_granularity or "none",
                    par.data_parallel_sharding_strategy,
                    sequence_parallel=par.sequence_parallel or par.tensor_model_parallel_size == 1)   # (moot at TP=1)
    return workload, layout
