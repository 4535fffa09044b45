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
  plus the temporaries of backward's fullest moment: through a layer's MLP (``layer_backward_bytes``)
  or, on the last stage, the loss and the output layer (``output_layer_bytes``). The per-layer sum
  follows Korthikanti et al. 2022 (REFERENCE §6: 34sbh + 5as^2b bytes, 16-bit) term by term, adapted
  to what megalite's layers really keep (see ``layer_activation_bytes``).
- data-parallel temporaries at that same moment, counted with the weights and gradients: ZeRO-2/3's
  per-bucket gradient staging, ZeRO-3's just-in-time gathered units, gloo's collective copies
  (``data_parallel_transients``). The peak is the fullest of a step's moments (``rank_memory``).

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

from megalite.config.arguments import default_ffn_hidden_size
from megalite.config.schema import ASYNC_SCHEDULES, SHARDING_STRATEGIES, MegaliteConfig, ModelConfig, ParallelConfig, padded_vocab_size
from megalite.parallel.data.ddp import MAX_IN_FLIGHT, default_bucket_size
from megalite.errors import UserError
from megalite.train.logging import flops_per_iteration
from megalite.model.transformer import check_attention_split
from megalite.parallel.pipeline.pipedream import versions_behind
from megalite.parallel.pipeline.stages import SplitFlags, check_pipeline_split, virtual_stage_layers
from megalite.parallel.pipeline.zero_bubble import check_zero_bubble, schedule_split

GiB = 2 ** 30
RECOMPUTE = ("none", "selective", "full")
# pipeline schedules (config.PIPELINE_SCHEDULES): the bubble as a share of the slowest stage's busy time
# over the m micro-batches (Qi et al. 2024 for zero bubble, with F, B and W equally long: ZB-H1 keeps a third
# of 1F1B's (p-1)/m, ZB-V none), and the weight versions a stage keeps beyond its live weights (PipeDream:
# one per in-flight micro-batch but the newest, p - rank - 1; PipeDream-2BW: one). The asynchronous
# schedules never flush, so their bubble is paid once per run, not per step.
HBM_GBPS = 3350.0       # H100 SXM HBM3, GB/s: the loss is memory-bound
LOSS_BYTES_PER_LOGIT = 20   # fp32 logits: written, read twice (max, sum of exp) in forward, read + written in backward
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
    overlap_grad_reduce: bool = True     # --overlap-grad-reduce, as pretrain_flags asks (moot at dp 1)
    overlap_param_gather: bool = True    # --overlap-param-gather, as pretrain_flags asks (moot at dp 1, no_shard)
    cp: int = 1                      # context parallel: each rank holds 2 of 2cp chunks of every sequence
    schedule: str = "1f1b"           # PIPELINE_SCHEDULES; 1f1b with vpp > 1 is interleaved 1F1B; zbv has vpp 2 in a V
    split: SplitFlags = SplitFlags() # uneven stages (first/last counts, account-for flags, a layout string)

    @property
    def num_gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shards(self) -> int:
        """Ranks that hold the same parameters and reduce gradients together (Megatron: dp x cp)."""
        return self.dp * self.cp

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    def num_microbatches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.micro_batch_size * self.dp)

    def describe(self) -> str:
        vpp = f" VPP={self.vpp}" if self.vpp > 1 else ""
        vpp += f" CP={self.cp}" if self.cp > 1 else ""
        vpp += f" {self.schedule}" if self.schedule != "1f1b" else ""
        vpp += f" split={split_name(self.split)}" if self.split != SplitFlags() else ""
        off = [name for name, on in (("grad reduce", self.overlap_grad_reduce),
                                     ("param gather", self.overlap_param_gather)) if not on and self.dp > 1]
        overlap = f" (no overlapped {' or '.join(off)})" if off else ""
        return (f"TP={self.tp} PP={self.pp}{vpp} DP={self.dp} MBS={self.micro_batch_size} "
                f"recompute={self.recompute} sharding={self.sharding}{overlap}")


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
    memory_gbps: float = HBM_GBPS           # GB/s of device memory (the loss is memory-bound)

    def peak_flops(self, precision: str) -> float:
        tflops = self.peak_tflops or (67.0 if precision == "fp32" else 989.0)
        return tflops * 1e12

    @property
    def usable_bytes(self) -> float:
        return self.gpu_memory_gb * GiB * self.usable_memory_fraction


@dataclass(frozen=True)
class Kernels:
    """What torch's kernels and collectives hold where CUDA and CPU builds differ (the formulas are for
    CUDA with NCCL; tests measure on CPU with gloo).

    - attention: scaled_dot_product_attention runs a flash kernel that keeps q, k, v, the output and
      the log-sum-exp, never the s x s scores (CUDA with or without dropout; CPU only without
      attention dropout, so CPU estimates require --attention-dropout 0).

    - embedding dropout (F.dropout): CUDA's native_dropout keeps a 1-byte mask; CPU keeps a noise
      tensor in the compute dtype.

    The transformer layers keep the same on both: megalite's RMSNorm keeps its input and an fp32 1/rms
    per token (its own autograd Function, as CUDA's fused kernel; torch's composite CPU rms_norm would
    keep fp32 copies), and hidden dropout keeps a 1-byte mask (torch.native_dropout on both).

    - collectives: NCCL reduces and gathers in the tensors it is given. gloo copies through temporaries
      of torch's allocator, alive until the collective completes: a reduce-scatter of a list of chunks
      (the data-parallel one) (d-1)/d of its input, the single-tensor one (sequence parallelism) its
      whole input, an all-gather its whole output; an all-reduce none.
    """
    dropout_mask_bytes: int | None = 1      # None: the compute dtype's size
    flash_attention_dropout: bool = True
    collective_copies: bool = False         # gloo's temporaries above


GPU_KERNELS = Kernels()
CPU_KERNELS = Kernels(dropout_mask_bytes=None, flash_attention_dropout=False, collective_copies=True)


# ==================================================================================================
# Parameters
# ==================================================================================================
def local_attention_heads(model: ModelConfig, tp: int) -> tuple[int, int]:
    """(query heads, KV groups) on one TP rank; with more TP ranks than KV heads each rank keeps a
    replica of its group's K and V (SelfAttention)."""
    return model.num_attention_heads // tp, max(1, model.num_query_groups // tp)


