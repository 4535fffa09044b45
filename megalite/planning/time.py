"""Step time of a layout: compute, pipeline bubble and exposed communication.

Hardware FLOPs (model FLOPs of performance.flops_per_iteration, plus recomputation) over peak x an efficiency,
plus the pipeline bubble ((p-1)/(v*m) for 1F1B), plus tensor-, context-, pipeline- and data-parallel
traffic over the NVLink / InfiniBand bandwidth. Collectives move ring volumes: per rank an all-reduce
sends 2(n-1)/n of its buffer, an all-gather or a reduce-scatter (n-1)/n.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megalite.config.schema import ASYNC_SCHEDULES
from megalite.planning.inputs import Hardware, Layout, Workload, holds_head, local_attention_heads, rank_layers, stage_parameters
from megalite.planning.memory import GRAD_BYTES, outer_ranks, token_counts
from megalite.train.performance import flops_per_iteration

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

    @property
    def total(self) -> float:
        return (self.compute + self.imbalance + self.bubble + self.tensor_parallel + self.context_parallel
                + self.pipeline_parallel + self.data_parallel)


def hardware_flops(workload: Workload, layout: Layout) -> tuple[float, float]:
    """(model FLOPs, FLOPs actually run) of one iteration: recomputation runs forward again, the
    whole layer stack (full) or attention's scores and values, 4*s*nq*d per token and layer
    (selective; performance.flops_per_iteration's attention term)."""
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


