"""The planner's inputs and what a layout puts on each pipeline rank.

A ``Workload`` (the model as a ``ModelConfig``, the global batch, the precision, the MoE imbalance margin,
the update rule),
a ``Layout`` (TP x CP x PP x DP sizes, EP x ETP for the experts, virtual stages, micro-batch size,
recomputation, ZeRO sharding, schedule, stage split), the ``Hardware`` and the ``Kernels`` (what CUDA and CPU
builds keep differently). From them: the parameters of one transformer layer on one rank and the parameters
each pipeline rank holds, as megalite builds them (an MoE layer's experts split over EP and ETP, the rest of
it, router and shared expert, like a dense layer's MLP).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megalite.config.muon_fields import MuonFields
from megalite.config.schema import ModelConfig, padded_vocab_size
from megalite.config.pipeline_split import SplitFlags, virtual_stage_layers
from megalite.planning.deepseek import mla_tensors, mtp_depths, mtp_glue_tensors, needs_embedding_copy

GiB = 2 ** 30
HBM_GBPS = 3350.0       # H100 SXM HBM3, GB/s: the loss is memory-bound
PARAM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FP8_PEAK_OVER_BF16 = 2.0     # H100 / H200 dense FP8 tensor-core FLOP/s over bf16's (Hardware)
# Dropless routing sends each expert whatever the router picks, so the rank holding the busiest experts
# receives more rows than the mean T x k: its dispatched rows and expert activations are planned at this
# multiple of the mean. 1.2 is the headroom capacity-factor recipes give dropping routers (Switch
# Transformer trains at 1.0-1.25, Megatron's MoE examples at 1.0-1.2) for the load an auxiliary or
# bias-balanced router settles to; early training and unbalanced routers can exceed it (--moe-imbalance-margin).
MOE_IMBALANCE_MARGIN = 1.2


@dataclass(frozen=True)
class Workload:
    model: ModelConfig          # architecture; seq_length is the training sequence, vocab_size the true vocabulary
    global_batch_size: int
    precision: str = "bf16"     # "bf16", "fp16" or "fp32"
    make_vocab_size_divisible_by: int = 128
    moe_imbalance_margin: float = MOE_IMBALANCE_MARGIN   # busiest rank's dispatched rows / the mean (dropless)
    attended_fraction: float = 1.0    # share of causal attention's pairs kept (documents, windows: attention.py)
    cp_comm_types: tuple = ("p2p",)   # --cp-comm-type, one or one per layer
    cp_a2a_size: int | None = None    # a2a+p2p: the all-to-all's size (--hierarchical-context-parallel-sizes A B)
    optimizer: str = "adam"           # --optimizer: adam, or muon (planning/muon.py)
    muon: MuonFields = field(default_factory=MuonFields)    # --muon-* settings (an OptimizerConfig will do)
    fp8_param_gather: bool = False    # ZeRO gathers the FP8 layers' weights in FP8 (planning/fp8.py)

    @property
    def dispatch_margin(self) -> float:
        """Rows the busiest expert rank receives over the mean: a capacity factor bounds them (at most the
        factor's multiple, exactly it when padded to capacity); dropless routing gets the planner's margin,
        forced balancing (--moe-router-force-load-balancing, benchmarks) none."""
        if self.model.moe_router_force_load_balancing:
            return 1.0
        return self.model.moe_expert_capacity_factor or self.moe_imbalance_margin

    def cp_sizes(self, kind: str, cp: int) -> tuple[int, int, int]:
        """(all-to-all size, ring size, K/V all-gather size) of --cp-comm-type ``kind`` at context-parallel
        size ``cp`` (1: that part is not used)."""
        if kind == "a2a":
            return cp, 1, 1
        if kind == "allgather":
            return 1, 1, cp
        if kind == "a2a+p2p" and self.cp_a2a_size and cp % self.cp_a2a_size == 0:
            return self.cp_a2a_size, cp // self.cp_a2a_size, 1
        return 1, cp, 1

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
    ep: int = 1                      # expert parallel: whole experts of each MoE layer split over ep ranks
    etp: int | None = None           # expert tensor parallel: each expert's hidden dimension; None = tp
    instances: int = 1               # --num-distributed-optimizer-instances: ZeRO within shards / instances ranks

    @property
    def num_gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_shards(self) -> int:
        """EDP: the ranks of a pipeline stage holding the same expert weights, tp x cp x dp / (etp x ep)
        (parallel/mesh.py's expert grid); expert gradients are reduced, and sharded by ZeRO, over them."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def shards(self) -> int:
        """Ranks that hold the same parameters and reduce gradients together (Megatron: dp x cp)."""
        return self.dp * self.cp

    @property
    def zero_shards(self) -> int:
        """Ranks ZeRO splits the dense state over: DP x CP, or with hybrid sharding one instance's
        DP x CP / instances (the rest hold replicas of the same shards)."""
        return self.shards // self.instances

    @property
    def expert_zero_shards(self) -> int:
        """The same for MoE experts: EDP / instances."""
        return self.expert_shards // self.instances

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
        vpp += f" EP={self.ep}" if self.ep > 1 else ""
        vpp += f" ETP={self.etp}" if self.etp is not None else ""
        vpp += f" instances={self.instances}" if self.instances > 1 else ""
        off = [name for name, on in (("grad reduce", self.overlap_grad_reduce),
                                     ("param gather", self.overlap_param_gather)) if not on and self.dp > 1]
        overlap = f" (no overlapped {' or '.join(off)})" if off else ""
        return (f"TP={self.tp} PP={self.pp}{vpp} DP={self.dp} MBS={self.micro_batch_size} "
                f"recompute={self.recompute} sharding={self.sharding}{overlap}")


@dataclass(frozen=True)
class Hardware:
    """Defaults: H100 SXM nodes of 8 GPUs. NVLink 4 moves 450 GB/s per direction, NCCL reaches about
    360 GB/s of it; a 400 Gb/s NDR InfiniBand port per GPU is 50 GB/s, about 40 GB/s achieved.
    Peak dense TFLOP/s: 989 bf16/fp16, 67 fp32 (no TF32), FP8 ``FP8_PEAK_OVER_BF16`` times bf16's (NVIDIA's H100
    SXM datasheet: 1,979 dense FP8 TFLOP/s; the H200 has the same tensor cores). ``compute_efficiency`` is the share of peak
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
        """Dense FLOP/s of ``precision``'s GEMMs ("fp8": FP8 tensor cores; --peak-tflops is the bf16 peak)."""
        if precision == "fp8":
            return FP8_PEAK_OVER_BF16 * self.peak_flops("bf16")
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
      attention dropout, so CPU estimates with attention dropout require recomputation: selective
      recomputation recomputes exactly the math attention, and leaves a fused kernel alone).

    - embedding dropout (F.dropout): CUDA's native_dropout keeps a 1-byte mask; CPU keeps a noise
      tensor in the compute dtype.

    The transformer layers keep the same on both: megalite's RMSNorm keeps its input and an fp32 1/rms
    per token (CUDA's fused rms_norm kernel; on CPU its own autograd Function, since torch's composite
    CPU rms_norm would keep fp32 copies), and hidden dropout keeps a 1-byte mask (torch.native_dropout
    on both).

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



def token_counts(workload: Workload, layout: Layout) -> tuple[int, int]:
    """(tokens of one micro-batch on one context-parallel rank, the sequence-parallel share of them on one
    TP rank). Ring attention keeps what flash attention keeps, for the rank's 2 of 2cp chunks."""
    tokens = workload.model.seq_length * layout.micro_batch_size // layout.cp
    return tokens, tokens // layout.tp if layout.sp else tokens


def local_attention_heads(model: ModelConfig, tp: int) -> tuple[int, int]:
    """(query heads, KV groups) on one TP rank; with more TP ranks than KV heads each rank keeps a
    replica of its group's K and V (SelfAttention)."""
    return model.num_attention_heads // tp, max(1, model.num_query_groups // tp)


def layer_tensors(model: ModelConfig, tp: int, experts: tuple[int, int] | None = None) -> list[int]:
    """Sizes of one transformer layer's parameters on one rank, in TransformerLayer's order: input norm,
    linear_qkv (+ bias), linear_proj (+ bias, replicated), the q and k head norms (--qk-layernorm)
    (multi-latent attention: deepseek.mla_tensors),
    pre-MLP norm, then the MLP: linear_fc1 (+ bias),
    linear_fc2 (+ bias, replicated); or, for an MoE layer (``experts`` = (EP, ETP)), ``moe_tensors``."""
    h, d = model.hidden_size, model.kv_channels
    heads, groups = local_attention_heads(model, tp)
    qkv_rows = (heads + 2 * groups) * d
    norm = [h] * (norm_parameters(model) // h)
    bias = model.add_bias_linear
    head_norms = [d] * (2 * norm_parameters(model) // h) if model.qk_layernorm else []   # q and k, per head
    attention = [*norm, qkv_rows * h, *([qkv_rows] if bias or model.add_qkv_bias else []),
                 heads * d * h, *([h] if bias else []), *head_norms, *norm]
    if model.multi_latent_attention:
        attention = [*norm, *mla_tensors(model, tp), *norm]
    if experts is not None:
        return attention + moe_tensors(model, tp, *experts)
    ffn = model.ffn_hidden_size // tp
    fc1_rows = 2 * ffn if model.gated_linear_unit else ffn
    return attention + [fc1_rows * h, *([fc1_rows] if bias else []), ffn * h, *([h] if bias else [])]


def moe_tensors(model: ModelConfig, tp: int, ep: int, etp: int) -> list[int]:
    """An MoE layer's MLP on one rank (MoELayer, no biases): the router [E, h] (replicated), the rank's
    experts' stacked linear_fc1 [E/ep, 2f/etp, h] (f/etp without SwiGLU) and linear_fc2 [E/ep, h, f/etp],
    and the shared expert, an MLP tensor-parallel over tp, with its gate [1, h]."""
    h, f, E = model.hidden_size, model.expert_ffn_hidden_size, model.num_experts
    halves = 2 if model.gated_linear_unit else 1
    tensors = [E * h, E // ep * halves * (f // etp) * h, E // ep * h * (f // etp)]
    shared = (model.moe_shared_expert_intermediate_size or 0) // tp
    if shared:
        tensors += [halves * shared * h, shared * h] + ([h] if model.moe_shared_expert_gate else [])
    return tensors


def expert_parameters(model: ModelConfig, ep: int, etp: int) -> int:
    """Parameters of one MoE layer's experts on one rank (moe_tensors' two expert tensors)."""
    return sum(moe_tensors(model, 1, ep, etp)[1:3])


def layer_experts(model: ModelConfig, layout: "Layout", layer_number: int) -> tuple[int, int] | None:
    """(EP, ETP) of 1-based layer ``layer_number`` when it is an MoE layer, else None."""
    return (layout.ep, layout.expert_tp) if model.is_moe_layer(layer_number) else None


def layer_parameters(model: ModelConfig, tp: int, experts: tuple[int, int] | None = None) -> int:
    """Parameters of one transformer layer on one rank (TransformerLayer; ``layer_tensors``)."""
    return sum(layer_tensors(model, tp, experts))


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
    """Transformer layers of each virtual stage (config/pipeline_split.py), v = chunk * pp + rank."""
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


def rank_layer_numbers(workload: Workload, layout: Layout, pp_rank: int) -> list[range]:
    """The 1-based layer numbers of each model chunk of pipeline rank ``pp_rank`` (a virtual stage's
    layers follow the previous virtual stages', as build_model_chunks numbers them)."""
    layers = stage_layers(layout, workload.model.num_layers)
    starts = [sum(layers[:v]) for v in range(len(layers))]
    return [range(starts[v] + 1, starts[v] + layers[v] + 1) for v in virtual_stages_of(layout, pp_rank)]


def rank_moe_layers(workload: Workload, layout: Layout, pp_rank: int) -> int:
    """How many of pipeline rank ``pp_rank``'s layers are MoE layers."""
    if not workload.model.num_experts:
        return 0
    if workload.model.moe_layer_freq == 1:
        return sum(rank_layers(workload, layout, pp_rank))
    return sum(workload.model.is_moe_layer(n) for chunk in rank_layer_numbers(workload, layout, pp_rank)
               for n in chunk)


def holds_embedding(layout: Layout, pp_rank: int) -> bool:
    return 0 in virtual_stages_of(layout, pp_rank)


def holds_head(layout: Layout, pp_rank: int) -> bool:
    """Whether the rank holds the last virtual stage: final norm, output layer and loss."""
    return layout.pp * layout.vpp - 1 in virtual_stages_of(layout, pp_rank)


@dataclass(frozen=True)
class StageParameters:
    layers: int            # parameters in this rank's transformer layers (its experts' included)
    embedding: int         # word (+ position) embeddings, on the first stage
    head: int              # final norm + output layer, on the last stage
    experts: int = 0       # of ``layers``, the MoE experts' (replicated over EDP ranks, not DP)

    @property
    def total(self) -> int:
        return self.layers + self.embedding + self.head

    @property
    def dense(self) -> int:
        """Parameters replicated over the data-parallel ranks (everything but the experts)."""
        return self.total - self.experts


def stage_parameters(workload: Workload, layout: Layout, pp_rank: int) -> StageParameters:
    """Parameters on pipeline rank ``pp_rank`` of one rank (build_model_chunks / GPTModel): its
    layers (stage_layers; an MoE layer's experts those of the rank's EP and ETP ranks), the embeddings on the first stage, and on the last the final norm plus the
    output layer, which tied embeddings still need as a copy when the first stage is another chunk,
    and the multi-token prediction layers (deepseek.py)."""
    model, tp = workload.model, layout.tp
    vocab_rows = workload.padded_vocab(tp) // tp
    h = model.hidden_size
    count, moe = sum(rank_layers(workload, layout, pp_rank)), rank_moe_layers(workload, layout, pp_rank)
    layers = (count - moe) * layer_parameters(model, tp)
    experts = 0
    if moe:
        layers += moe * layer_parameters(model, tp, (layout.ep, layout.expert_tp))
        experts = moe * expert_parameters(model, layout.ep, layout.expert_tp)
    first, last = holds_embedding(layout, pp_rank), holds_head(layout, pp_rank)
    embedding = 0
    if first:
        embedding = vocab_rows * h + (0 if model.use_rope else model.max_position_embeddings * h)
    head = 0
    if last:
        head = norm_parameters(model)
        if model.untie_embeddings_and_output_weights or layout.pp > 1:     # (another chunk holds the embedding)
            head += vocab_rows * h
        mtp = mtp_depths(model)           # MTP layers of the last layer's kind, with their norms and eh_proj
        if mtp:
            experts_of_last = layer_experts(model, layout, model.num_layers)
            layers += mtp * layer_parameters(model, tp, experts_of_last)
            experts += mtp * expert_parameters(model, layout.ep, layout.expert_tp) if experts_of_last else 0
            head += mtp * sum(mtp_glue_tensors(model, tp))
            head += vocab_rows * h if needs_embedding_copy(model, layout.pp) else 0
    return StageParameters(layers, embedding, head, experts)


def count_parameters(workload: Workload) -> int:
    """Parameters of the whole model as one process builds it (padded vocabulary at TP=1)."""
    return stage_parameters(workload, Layout(), 0).total

