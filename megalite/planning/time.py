"""Step time of a layout: compute, pipeline bubble and exposed communication.

Hardware FLOPs (model FLOPs of performance.flops_per_iteration, plus recomputation) over peak x an efficiency,
plus the pipeline bubble ((p-1)/(v*m) for 1F1B), plus tensor-, context-, expert-, pipeline- and
data-parallel traffic over the NVLink / InfiniBand bandwidth. An MoE layer computes k experts' MLPs, its
shared expert's and its router's (performance.moe_extra_flops_per_token) and dispatches its tokens
(experts.dispatch_bytes), which nothing overlaps. Multi-latent attention's projections and head dimensions
replace the attention term, and each multi-token prediction depth adds a layer, eh_proj and a loss on the
last stage (deepseek.py). FP8 layers run their GEMMs at the FP8 peak and --fp8-param-gather gathers their
weights in FP8 (fp8.py). Muon's optimizer step adds its Newton-Schulz iterations and its TP gathers
(muon.py, ``muon_step_time``). Collectives move ring volumes: per rank an all-reduce
sends 2(n-1)/n of its buffer, an all-gather or a reduce-scatter (n-1)/n.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megalite.config.schema import ASYNC_SCHEDULES
from megalite.planning.deepseek import eh_proj_flops_per_token, mla_flops_correction, mtp_depths
from megalite.planning.experts import dispatch_bytes
from megalite.planning.fp8 import fp8_layer_numbers, gathered_bytes, layer_time_factor, rank_fp8_weights
from megalite.planning.inputs import (Hardware, Layout, Workload, holds_head, local_attention_heads, rank_layers,
                                      rank_moe_layers, stage_parameters, token_counts)
from megalite.planning.memory import GRAD_BYTES, memory_ranks
from megalite.planning.muon import optimizer_step_work
from megalite.train.performance import flops_per_iteration, mlp_flops_per_token, moe_extra_flops_per_token

LOSS_BYTES_PER_LOGIT = 20   # fp32 logits: written, read twice (max, sum of exp) in forward, read + written in backward


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
    expert_parallel: float = 0.0      # MoE token dispatch (all-to-all or all-gather), on the critical path
    newton_schulz: float = 0.0        # Muon's Newton-Schulz in the optimizer step, which nothing overlaps
    muon_gathers: float = 0.0         # Muon's TP collectives: duplicated mode's all-gathers, distributed's all-reduces

    @property
    def total(self) -> float:
        return (self.compute + self.imbalance + self.bubble + self.tensor_parallel + self.context_parallel
                + self.expert_parallel + self.pipeline_parallel + self.data_parallel + self.newton_schulz
                + self.muon_gathers)

    @property
    def communication(self) -> float:
        return (self.tensor_parallel + self.context_parallel + self.expert_parallel + self.pipeline_parallel
                + self.data_parallel + self.muon_gathers)


def moe_layer_extra_flops(workload: Workload, layout: Layout) -> tuple[float, float]:
    """(model FLOPs, FLOPs actually run) one MoE layer adds to a dense layer in one iteration (forward and
    backward, 3 x forward; full recomputation runs its forward again)."""
    model = workload.model
    if not model.num_experts:
        return 0.0, 0.0
    extra = 3.0 * moe_extra_flops_per_token(model) * workload.global_batch_size * model.seq_length
    return extra, extra * (4 / 3 if layout.recompute == "full" else 1)


def hardware_flops(workload: Workload, layout: Layout) -> tuple[float, float]:
    """(model FLOPs, FLOPs actually run) of one iteration: full recomputation runs the whole layer
    stack's forward again. Selective recomputation runs nothing again on a GPU: it recomputes only
    the math attention, and CUDA's fused attention kernels (flash, with or without dropout) keep no
    s x s scores, so the layer leaves them alone. MoE layers add ``moe_layer_extra_flops`` each."""
    model = dense_part(workload, layout)
    moe = workload.model
    moe_layers = sum(map(moe.is_moe_layer, range(1, moe.num_layers + 1))) if moe.num_experts else 0
    moe_model, moe_run = (moe_layers * x for x in moe_layer_extra_flops(workload, layout))
    model_flops, flops = _dense_hardware_flops(workload, layout, model)
    mtp_model, mtp_run = (x * mtp_depths(moe) for x in mtp_depth_flops(workload, layout))
    return model_flops + moe_model + mtp_model, flops + moe_run + mtp_run


def mtp_depth_flops(workload: Workload, layout: Layout) -> tuple[float, float]:
    """(model FLOPs, FLOPs run) of one MTP depth in one iteration: a layer of the last layer's kind, eh_proj,
    the output layer (full recomputation runs the layer's and eh_proj's forward again)."""
    model = dense_part(workload, layout)
    head = flops_per_iteration(dataclasses.replace(model, num_layers=0), workload.global_batch_size)
    layer_model, layer_run = ((x - head) / model.num_layers for x in _dense_hardware_flops(workload, layout, model))
    if workload.model.is_moe_layer(workload.model.num_layers):
        layer_model, layer_run = (a + b for a, b in zip((layer_model, layer_run), moe_layer_extra_flops(workload, layout)))
    eh = 3.0 * eh_proj_flops_per_token(model) * workload.global_batch_size * model.seq_length
    recompute = 4 / 3 if layout.recompute == "full" else 1
    return layer_model + eh + head, layer_run + eh * recompute + head


def dense_part(workload: Workload, layout: Layout):
    """The model with every layer dense (MoE layers' extra FLOPs are counted on their own), its vocabulary
    padded for the layout's TP."""
    return dataclasses.replace(workload.model, padded_vocab_size=workload.padded_vocab(layout.tp), num_experts=None)


def _dense_hardware_flops(workload: Workload, layout: Layout, model) -> tuple[float, float]:
    """(model FLOPs, FLOPs run) of ``model``'s layers and head; MLA's attention replaces the kv_channels
    formula's (deepseek.mla_flops_correction)."""
    model_flops = flops_per_iteration(model, workload.global_batch_size, workload.attended_fraction)
    model_flops += (3.0 * mla_flops_correction(model, workload.attended_fraction) * model.num_layers
                    * workload.global_batch_size * model.seq_length)
    if layout.recompute == "full":
        head_only = flops_per_iteration(dataclasses.replace(model, num_layers=0), workload.global_batch_size)
        return model_flops, model_flops + (model_flops - head_only) / 3
    return model_flops, model_flops


def context_parallel_time(workload: Workload, layout: Layout, hardware: Hardware, tokens: float) -> float:
    """Seconds of CP traffic on the critical path, over ``tokens`` = the rank's tokens x its layers x its
    micro-batches, averaged over the layers' --cp-comm-type. The ring (p2p) passes the rank's K and V
    cp - 1 times forward, K, V and their gradients cp - 1 times backward, each step behind a block of
    attention compute (the share of it the mask keeps). Ulysses (a2a) sends (cp - 1)/cp of q, k and v and
    gets the output back forward, the reverse backward, with nothing to hide behind. a2a+p2p: the
    all-to-all within A ranks (--hierarchical-context-parallel-sizes A B), then a ring of B over the
    all-to-all's head shards, which passes as many K/V bytes per step as the whole ring does. allgather:
    an all-gather of the whole sequence's K and V forward, again backward, and a reduce-scatter of the
    fp32 dK/dV, each (cp - 1)/cp of the whole per rank; the all-gathers hide behind the attention of the
    rank's own K/V (1/cp of its attention), the reduce-scatter behind nothing."""
    model, e, d = workload.model, workload.dtype_bytes, workload.model.kv_channels
    heads, groups = local_attention_heads(model, layout.tp)
    attention_flops = 3 * 4 * model.seq_length * heads * d * tokens * workload.attended_fraction
    attention = attention_flops / (hardware.peak_flops(workload.precision) * hardware.compute_efficiency)
    total = 0.0
    for kind in workload.cp_comm_types:
        a2a, ring, gather = workload.cp_sizes(kind, layout.cp)
        exchanged = tokens * (2 * heads + 2 * groups) * d * e
        total += 2 * ring_bytes("all_gather", exchanged, a2a) / link_bandwidth(hardware, layout.tp * a2a)
        passes = 3 * (ring - 1) * tokens * 2 * groups * d * e / link_bandwidth(hardware, layout.tp * layout.cp)
        total += max(0.0, passes - attention)
        whole_kv = gather * tokens * 2 * groups * d             # elements of the gathered K and V
        bandwidth = link_bandwidth(hardware, layout.tp * gather)
        total += max(0.0, 2 * ring_bytes("all_gather", whole_kv * e, gather) / bandwidth - attention / gather)
        total += ring_bytes("reduce_scatter", whole_kv * GRAD_BYTES, gather) / bandwidth     # dK/dV in fp32
    return total / len(workload.cp_comm_types)


def ring_bytes(kind: str, size_bytes: float, ranks: int) -> float:
    """Bytes each rank sends per collective on a ring: 2(n-1)/n of the buffer for an all-reduce, (n-1)/n
    for an all-gather or a reduce-scatter."""
    if ranks == 1:
        return 0.0
    factor = 2 * (ranks - 1) / ranks if kind == "all_reduce" else (ranks - 1) / ranks
    return factor * size_bytes


def link_bandwidth(hardware: Hardware, span: int) -> float:
    """Bytes/s of a group whose ranks lie within ``span`` consecutive global ranks."""
    gbps = hardware.intra_node_gbps if span <= hardware.gpus_per_node else hardware.inter_node_gbps
    return gbps * 1e9


def bubble_fraction(layout: Layout, num_microbatches: int) -> float:
    """Idle time of a step as a share of the slowest stage's busy time: (p-1)/(v*m) for
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
    output layer's on the rank with the last stage (an MoE layer's experts, shared expert and router
    beyond a dense layer's MLP added, its experts at the pace of the busiest expert rank, which gets
    ``Workload.dispatch_margin`` times the mean rows while the others wait for its outputs), over the stage's tp x cp x dp devices at peak x
    efficiency; plus the loss, which is memory-bound: LOSS_BYTES_PER_LOGIT over the HBM bandwidth for
    each of the rank's fp32 logits (tokens / (dp x cp) x vocabulary / tp)."""
    model = dense_part(workload, layout)
    _, flops = _dense_hardware_flops(workload, layout, model)
    head = flops_per_iteration(dataclasses.replace(model, num_layers=0), workload.global_batch_size)
    per_layer = (flops - head) / model.num_layers
    _, per_moe_layer = moe_layer_extra_flops(workload, layout)
    if workload.model.num_experts:      # the busiest expert rank's rows beyond the mean (experts.py)
        routed = mlp_flops_per_token(workload.model, model.expert_ffn_hidden_size) * workload.model.moe_router_topk
        per_moe_layer += ((workload.dispatch_margin - 1) * 3 * routed * workload.global_batch_size * model.seq_length
                          * (4 / 3 if layout.recompute == "full" else 1))
    rate = layout.tp * layout.cp * layout.dp * hardware.peak_flops(workload.precision) * hardware.compute_efficiency
    logits = workload.global_batch_size * model.seq_length / (layout.dp * layout.cp) * model.padded_vocab_size / layout.tp
    loss = LOSS_BYTES_PER_LOGIT * logits / (hardware.memory_gbps * 1e9)
    busy = []
    for rank in range(layout.pp):
        seconds = (sum(rank_layers(workload, layout, rank)) * per_layer
                   + rank_moe_layers(workload, layout, rank) * per_moe_layer) / rate
        seconds -= fp8_seconds_saved(workload, layout, hardware, rank, per_layer, per_moe_layer) / rate
        if holds_head(layout, rank):
            seconds += head / rate + loss + mtp_depths(workload.model) * (mtp_depth_flops(workload, layout)[1] / rate
                                                                          + loss)
        busy.append(seconds)
    return busy


def fp8_seconds_saved(workload: Workload, layout: Layout, hardware: Hardware, pp_rank: int, per_layer: float,
                      per_moe_layer: float) -> float:
    """FLOPs-at-the-model's-peak that pipeline rank ``pp_rank``'s FP8 layers save (fp8.layer_time_factor):
    a dense layer's GEMMs beyond core attention, an MoE layer's expert and shared-expert GEMMs too."""
    model = workload.model
    if not model.fp8_format:
        return 0.0
    recompute = 4 / 3 if layout.recompute == "full" else 1
    attention = (3 * 4 * model.seq_length * model.num_attention_heads * model.kv_channels * workload.attended_fraction
                 * workload.global_batch_size * model.seq_length * recompute)
    factor = layer_time_factor(workload, hardware, min(1.0, attention / per_layer))
    saved = 0.0
    for n in fp8_layer_numbers(workload, layout, pp_rank):
        moe = model.num_experts and model.is_moe_layer(n)
        saved += per_layer * (1 - factor) + (per_moe_layer * (1 - layer_time_factor(workload, hardware, 0.0))
                                             if moe else 0.0)
    return saved


def step_time(workload: Workload, layout: Layout, hardware: Hardware) -> StepTime:
    """compute: the mean stage's busy time (every device's share of the work); imbalance: what the slowest
    stage adds to it (the others wait for it every micro-batch); bubble: the schedule's idle share of the
    slowest stage's time; then tensor-, context-, expert-, pipeline- and data-parallel traffic."""
    model, e = workload.model, workload.dtype_bytes
    m = layout.num_microbatches(workload.global_batch_size)
    model_flops, _ = hardware_flops(workload, layout)
    busy = stage_busy_seconds(workload, layout, hardware)
    compute, slowest = sum(busy) / len(busy), max(busy)
    bubble = slowest * bubble_fraction(layout, m)
    layers = max(sum(rank_layers(workload, layout, r)) for r in range(layout.pp))

    # TP: per layer and micro-batch 2 all-reduces of [s/cp, b, h] forward and 2 backward (with SP the
    # same volume as all-gathers + reduce-scatters), half of them the MLP's: an MoE layer without a
    # shared expert routes its own tokens instead; full recomputation repeats the forward ones
    tokens, _ = token_counts(workload, layout)
    activation = tokens * model.hidden_size * e
    repeat = 1.5 if layout.recompute == "full" else 1.0
    routes_own = 0 if model.moe_shared_expert_intermediate_size else 1
    halves = max(2 * sum(rank_layers(workload, layout, r)) - routes_own * rank_moe_layers(workload, layout, r)
                 for r in range(layout.pp))
    tp_bytes = 2 * repeat * halves * ring_bytes("all_reduce", activation, layout.tp) * m
    tensor_parallel = tp_bytes / link_bandwidth(hardware, layout.tp)

    # EP: every MoE layer dispatches each micro-batch's tokens to the experts and back, forward and
    # backward (full recomputation dispatches forward again), over the EP x ETP ranks
    moe_layers = max(rank_moe_layers(workload, layout, r) for r in range(layout.pp))
    ep_bytes = dispatch_bytes(workload, layout) * repeat * moe_layers * m
    expert_parallel = ep_bytes / link_bandwidth(hardware, layout.ep * layout.expert_tp) if moe_layers else 0.0

    context_parallel = context_parallel_time(workload, layout, hardware, tokens * layers * m) if layout.cp > 1 else 0.0

    # PP: each chunk of each micro-batch sends its activation forward and receives a gradient back
    boundary = activation / (layout.tp if layout.sp else 1)
    pp_bytes = 2 * boundary * m * layout.vpp if layout.pp > 1 else 0.0
    pipeline_parallel = pp_bytes / link_bandwidth(hardware, layout.num_gpus)

    data_parallel = exposed_data_parallel_time(workload, layout, hardware, compute)
    newton_schulz, muon_gathers = muon_step_time(workload, layout, hardware)
    return StepTime(compute, bubble, tensor_parallel, pipeline_parallel, data_parallel, model_flops,
                    imbalance=slowest - compute, context_parallel=context_parallel, expert_parallel=expert_parallel,
                    newton_schulz=newton_schulz, muon_gathers=muon_gathers)


def muon_step_time(workload: Workload, layout: Layout, hardware: Hardware) -> tuple[float, float]:
    """(Newton-Schulz seconds, TP collective seconds) of Muon's optimizer step on the pipeline rank that
    takes longest (muon.optimizer_step_work): the step runs after the last backward and before the
    parameters go out, so nothing hides it. Newton-Schulz runs at the bf16 peak (--muon-fp32-matmul-prec
    medium) or the fp32 one, x the compute efficiency; duplicated mode's gathers move (tp-1)/tp of each fp32
    matrix per rank, distributed mode's Gram all-reduces 2(tp-1)/tp of each fp32 Gram matrix."""
    if workload.optimizer != "muon":
        return 0.0, 0.0
    precision = "bf16" if workload.muon.muon_fp32_matmul_prec == "medium" else "fp32"
    rate = hardware.peak_flops(precision) * hardware.compute_efficiency
    slowest = (0.0, 0.0)
    for rank in range(layout.pp):
        flops, gathered, reduced = optimizer_step_work(workload, layout, rank)
        moved = ring_bytes("all_gather", gathered, layout.tp) + ring_bytes("all_reduce", reduced, layout.tp)
        seconds = (flops / rate, moved / link_bandwidth(hardware, layout.tp))
        slowest = max(slowest, seconds, key=sum)
    return slowest


def exposed_data_parallel_time(workload: Workload, layout: Layout, hardware: Hardware, compute: float) -> float:
    """Gradient reduction and parameter gathers (ring formulas, fp32 gradients) that do not overlap.

    Bytes per rank, Psi parameters on the rank: no_shard all-reduce 2(d-1)/d * 4Psi; ZeRO-1
    reduce-scatter (d-1)/d * 4Psi + all-gather (d-1)/d * e*Psi; ZeRO-2 reduce-scatters every
    micro-batch; ZeRO-3 gathers parameters in forward and backward of every micro-batch. With
    --overlap-grad-reduce (recommended) the reduction runs during the last micro-batch's compute, or
    during every micro-batch's for ZeRO-2/3, which communicate each one. MoE experts are reduced (and
    sharded) over their EDP group instead, of the same span. Hybrid sharding (K instances): those
    collectives run within an instance of s = d/K consecutive ranks (its own, often intra-node, span),
    and every reduce-scatter's 1/s shard is then all-reduced across the K instances over the whole span
    (``replica_all_reduce_bytes``)."""
    m = layout.num_microbatches(workload.global_batch_size)
    params = [stage_parameters(workload, layout, r) for r in memory_ranks(workload, layout)]
    seconds = 0.0
    fp8 = [rank_fp8_weights(workload, layout, r) for r in memory_ranks(workload, layout)]    # (dense, experts)
    span = layout.tp * layout.shards                 # the stage's tp x cp x dp ranks
    for psi, fp8_psi, s in ((max(p.dense for p in params), max(f[0] for f in fp8), layout.zero_shards),
                            (max(p.experts for p in params), 0, layout.expert_zero_shards)):   # experts: own dtype
        sent = data_parallel_bytes(workload, layout.sharding, psi, s, m, fp8_psi)
        seconds += sent / link_bandwidth(hardware, span // layout.instances)
        seconds += replica_all_reduce_bytes(layout.sharding, psi, s, layout.instances, m) / link_bandwidth(hardware, span)
    if seconds == 0.0:
        return 0.0
    overlap_window = compute if layout.sharding in ("optim_grads", "optim_grads_params") else compute / m
    return max(0.0, seconds - overlap_window)


def replica_all_reduce_bytes(sharding: str, psi: int, s: int, instances: int, m: int) -> float:
    """Bytes a rank sends in one step to all-reduce its reduced gradient shards (4 psi / s bytes per
    reduction) across ``instances`` (hybrid sharding); one reduction per step, per micro-batch under
    ZeRO-2/3."""
    if instances == 1 or psi == 0:
        return 0.0
    reductions = m if sharding in ("optim_grads", "optim_grads_params") else 1
    return reductions * ring_bytes("all_reduce", GRAD_BYTES * psi / s, instances)


def data_parallel_bytes(workload: Workload, sharding: str, psi: int, d: int, m: int, fp8_psi: int = 0) -> float:
    """Bytes a rank sends in one step to reduce the gradients of ``psi`` parameters over ``d`` ranks and
    gather them back (``exposed_data_parallel_time``); ``fp8_psi`` of them FP8 weights, which
    --fp8-param-gather gathers in FP8 (fp8.gathered_bytes)."""
    if d == 1 or psi == 0:
        return 0.0
    grads, params = GRAD_BYTES * psi, gathered_bytes(workload, psi, fp8_psi)
    if sharding == "no_shard":
        return ring_bytes("all_reduce", grads, d)
    if sharding == "optim":
        return ring_bytes("reduce_scatter", grads, d) + ring_bytes("all_gather", params, d)
    if sharding == "optim_grads":
        return m * ring_bytes("reduce_scatter", grads, d) + ring_bytes("all_gather", params, d)
    return m * ring_bytes("reduce_scatter", grads, d) + 2 * m * ring_bytes("all_gather", params, d)