def layer_tensors(model: ModelConfig, tp: int) -> list[int]:
    """Sizes of one transformer layer's parameters on one TP rank, in TransformerLayer's order: input
    norm, linear_qkv (+ bias), linear_proj (+ bias, replicated), pre-MLP norm, linear_fc1 (+ bias),
    linear_fc2 (+ bias, replicated)."""
    h, d = model.hidden_size, model.kv_channels
    heads, groups = local_attention_heads(model, tp)
    ffn = model.ffn_hidden_size // tp
    qkv_rows, fc1_rows = (heads + 2 * groups) * d, 2 * ffn if model.swiglu else ffn
    norm = [h] * (norm_parameters(model) // h)
    bias = model.add_bias_linear
    return [*norm, qkv_rows * h, *([qkv_rows] if bias or model.add_qkv_bias else []),
            heads * d * h, *([h] if bias else []),
            *norm, fc1_rows * h, *([fc1_rows] if bias else []),
            ffn * h, *([h] if bias else [])]


def layer_parameters(model: ModelConfig, tp: int) -> int:
    """Parameters of one transformer layer on one TP rank (TransformerLayer)."""
    return sum(layer_tensors(model, tp))


def norm_parameters(model: ModelConfig) -> int:
    return model.hidden_size * (2 if model.normalization == "LayerNorm" else 1)


def split_name(split: SplitFlags) -> str:
    """The split flags in a few characters, for tables."""
    if split.layout:
        return split.layout
    if split.first is not None or split.last is not None:
        return f"first {split.first or '-'} last {split.last or '-'}"
    return "+".join(name for name, on in (("E", split.account_for_embedding), ("L", split.account_for_loss)) if on) \
        or "even"


def stage_layers(layout: Layout, num_layers: int) -> list[int]:
    """Transformer layers of each virtual stage (pipeline_parallel/stages.py), v = chunk * pp + rank."""
    split = layout.split
    if layout.vpp > 1 and not split.layout:
        split = dataclasses.replace(split, layers_per_virtual_stage=None, virtual_stages_per_rank=layout.vpp)
    return virtual_stage_layers(num_layers, layout.pp, split)


def virtual_stages_of(layout: Layout, pp_rank: int) -> list[int]:
    """The virtual stages pipeline rank ``pp_rank`` holds: chunk * pp + rank, or for zbv the V of rank r
    and 2p - 1 - r."""
    if layout.schedule == "zbv":
        return [pp_rank, 2 * layout.pp - 1 - pp_rank]
    return [chunk * layout.pp + pp_rank for chunk in range(layout.vpp)]


def rank_layers(workload: Workload, layout: Layout, pp_rank: int) -> list[int]:
    """Transformer layers of each model chunk of pipeline rank ``pp_rank``."""
    layers = stage_layers(layout, workload.model.num_layers)
    return [layers[v] for v in virtual_stages_of(layout, pp_rank)]


def holds_embedding(layout: Layout, pp_rank: int) -> bool:
    return 0 in virtual_stages_of(layout, pp_rank)


def holds_head(layout: Layout, pp_rank: int) -> bool:
    """Whether the rank holds the last virtual stage: final norm, output layer and loss."""
    return layout.pp * layout.vpp - 1 in virtual_stages_of(layout, pp_rank)


@dataclass(frozen=True)
class StageParameters:
    layers: int            # parameters in this rank's transformer layers
    embedding: int         # word (+ position) embeddings, on the first stage
    head: int              # final norm + output layer, on the last stage

    @property
    def total(self) -> int:
        return self.layers + self.embedding + self.head


def stage_parameters(workload: Workload, layout: Layout, pp_rank: int) -> StageParameters:
    """Parameters on pipeline rank ``pp_rank`` of one TP rank (build_model_chunks / GPTModel): its
    layers (stage_layers), the embeddings on the first stage, and on the last the final norm plus the
    output layer, which tied embeddings still need as a copy when the first stage is another chunk."""
    model, tp = workload.model, layout.tp
    vocab_rows = workload.padded_vocab(tp) // tp
    h = model.hidden_size
    layers = sum(rank_layers(workload, layout, pp_rank)) * layer_parameters(model, tp)
    first, last = holds_embedding(layout, pp_rank), holds_head(layout, pp_rank)
    embedding = 0
    if first:
        embedding = vocab_rows * h + (0 if model.use_rope else model.max_position_embeddings * h)
    head = 0
    if last:
        head = norm_parameters(model)
        if model.untie_embeddings_and_output_weights or layout.pp > 1:     # (another chunk holds the embedding)
            head += vocab_rows * h
    return StageParameters(layers, embedding, head)


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
def norm_saved_bytes(model: ModelConfig, elements: float, dtype_bytes: int) -> float:
    """Bytes a norm keeps for backward over ``elements`` input elements: its input (plus per-token
    statistics, not counted)."""
    return dtype_bytes * elements


def attention_saved_elements(model: ModelConfig, tp: int, tokens: int) -> float:
    """Elements SelfAttention keeps for backward for ``tokens`` tokens on one TP rank (compute dtype):
    q, the unexpanded k and v (GQA runs on grouped K/V; views of the fused QKV output only when all
    three are, else copies, so the QKV output is never kept whole beside them) and the output, which
    the output projection's input is a view of. Selective recomputation keeps the same tensors, as
    the checkpoint's inputs; it drops only the log-sum-exp."""
    heads, groups = local_attention_heads(model, tp)
    d = model.kv_channels
    return tokens * (2 * heads + 2 * groups) * d


def layer_activation_bytes(workload: Workload, layout: Layout, kernels: Kernels) -> float:
    """Bytes one transformer layer keeps for backward for one micro-batch on one TP rank.

    Korthikanti et al. count, per layer at 16 bits, sbh(34 + 5as/h) bytes: layernorm inputs 4sbh;
    attention 11sbh + 5as^2b (QKV input 2, Q and K 4, V 2, projection input 2, dropout mask 1, and
    the scores: softmax 2as^2b, its dropout mask as^2b and output 2as^2b); a 4h MLP 19sbh (fc1
    input 2, GeLU input 8, fc2 input 8, dropout mask 1). What megalite's TransformerLayer keeps:

    - norms: each keeps its input [s/t, b, h] (sequence-parallel shard);
    - QKV and fc1 inputs: the [s/t, b, h] shard too (the column-parallel linear gathers the sequence
      again in backward, as Megatron);
    - attention: ``attention_saved_elements`` (no s^2 term: flash kernels) + an fp32 log-sum-exp
      per token and head;
    - MLP: SwiGLU keeps fc1's output (2f/t) and the fc2 input (f/t), silu being recomputed in
      backward; GELU keeps fc1's output and the activation, 2f/t;
    - hidden dropout (p > 0): two 1-byte masks over [s/t, b, h].
    Full recomputation keeps only the layer's input [s/t, b, h] (Korthikanti: 2sbh, /t with SP).
    For a GPT layer (MHA, learned positions, 4h GELU MLP) on CUDA this is Korthikanti's 34sbh/t
    without the score terms.
    """
    model, e = workload.model, workload.dtype_bytes
    if model.attention_dropout > 0 and not kernels.flash_attention_dropout and layout.recompute != "full":
        raise ValueError("attention dropout on this device runs the math attention (s x s scores), which "
                         "this estimate does not model; use attention_dropout 0")
    tokens, sp_tokens = token_counts(workload, layout)
    h = model.hidden_size
    if layout.recompute == "full":
        return sp_tokens * h * e
    heads, _ = local_attention_heads(model, layout.tp)
    ffn = model.ffn_hidden_size // layout.tp
    norms = 2 * norm_saved_bytes(model, sp_tokens * h, e)
    linear_inputs = 2 * sp_tokens * h * e
    attention = attention_saved_elements(model, layout.tp, tokens) * e
    if layout.recompute != "selective":
        attention += tokens * heads * 4                                   # log-sum-exp, fp32
    mlp = (3 if model.swiglu else 2) * tokens * ffn * e
    dropout = 2 * sp_tokens * h if model.hidden_dropout > 0 else 0
    return norms + linear_inputs + attention + mlp + dropout


def token_counts(workload: Workload, layout: Layout) -> tuple[int, int]:
    """(tokens of one micro-batch on one context-parallel rank, the sequence-parallel share of them on one
    TP rank). Ring attention keeps what flash attention keeps, for the rank's 2 of 2cp chunks."""
    tokens = workload.model.seq_length * layout.micro_batch_size // layout.cp
    return tokens, tokens // layout.tp if layout.sp else tokens


def output_layer_bytes(workload: Workload, layout: Layout, kernels: Kernels) -> tuple[float, float]:
    """(kept for backward, extra at the peak) of the last stage's head for one micro-batch.

    Kept: the final norm's input, the output layer's [s/t, b, h] input (its sequence shard) and the fp32
    (log-)softmax over this rank's vocabulary shard [s, b, V/t]. Extra, the larger of two moments:

    - the loss: with one TP rank F.cross_entropy's backward holds two more fp32 [s, b, V] tensors (the
      loss gradient and log_softmax's input gradient); the vocabulary-parallel loss works in place
      but, during forward, holds the logits (compute dtype) and their fp32 copy next to the softmax;
    - the output layer's backward: the softmax has become the logits' gradient (cast to the compute
      dtype); next to it the gradient of the layer's input [s, b, h] and of its weight [V/t, h], and
      with sequence parallelism the input all-gathered again and the reduce-scattered input gradient
      (plus, on gloo, the reduce-scatter's copy of its input)."""
    model, e = workload.model, workload.dtype_bytes
    tokens, sp_tokens = token_counts(workload, layout)
    h, vocab_rows = model.hidden_size, workload.padded_vocab(layout.tp) // layout.tp
    logits = tokens * vocab_rows
    kept = norm_saved_bytes(model, sp_tokens * h, e) + sp_tokens * h * e + 4 * logits
    if layout.tp == 1:
        loss = 2 * 4 * logits
    else:
        loss = logits * (e + (4 if e != 4 else 0))
    linear = logits * (e - 4) + tokens * h * e + vocab_rows * h * e
    if layout.sp:
        linear += tokens * h * e + sp_tokens * h * e + (tokens * h * e if kernels.collective_copies else 0)
    return kept, max(loss, linear)


def layer_backward_bytes(workload: Workload, layout: Layout, kernels: Kernels) -> float:
    """The most bytes that backward through one layer holds beyond the activations the layers keep:
    the gradient arriving at the layer's output [s/t, b, h] and the largest of three moments of its MLP.

    - the activation's backward: _SwiGLUFunction.backward works in fp32; next to the gradient of fc2's
      input (f/t, compute dtype) it holds fp32 copies of fc1's output (2f/t) and of that gradient
      (f/t) at 16 bits, sigmoid(gate), the gate and up gradients (f/t each), their concatenation
      (2f/t) and at 16 bits its cast back (2f/t): 24f/t bytes per token in fp32, 38f/t in bf16. GELU's
      backward holds two f/t gradients. fc2's input (f/t), kept for fc2, is freed by then.
    - fc2's backward: the gradient of its input next to that of its weight [h, f/t] (and with
      sequence parallelism the all-gathered output gradient [s, b, h]; gloo gathers through a copy).
    - fc1's backward: the gradient of its output, of its input ([s, b, h]) and of its weight, with fc2's
      input and fc1's output freed; with sequence parallelism also the input all-gathered again, the
      reduce-scattered input gradient and gloo's copy of the reduce-scatter's input.
    This is the largest moment of a layer's backward: attention's is smaller (no s x s scores)."""
    model, e = workload.model, workload.dtype_bytes
    tokens, sp_tokens = token_counts(workload, layout)
    h, f = model.hidden_size, model.ffn_hidden_size // layout.tp
    fc1_out = 2 * f if model.swiglu else f
    copies = kernels.collective_copies
    if model.swiglu:
        upcast = 0 if e == 4 else 4 * (2 * f + f) + 2 * f * e
        activation = tokens * (upcast + 4 * (3 * f + 2 * f))
    else:
        activation = tokens * f * e
    fc2 = tokens * f * e + f * h * e + (tokens * h * e * (2 if copies else 1) if layout.sp else 0)
    fc1 = tokens * h * e + fc1_out * h * e - tokens * f * e
    if layout.sp:
        fc1 += tokens * h * e + sp_tokens * h * e + (tokens * h * e if copies else 0)
    return sp_tokens * h * e + max(activation, fc2, fc1)


def chunks_in_flight(layout: Layout, pp_rank: int, num_microbatches: int) -> int:
    """Forward passes of (model chunk, micro-batch) whose backward has not run yet, at most, on a
    pipeline rank (schedules.py): 1F1B runs p - rank - 1 warm-up forwards and one more before its
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


def kept_activations(workload: Workload, layout: Layout, pp_rank: int, kernels: Kernels) -> float:
    """Bytes pipeline rank ``pp_rank`` keeps for backward at its fullest: the layers of every
    in-flight (chunk, micro-batch), the chunk outputs the pipeline executor keeps to backpropagate
    from, and the embedding dropout's noise."""
    model, e = workload.model, workload.dtype_bytes
    in_flight = chunks_in_flight(layout, pp_rank, layout.num_microbatches(workload.global_batch_size))
    layers_per_chunk = sum(rank_layers(workload, layout, pp_rank)) / layout.vpp     # (chunks alternate)
    _, sp_tokens = token_counts(workload, layout)
    kept = in_flight * layers_per_chunk * layer_activation_bytes(workload, layout, kernels)
    stashed_outputs = in_flight - 1 if holds_head(layout, pp_rank) else in_flight
    kept += stashed_outputs * sp_tokens * model.hidden_size * e if layout.pp > 1 else 0
    if holds_embedding(layout, pp_rank) and model.hidden_dropout > 0:
        kept += math.ceil(in_flight / layout.vpp) * sp_tokens * model.hidden_size * dropout_mask_bytes(kernels, e)
    return kept


def dropout_mask_bytes(kernels: Kernels, dtype_bytes: int) -> int:
    return kernels.dropout_mask_bytes or dtype_bytes


# ==================================================================================================
# Data-parallel temporaries (ddp.py, grad_buffer.py)
# ==================================================================================================
def bucket_size(layout: Layout) -> float:
    """Elements of a data-parallel bucket (ddp.default_bucket_size: 40M with overlapped reduction,
    else one bucket for everything, or for each unit with ZeRO-2/3, whose buckets never span two)."""
    return default_bucket_size(layout.shards, layout.overlap_grad_reduce) or math.inf


@dataclass(frozen=True)
class Param:
    unit: int           # 0: the head, 1..: the layers top-down, then the embedding
    size: int
    alone: bool = False     # a tied word embedding: a bucket of its own (grad_buffer.py, shared_embedding)


def backward_tensors(workload: Workload, layout: Layout, pp_rank: int) -> list[Param]:
    """Parameters of pipeline rank ``pp_rank`` (one TP rank) in the order their gradients arrive, which
    is the reverse parameter order the gradient buffer lays out: the head (output layer, final norm;
    last stage), each layer top-down from linear_fc2 to the input norm, the embedding (first stage)."""
    model, params = workload.model, stage_parameters(workload, layout, pp_rank)
    h, tied = model.hidden_size, not model.untie_embeddings_and_output_weights
    vocab_rows = workload.padded_vocab(layout.tp) // layout.tp
    tensors = []
    if params.head:
        if params.head > norm_parameters(model):
            tensors.append(Param(0, vocab_rows * h, alone=tied))
        tensors += [Param(0, n) for n in [h] * (norm_parameters(model) // h)]
    layers = sum(rank_layers(workload, layout, pp_rank))
    for i in range(layers):
        tensors += [Param(1 + i, n) for n in reversed(layer_tensors(model, layout.tp))]
    if params.embedding:
        if not model.use_rope:
            tensors.append(Param(1 + layers, model.max_position_embeddings * h))
        tensors.append(Param(1 + layers, vocab_rows * h, alone=tied))
    return tensors


def buckets_of(tensors: list[Param], layout: Layout, per_unit: bool) -> list[int]:
    """The index one past each bucket's last tensor (grad_buffer.ParamAndGradBuffer._layout): a bucket
    closes once it holds ``bucket_size`` elements, before a tied embedding and after it, and, for
    ZeRO-2/3 (``per_unit``), where the unit changes."""
    limit, ends, size = bucket_size(layout), [], 0
    for i, tensor in enumerate(tensors):
        if i and (size >= limit or tensor.alone or tensors[i - 1].alone
                  or (per_unit and tensor.unit != tensors[i - 1].unit)):
            ends.append(i)
            size = 0
        size += tensor.size
    return ends + [len(tensors)]


@dataclass(frozen=True)
class Buckets:
    """The data-parallel buckets alive at one moment of backward (elements each)."""
    reducing: list          # complete, their reduce-scatter in flight (not yet finished)
    filling: list           # receiving gradients (at most one)


def buckets_at(workload: Workload, layout: Layout, pp_rank: int, arrived: int, per_unit: bool,
               previous_microbatch: bool) -> Buckets:
    """Buckets alive once the first ``arrived`` gradients of this micro-batch's backward are in.
    With --overlap-grad-reduce a complete bucket's reduction runs until ddp.MAX_IN_FLIGHT newer ones
    have started (counting the previous micro-batch's last ones, still in flight at the top of the
    stage, when ``previous_microbatch``); without, it runs as soon as the bucket is complete."""
    tensors = backward_tensors(workload, layout, pp_rank)
    ends = buckets_of(tensors, layout, per_unit)
    sizes = [sum(t.size for t in tensors[start:end]) for start, end in zip([0] + ends, ends)]
    complete = sum(1 for end in ends if end <= arrived)
    started = arrived > (ends[complete - 1] if complete else 0)
    filling = [sizes[complete]] if complete < len(sizes) and started else []
    if not layout.overlap_grad_reduce:
        return Buckets([], filling)
    done = (sizes if previous_microbatch else []) + sizes[:complete]
    return Buckets(done[-MAX_IN_FLIGHT:], filling)


@dataclass(frozen=True)
class Transients:
    """Data-parallel bytes alive at one moment on top of the (sharded) state."""
    weights: float = 0.0        # gathered parameters, gloo's all-gather copies
    grads: float = 0.0          # gradient staging, reduce-scatter outputs, gloo's reduce-scatter copies

    @property
    def total(self) -> float:
        return self.weights + self.grads


def data_parallel_transients(workload: Workload, layout: Layout, pp_rank: int, kernels: Kernels,
                             moment: str, depth: int = 0) -> Transients:
    """What data parallelism holds at ``moment``: "layer" (backward through the MLP of the stage's
    ``depth``-th layer from the top: linear_fc2's gradients are in), "head" (the loss and the output
    layer's backward, last stage) or "step" (after the last backward, when the full gradient buffer is
    reduced, and after the optimizer step, when parameters are gathered). d data-parallel ranks, e
    bytes per parameter:

    - ZeRO-2/3 reduce every micro-batch's gradients per bucket (``buckets_at``): a full-size fp32
      staging tensor lives from the bucket's first gradient to the end of its reduce-scatter, whose
      output chunk (1/d) lives while it runs (gloo: with copies of (d-1)/d of the input).
    - ZeRO-3 gathers each unit just in time: a layer's parameters while backward runs through it, the
      head's (with tied embeddings on the same stage, the embedding's too) during the loss; with
      --overlap-param-gather the next unit of backward is prefetched, an all-gather in flight (gloo:
      through a copy of its output). The embedding is not gathered for backward.
    - no_shard / ZeRO-1 reduce the full gradient buffer in place; gloo's ZeRO-1 reduce-scatters copy
      (d-1)/d of each bucket in flight (during the last micro-batch's backward with
      --overlap-grad-reduce, else after it, MAX_IN_FLIGHT at a time). ZeRO-1/2 all-gather the updated
      parameters in place after the step (gloo: through copies of up to MAX_IN_FLIGHT buckets with
      --overlap-param-gather, one at a time without).
    """
    d, e = layout.shards, workload.dtype_bytes
    if d == 1 or (moment == "step" and layout.sharding == "optim_grads_params"):
        return Transients()
    copies = kernels.collective_copies
    params = stage_parameters(workload, layout, pp_rank)
    layer = layer_parameters(workload.model, layout.tp)
    tensors = backward_tensors(workload, layout, pp_rank)
    arrived = 0                               # gradients of this micro-batch's backward in by the moment
    if moment == "layer":
        head_tensors = sum(1 for t in tensors if t.unit == 0) if params.head else 0
        fc2_tensors = 2 if workload.model.add_bias_linear else 1
        arrived = head_tensors + depth * len(layer_tensors(workload.model, layout.tp)) + fc2_tensors
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
        reducing = buckets_at(workload, layout, pp_rank, arrived, False, False).reducing
        return Transients(0.0, reduce_scatter_copies(reducing))

    many = layout.num_microbatches(workload.global_batch_size) > 1
    alive = buckets_at(workload, layout, pp_rank, arrived, True, many)
    grads = GRAD_BYTES * (sum(alive.filling) + sum(n * (1 + 1 / d) for n in alive.reducing))
    grads += reduce_scatter_copies(alive.reducing)
    weights = 0.0
    if layout.sharding == "optim_grads_params":
        tied_here = params.embedding and params.head and not workload.model.untie_embeddings_and_output_weights
        head = params.head + (params.embedding if tied_here else 0)
        weights = e * (layer if moment == "layer" else head)
        layers_below = sum(rank_layers(workload, layout, pp_rank)) - (depth + 1 if moment == "layer" else 0)
        if layout.overlap_param_gather and layers_below > 0:
            weights += e * layer * (2 if copies else 1)                         # the prefetched layer
    return Transients(weights, grads)


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
    """Peak bytes on one device of pipeline rank ``pp_rank`` (every TP and DP rank of a stage alike):
    the (sharded) state, plus the fullest moment of a step. Backward through a layer (recomputed
    first under full recomputation) and, on the last stage, the loss and the output layer's
    backward come with every in-flight micro-batch's kept activations; after the last backward only
    the state is left, with the data-parallel reductions and gathers (``data_parallel_transients``)."""
    params = stage_parameters(workload, layout, pp_rank)
    per_weight, per_grad, per_optimizer = state_bytes_per_parameter(workload.dtype_bytes, layout.sharding,
                                                                    layout.shards)
    per_weight *= 1 + weight_versions(layout, pp_rank, layout.num_microbatches(workload.global_batch_size))
    kept = kept_activations(workload, layout, pp_rank, kernels)
    through_layer = layer_backward_bytes(workload, layout, kernels)
    if layout.recompute == "full":
        through_layer += layer_activation_bytes(workload, dataclasses.replace(layout, recompute="none"), kernels)
    # backward through the chunk's top layers: each one deeper has freed a layer's activations, but may
    # have more data-parallel reductions in flight (beyond MAX_IN_FLIGHT layers nothing changes)
    layers_per_chunk = max(rank_layers(workload, layout, pp_rank))
    freed = layer_activation_bytes(workload, layout, kernels)
    moments = [(kept - depth * freed + through_layer,
                data_parallel_transients(workload, layout, pp_rank, kernels, "layer", depth))
               for depth in range(min(layers_per_chunk, MAX_IN_FLIGHT + 1))]
    moments.append((0.0, data_parallel_transients(workload, layout, pp_rank, kernels, "step")))
    if holds_head(layout, pp_rank):
        moments.append((kept + sum(output_layer_bytes(workload, layout, kernels)),
                        data_parallel_transients(workload, layout, pp_rank, kernels, "head")))
    activations, transients = max(moments, key=lambda moment: moment[0] + moment[1].total)
    return Memory(params.total * per_weight + transients.weights, params.total * per_grad + transients.grads,
                  params.total * per_optimizer, activations)


def weight_versions(layout: Layout, pp_rank: int, num_microbatches: int) -> int:
    """Weight versions a rank keeps beyond its live weights (pipedream.py's weight stashing): PipeDream
    one per update its oldest in-flight micro-batch is behind, ceil((p - 1 - rank) / m) (p - 1 on the first
    stage at m = 1, PipeDream's original); PipeDream-2BW one. Counted in the compute dtype."""
    if layout.pp == 1 or layout.schedule not in ASYNC_SCHEDULES:
        return 0
    return versions_behind(layout.schedule, layout.pp, pp_rank, num_microbatches)


def estimate_memory(workload: Workload, layout: Layout, kernels: Kernels = GPU_KERNELS) -> Memory:
    """The device that needs the most: the largest of the pipeline ranks."""
    return max((rank_memory(workload, layout, r, kernels) for r in outer_ranks(layout)), key=lambda m: m.total)


def outer_ranks(layout: Layout) -> set[int]:
    """The pipeline ranks that can need the most: with even stages the first (most micro-batches in
    flight, the embeddings) and the last (the output layer and the logits), the ranks between hold
    less; with uneven stages or a V placement, any of them."""
    if layout.split != SplitFlags() or layout.schedule == "zbv":
        return set(range(layout.pp))
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
    imbalance: float = 0.0        # the slowest pipeline stage's time beyond the mean stage's
    context_parallel: float = 0.0     # ring attention's K/V traffic not hidden behind attention

    @property
    def total(self) -> float:
        return (self.compute + self.imbalance + self.bubble + self.tensor_parallel + self.context_parallel
                + self.pipeline_parallel + self.data_parallel)


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


def bubble_fraction(layout: Layout, num_microbatches: int) -> float:
    """Idle time of a step as a share of the slowest stage's busy time (REFERENCE §6): (p-1)/(v*m) for
    GPipe, 1F1B and interleaved 1F1B; ZB-H1 (p-1)/(3m) and ZB-V none, with F, B and W equally long
    (Qi et al. 2024); PipeDream and PipeDream-2BW never flush, their fill is paid once per run."""
    p, m = layout.pp, num_microbatches
    if p == 1 or layout.schedule == "zbv" or layout.schedule in ASYNC_SCHEDULES:
        return 0.0
    if layout.schedule == "zb-h1":
        return (p - 1) / (3 * m)
    return (p - 1) / (layout.vpp * m)


def stage_busy_seconds(workload: Workload, layout: Layout, hardware: Hardware) -> list[float]:
    """Seconds each pipeline rank computes in one step: its layers' FLOPs (recomputation included), the
    output layer's on the rank with the last stage, over the stage's tp x cp x dp devices at peak x
    efficiency; plus the loss, which is memory-bound: LOSS_BYTES_PER_LOGIT over the HBM bandwidth for
    each of the rank's fp32 logits (tokens / (dp x cp) x vocabulary / tp)."""
    model = dataclasses.replace(workload.model, padded_vocab_size=workload.padded_vocab(layout.tp))
    model_flops, flops = hardware_flops(workload, layout)
    head = flops_per_iteration(dataclasses.replace(model, num_layers=0), workload.global_batch_size)
    per_layer = (flops - head) / model.num_layers
    rate = layout.tp * layout.cp * layout.dp * hardware.peak_flops(workload.precision) * hardware.compute_efficiency
    logits = workload.global_batch_size * model.seq_length / (layout.dp * layout.cp) * model.padded_vocab_size / layout.tp
    loss = LOSS_BYTES_PER_LOGIT * logits / (hardware.memory_gbps * 1e9)
    busy = []
    for rank in range(layout.pp):
        seconds = sum(rank_layers(workload, layout, rank)) * per_layer / rate
        if holds_head(layout, rank):
            seconds += head / rate + loss
        busy.append(seconds)
    return busy


def step_time(workload: Workload, layout: Layout, hardware: Hardware) -> StepTime:
    """compute: the mean stage's busy time (every device's share of the work); imbalance: what the slowest
    stage adds to it (the others wait for it every micro-batch); bubble: the schedule's idle share of the
    slowest stage's time; then tensor-, context-, pipeline- and data-parallel traffic."""
    model, e = workload.model, workload.dtype_bytes
    m = layout.num_microbatches(workload.global_batch_size)
    model_flops, _ = hardware_flops(workload, layout)
    busy = stage_busy_seconds(workload, layout, hardware)
    compute, slowest = sum(busy) / len(busy), max(busy)
    bubble = slowest * bubble_fraction(layout, m)
    layers = max(sum(rank_layers(workload, layout, r)) for r in range(layout.pp))

    # TP: per layer and micro-batch 2 all-reduces of [s/cp, b, h] forward and 2 backward (with SP the
    # same volume as all-gathers + reduce-scatters); full recomputation repeats the forward ones
    tokens, _ = token_counts(workload, layout)
    activation = tokens * model.hidden_size * e
    collectives = 4 + (2 if layout.recompute == "full" else 0)
    tp_bytes = collectives * ring_bytes("all_reduce", activation, layout.tp) * layers * m
    tensor_parallel = tp_bytes / link_bandwidth(hardware, layout.tp)

    # CP: ring attention passes the rank's K and V cp - 1 times forward, K, V and their gradients cp - 1
    # times backward, per layer and micro-batch, each step behind a block of attention compute
    context_parallel = 0.0
    if layout.cp > 1:
        _, groups = local_attention_heads(model, layout.tp)
        kv = tokens * 2 * groups * model.kv_channels * e
        seconds = 3 * (layout.cp - 1) * kv * layers * m / link_bandwidth(hardware, layout.tp * layout.cp)
        heads, _ = local_attention_heads(model, layout.tp)
        attention_flops = 3 * 4 * model.seq_length * heads * model.kv_channels * tokens * layers * m
        attention = attention_flops / (hardware.peak_flops(workload.precision) * hardware.compute_efficiency)
        context_parallel = max(0.0, seconds - attention)

    # PP: each chunk of each micro-batch sends its activation forward and receives a gradient back
    boundary = activation / (layout.tp if layout.sp else 1)
    pp_bytes = 2 * boundary * m * layout.vpp if layout.pp > 1 else 0.0
    pipeline_parallel = pp_bytes / link_bandwidth(hardware, layout.num_gpus)

    data_parallel = exposed_data_parallel_time(workload, layout, hardware, compute)
    return StepTime(compute, bubble, tensor_parallel, pipeline_parallel, data_parallel, model_flops,
                    imbalance=slowest - compute, context_parallel=context_parallel)


def exposed_data_parallel_time(workload: Workload, layout: Layout, hardware: Hardware, compute: float) -> float:
    """Gradient reduction and parameter gathers (ring formulas, fp32 gradients) that do not overlap.

    Bytes per rank, Psi parameters on the rank: no_shard all-reduce 2(d-1)/d * 4Psi; ZeRO-1
    reduce-scatter (d-1)/d * 4Psi + all-gather (d-1)/d * e*Psi; ZeRO-2 reduce-scatters every
    micro-batch; ZeRO-3 gathers parameters in forward and backward of every micro-batch. With
    --overlap-grad-reduce (recommended) the reduction runs during the last micro-batch's compute, or
    during every micro-batch's for ZeRO-2/3, which communicate each one."""
    d, m = layout.shards, layout.num_microbatches(workload.global_batch_size)
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
    seconds = sent / link_bandwidth(hardware, layout.tp * d)   # (the dp x cp group spans tp x cp x dp ranks)
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
    m = layout.num_microbatches(workload.global_batch_size)
    if layout.schedule == "zbv" and layout.vpp != 2:
        return "--pipeline-schedule zbv places exactly two model chunks per pipeline rank"
    if layout.schedule not in ("1f1b", "zbv") and layout.vpp > 1:
        return f"--pipeline-schedule {layout.schedule} runs one model chunk per pipeline rank"
    try:
        check_attention_split(model.num_attention_heads, model.num_query_groups, layout.tp)
        recompute = None if layout.recompute == "none" else layout.recompute
        check_zero_bubble(parallel_config(workload, layout), dataclasses.replace(model, recompute_granularity=recompute))
        check_pipeline_split(model.num_layers, layout.pp, None, m,
                             schedule_split(split_flags(workload, layout), layout.schedule))
        stage_layers(layout, model.num_layers)
    except UserError as error:
        return str(error)
    if layout.schedule in ASYNC_SCHEDULES:
        if layout.pp == 1 or layout.cp > 1 or layout.sharding == "optim_grads_params":
            return f"--pipeline-schedule {layout.schedule} needs pp > 1, no context parallelism and no ZeRO-3"
        if layout.overlap_param_gather and layout.sharding != "no_shard" and layout.shards > 1:
            return f"--pipeline-schedule {layout.schedule} needs the weights in place after the step: no --overlap-param-gather"
        if layout.schedule == "pipedream-2bw" and m < layout.pp - 1:
            return f"--pipeline-schedule pipedream-2bw needs at least pp - 1 = {layout.pp - 1} micro-batches"
    if layout.cp > 1 and model.seq_length % (2 * layout.cp * (layout.tp if layout.sp else 1)):
        return (f"--context-parallel-size {layout.cp} needs --seq-length {model.seq_length} divisible by 2 x cp"
                + (" x TP" if layout.sp else ""))
    if layout.cp > 1 and model.attention_dropout > 0:
        return f"--context-parallel-size {layout.cp} needs --attention-dropout 0"
    if model.ffn_hidden_size % layout.tp:
        return f"--ffn-hidden-size {model.ffn_hidden_size} is not divisible by TP {layout.tp}"
    if layout.sp and model.seq_length % layout.tp:
        return f"--sequence-parallel needs --seq-length {model.seq_length} divisible by TP {layout.tp}"
    if layout.shards == 1 and layout.sharding != "no_shard":
        return f"--data-parallel-sharding-strategy {layout.sharding} shards nothing at data-parallel size 1"
    return None


def parallel_config(workload: Workload, layout: Layout) -> ParallelConfig:
    """The ParallelConfig pretrain_gpt.py builds for ``layout`` (for megalite's own checks)."""
    split = split_flags(workload, layout)
    return ParallelConfig(
        world_size=layout.num_gpus, tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp, num_layers_per_virtual_pipeline_stage=split.layers_per_virtual_stage,
        num_virtual_stages_per_pipeline_rank=split.virtual_stages_per_rank,
        decoder_first_pipeline_num_layers=split.first, decoder_last_pipeline_num_layers=split.last,
        account_for_embedding_in_pipeline_split=split.account_for_embedding,
        account_for_loss_in_pipeline_split=split.account_for_loss, pipeline_model_parallel_layout=split.layout,
        sequence_parallel=layout.sp, pipeline_schedule=layout.schedule,
        use_distributed_optimizer=layout.sharding != "no_shard", data_parallel_sharding_strategy=layout.sharding)


def split_flags(workload: Workload, layout: Layout) -> SplitFlags:
    """The split flags pretrain_gpt.py gets for ``layout`` (virtual stages named the way Megatron wants:
    --num-virtual-stages-per-pipeline-rank with first/last counts, else --num-layers-per-virtual-pipeline-stage)."""
    split = layout.split
    if layout.vpp == 1 or split.layout or layout.schedule == "zbv":
        return split
    if split.first is not None or split.last is not None:
        return dataclasses.replace(split, virtual_stages_per_rank=layout.vpp)
    extra = int(split.account_for_embedding) + int(split.account_for_loss)
    return dataclasses.replace(split, layers_per_virtual_stage=(workload.model.num_layers + extra) // (layout.pp * layout.vpp))


@dataclass(frozen=True)
class Pins:
    """Layout choices fixed by the user; None leaves a dimension to the search."""
    tp: int | None = None
    pp: int | None = None
    layers_per_virtual_stage: int | None = None
    micro_batch_size: int | None = None
    recompute: str | None = None
    sharding: str | None = None
    cp: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None           # --num-virtual-stages-per-pipeline-rank
    split: SplitFlags | None = None             # first/last counts, account-for flags or a layout string

    def allow(self, layout: Layout, num_layers: int) -> bool:
        extra = int(layout.split.account_for_embedding) + int(layout.split.account_for_loss)
        vpp_layers = (num_layers + extra) // (layout.pp * layout.vpp) if layout.vpp > 1 else None
        return all(pin is None or pin == value for pin, value in (
            (self.tp, layout.tp), (self.pp, layout.pp), (self.layers_per_virtual_stage, vpp_layers),
            (self.micro_batch_size, layout.micro_batch_size), (self.recompute, layout.recompute),
            (self.sharding, layout.sharding), (self.cp, layout.cp), (self.schedule, layout.schedule),
            (self.virtual_stages, layout.vpp), (self.split, layout.split)))

    FLAGS = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
             "layers_per_virtual_stage": "--num-layers-per-virtual-pipeline-stage",
             "micro_batch_size": "--micro-batch-size", "recompute": "--recompute-granularity",
             "sharding": "--data-parallel-sharding-strategy", "cp": "--context-parallel-size",
             "schedule": "--pipeline-schedule", "virtual_stages": "--num-virtual-stages-per-pipeline-rank"}

    def describe(self) -> str:
        pinned = [f"{self.FLAGS[name]} {getattr(self, name)}" for name in self.FLAGS if getattr(self, name) is not None]
        return " ".join(pinned + ([f"split {split_name(self.split)}"] if self.split is not None else []))


def candidate_splits(num_layers: int, pp: int) -> list[tuple[SplitFlags, list[int]]]:
    """(split, virtual-stage counts it allows) for pipeline size ``pp``: even when pp divides the layers;
    the embedding and the loss counted as layers when pp divides L + 2 (NVIDIA's Llama-3.1 405B recipe);
    otherwise the first and last stages take the remainder of an even split of the middle stages."""
    if pp == 1:
        return [(SplitFlags(), [1])]
    splits = []
    if num_layers % pp == 0:
        splits.append((SplitFlags(), divisors(num_layers // pp)))
    both = SplitFlags(account_for_embedding=True, account_for_loss=True)
    if (num_layers + 2) % pp == 0 and num_layers + 2 > pp:
        splits.append((both, divisors((num_layers + 2) // pp)))
    if num_layers % pp and pp > 2:
        middle = num_layers // pp + 1
        rest = num_layers - (pp - 2) * middle
        if rest >= 2:
            first, last = rest // 2, rest - rest // 2
            splits.append((SplitFlags(first=first, last=last), [v for v in divisors(middle) if first % v == last % v == 0]))
    elif num_layers % pp and num_layers > 1:
        splits.append((SplitFlags(first=num_layers // 2), [1]))
    return splits


def layouts_of(workload: Workload, num_gpus: int, pins: Pins = Pins()) -> Iterator[Layout]:
    """Every TP x CP x PP x DP split of ``num_gpus`` (CP as pinned, else 1), every split of the layers
    (``candidate_splits``, or the pinned one) with every virtual-stage count it allows, micro-batch size
    dividing GBS/DP, recomputation and sharding; sequence parallel on; the pinned schedule, else 1F1B."""
    layers, gbs = workload.model.num_layers, workload.global_batch_size
    cp = pins.cp or 1
    schedule = pins.schedule or "1f1b"
    for tp in divisors(num_gpus):
        if (num_gpus // tp) % cp:
            continue
        for pp in divisors(num_gpus // (tp * cp)):
            dp = num_gpus // (tp * cp * pp)
            if pins.split is not None:
                splits = [(pins.split, [len(virtual_stage_layers(layers, pp, pins.split)) // pp] if pins.split.layout
                           else [pins.virtual_stages or 1])]
            else:
                splits = candidate_splits(layers, pp)
            if schedule == "zbv":
                splits = [(split, [2]) for split, _ in splits]
            elif schedule != "1f1b":
                splits = [(split, [1]) for split, _ in splits]
            micro_batch_sizes = divisors(gbs // dp) if gbs % dp == 0 else [1]
            for split, vpps in splits:
                for vpp in vpps:
                    for mbs in micro_batch_sizes:
                        for recompute in RECOMPUTE:
                            for sharding in SHARDING_STRATEGIES:
                                yield Layout(tp, pp, dp, vpp, mbs, recompute, sharding, cp=cp, schedule=schedule,
                                             split=split, overlap_param_gather=schedule not in ASYNC_SCHEDULES
                                             or sharding == "no_shard" or dp * cp == 1)


def candidate_layouts(workload: Workload, hardware: Hardware, pins: Pins = Pins()) -> list[Layout]:
    """The layouts megalite accepts on ``hardware``, within ``pins``; a one-line UserError naming
    why when there is none."""
    try:
        pinned = [lay for lay in layouts_of(workload, hardware.num_gpus, pins)
                  if pins.allow(lay, workload.model.num_layers)]
    except UserError as error:              # a pinned split that does not fit the model
        raise UserError(f"no layout of {hardware.num_gpus} GPUs suits this model: {error}") from None
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
    split = split_flags(workload, layout)
    for flag, value in (("--num-layers-per-virtual-pipeline-stage", split.layers_per_virtual_stage),
                        ("--num-virtual-stages-per-pipeline-rank", split.virtual_stages_per_rank),
                        ("--decoder-first-pipeline-num-layers", split.first),
                        ("--decoder-last-pipeline-num-layers", split.last),
                        ("--pipeline-model-parallel-layout", split.layout)):
        if value is not None:
            flags += [flag, str(value)]
    flags += [flag for flag, on in (("--account-for-embedding-in-pipeline-split", split.account_for_embedding),
                                    ("--account-for-loss-in-pipeline-split", split.account_for_loss)) if on]
    if layout.schedule != "1f1b":
        flags += ["--pipeline-schedule", layout.schedule]
    if layout.cp > 1:
        flags += ["--context-parallel-size", str(layout.cp)]
    flags += ["--micro-batch-size", str(layout.micro_batch_size), "--global-batch-size", str(workload.global_batch_size)]
    if layout.recompute == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif layout.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    if layout.sharding == "optim":
        flags.append("--use-distributed-optimizer")
    elif layout.sharding != "no_shard":
        flags += ["--data-parallel-sharding-strategy", layout.sharding]
    if layout.shards > 1 and layout.overlap_grad_reduce:
        flags.append("--overlap-grad-reduce")
    if layout.shards > 1 and layout.sharding != "no_shard" and layout.overlap_param_gather:
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
    split = schedule_split(SplitFlags.of(par), par.pipeline_schedule)
    chunks = len(virtual_stage_layers(config.model.num_layers, par.pipeline_model_parallel_size, split)) \
        // par.pipeline_model_parallel_size
    split = dataclasses.replace(split, layers_per_virtual_stage=None,          # (the layout's vpp says it)
                                virtual_stages_per_rank=None)
    # arguments.py has padded the vocabulary for this TP size already: keep it as it is (pad to 1)
    model = dataclasses.replace(config.model, vocab_size=config.model.padded_vocab_size)
    workload = Workload(model, train.global_batch_size, precision, make_vocab_size_divisible_by=1)
    sharding, dp = par.data_parallel_sharding_strategy, par.data_parallel_size
    layout = Layout(par.tensor_model_parallel_size, par.pipeline_model_parallel_size, dp, chunks,
                    train.micro_batch_size, config.model.recompute_granularity or "none", sharding,
                    sequence_parallel=par.sequence_parallel or par.tensor_model_parallel_size == 1,   # (moot at TP=1)
                    overlap_grad_reduce=par.overlap_grad_reduce or dp * par.context_parallel_size == 1,  # (moot)
                    overlap_param_gather=par.overlap_param_gather or dp * par.context_parallel_size == 1
                    or sharding == "no_shard",
                    cp=par.context_parallel_size, schedule=par.pipeline_schedule, split=split)
    return workload, layout
