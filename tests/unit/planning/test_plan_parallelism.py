"""The parallelism planner (megalite/planning, tools/plan_parallelism.py).

The key check: the planner's memory estimate against the peak memory of real megalite training
(build_trainer + train_step, gloo ranks) at ten layouts - serial fp32; serial bf16 with full
recomputation; TP=2 with sequence parallelism; PP=2 1F1B; PP=2 interleaved; DP=2 with the
distributed optimizer in bf16; DP=2 ZeRO-3; and an MoE model (4 experts, top-2, evenly routed:
--moe-router-force-load-balancing, so the dropless margin is 1) at EP=2 x TP=2 with the alltoall
dispatcher, with ZeRO-1 sharding its experts over EDP=2, and at EP=2 with the allgather dispatcher, a
gated shared expert and ZeRO-3 - within 15% on every rank.

Memory is measured at the allocator, independently of the planner: torch.profiler with
profile_memory=True records every allocation and free of torch's CPU allocator (address, bytes,
time). Profiling starts before the model is built, so parameters, gradients and optimizer state
count; the measurement is the most bytes held at once during the training steps (initialisation's
temporaries come before). The estimate uses inputs.CPU_KERNELS, the CPU build's kernels and
collectives (its embedding dropout keeps a noise tensor, gloo copies through temporaries, see
inputs.Kernels); everything else is the same formula the command line uses for GPUs.
"""
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

from harness import run_ranks
from megalite_test_utils import ROOT, TINY_GPT2_ARGS, TINY_LLAMA_ARGS, with_flags
from megalite.checkpoint.hf_config import read_hf_config_file
from megalite.config.pipeline_split import SplitFlags
from megalite.planning import flags as plan_flags
from megalite.planning import buckets, inputs, memory, search
from megalite.planning import time as timing
from megalite.config.schema import SHARDING_STRATEGIES

sys.path.insert(0, os.path.join(ROOT, "tools"))

# 4 layers, hidden 256, GQA 4 heads / 2 groups, SwiGLU 704, seq 256, vocab 1024 (1023 + eod: no padding)
MEASURED_MODEL = with_flags(TINY_LLAMA_ARGS, num_layers=4, hidden_size=256, num_attention_heads=4,
                            num_query_groups=2, ffn_hidden_size=704, seq_length=256, max_position_embeddings=256,
                            vocab_size=1023, micro_batch_size=2, global_batch_size=4, train_iters=2)
# 4 experts of 352 (each half the dense MLP's 704), top-2, routed evenly
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "352",
       "--moe-token-dispatcher-type", "alltoall", "--moe-router-force-load-balancing"]
SERIAL_LAYOUTS = {
    "serial fp32": [],
    "serial bf16, full recompute": ["--bf16", "--recompute-granularity", "full", "--recompute-method", "uniform"],
}
TWO_RANK_LAYOUTS = {
    "TP=2 + SP fp32": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "PP=2 1F1B fp32, 4 micro-batches": ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"],
    "DP=2 distributed optimizer bf16": ["--use-distributed-optimizer", "--bf16", "--global-batch-size", "8"],
    "PP=2 interleaved x2 fp32, 4 micro-batches": ["--pipeline-model-parallel-size", "2",
                                                  "--num-layers-per-virtual-pipeline-stage", "1",
                                                  "--global-batch-size", "8"],
    "DP=2 ZeRO-3 fp32": ["--data-parallel-sharding-strategy", "optim_grads_params", "--global-batch-size", "8"],
    "MoE EP=2 x TP=2 (ETP=1) alltoall fp32": MOE + ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size",
                                                  "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
                                                  "--micro-batch-size", "4", "--global-batch-size", "8"],
    "MoE DP=2 ZeRO-1, experts over EDP=2, bf16": MOE + ["--use-distributed-optimizer", "--bf16",
                                                      "--global-batch-size", "8"],
    "MoE EP=2 allgather, gated shared expert, ZeRO-3 bf16": MOE + [
        "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather",
        "--moe-shared-expert-intermediate-size", "256", "--moe-shared-expert-gate",
        "--data-parallel-sharding-strategy", "optim_grads_params", "--bf16", "--micro-batch-size", "4",
        "--global-batch-size", "8"],
}
STEPS = 2
TOLERANCE = 0.15


# ---- measuring --------------------------------------------------------------------------------------
def peak_live_bytes(events: list[dict], window: str) -> int:
    """The most bytes held at once, during the ``window`` range, by blocks the CPU allocator handed out
    since profiling started: each ``[memory]`` event is an allocation (+bytes) or a free (-bytes) at
    an address. gloo frees some collective temporaries (clones of the input) on its worker threads,
    where the profiler records no free (and its running "Total Allocated" drifts upwards): those blocks
    are taken as freed when the collective that allocated them returns."""
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    collectives = [e for e in events if e.get("ph") == "X" and e["name"].startswith("c10d::")]
    start, end = next((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == window and e.get("ph") == "X")
    open_blocks, changes = {}, []                # address -> (allocated at, bytes); (time, +/- bytes)

    def close(address, ts):
        begin, held = open_blocks.pop(address)
        changes.extend([(begin, held), (ts, -held)])

    for event in memory:
        address, size, ts = event["args"]["Addr"], event["args"]["Bytes"], event["ts"]
        if size > 0:
            if address in open_blocks:           # handed out again: it was freed where no event was recorded
                close(address, ts)
            open_blocks[address] = (ts, size)
        elif address in open_blocks:             # (frees of blocks from before profiling have no allocation)
            close(address, ts)
    for address, (begin, _) in list(open_blocks.items()):
        returns = [c["ts"] + c["dur"] for c in collectives if c["ts"] <= begin <= c["ts"] + c["dur"]]
        close(address, min(returns) if returns else float("inf"))
    peak = held_now = 0
    for ts, delta in sorted(changes, key=lambda c: (c[0], c[1])):   # frees first at equal times
        held_now += delta
        if start <= ts <= end:
            peak = max(peak, held_now)
    return peak


def train_and_measure(argv: list[str], world_size: int) -> int:
    """Peak bytes held by this rank while megalite trains STEPS iterations at ``argv``'s layout."""
    import gc
    from torch.profiler import ProfilerActivity, profile, record_function
    from megalite.train.command_line import parse_args
    from megalite.data.tokenizers import build_tokenizer
    from megalite.train.trainer import build_data_iterators, build_trainer
    from megalite.train.step import train_step
    config = parse_args(argv, world_size=world_size)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = build_trainer(config)
        batches, _, _ = build_data_iterators(trainer, build_tokenizer(config.data))
        with record_function("training steps"):
            for _ in range(STEPS):
                train_step(trainer, batches)
        del trainer, batches                  # every block of the run is freed inside the session
        gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return peak_live_bytes(json.load(f)["traceEvents"], "training steps")


def _measure_all(rank: int, world: int) -> dict:
    """Rank r first trains the r-th of the two serial layouts alone (a world of one inside this
    process, both at once), then both ranks train each two-rank layout together."""
    out = {}
    name, flags = list(SERIAL_LAYOUTS.items())[rank]
    saved = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE")}
    os.environ.update(RANK="0", WORLD_SIZE="1")
    try:
        out[name] = {0: train_and_measure(MEASURED_MODEL + flags, 1)}
    finally:
        os.environ.update(saved)
    for name, flags in TWO_RANK_LAYOUTS.items():
        out[name] = {rank: train_and_measure(MEASURED_MODEL + flags, world)}
    return out


@pytest.fixture(scope="module")
def measured() -> dict:
    per_rank = run_ranks(2, _measure_all)
    merged: dict = {}
    for result in per_rank:
        for name, peaks in result.items():
            merged.setdefault(name, {}).update(peaks)
    return merged


def estimated(flags: list[str], world_size: int) -> list[int]:
    """The planner's peak bytes per rank (global rank order: tp fastest, then dp, then pp; every rank of a
    stage alike, the expert grid's included)."""
    from megalite.train.command_line import parse_args
    config = parse_args(MEASURED_MODEL + flags, world_size=world_size)
    workload, layout = plan_flags.workload_and_layout(config)
    per_stage = [memory.rank_memory(workload, layout, r, inputs.CPU_KERNELS).total for r in range(layout.pp)]
    return [per_stage[rank // (layout.tp * layout.dp)] for rank in range(world_size)]


def test_memory_estimate_within_15_percent_of_measured(measured):
    rows, failures = [], []
    for name, flags in {**SERIAL_LAYOUTS, **TWO_RANK_LAYOUTS}.items():
        world = 1 if name in SERIAL_LAYOUTS else 2
        for rank, estimate in enumerate(estimated(flags, world)):
            peak = measured[name][rank]
            error = estimate / peak - 1
            rows.append(f"{name:42s} rank {rank}: measured {peak / 2**20:7.1f} MiB  estimated "
                        f"{estimate / 2**20:7.1f} MiB  error {100 * error:+5.1f}%")
            if abs(error) > TOLERANCE:
                failures.append(rows[-1])
    print("\n" + "\n".join(rows))
    assert len(measured) >= 4 and not failures, "\n".join(failures)


# ---- parameters, and the formulas of the ZeRO paper and Korthikanti et al. ----------------------------
def _llama_workload() -> inputs.Workload:
    """Llama-3 8B's shape, seq 4096, global batch 64."""
    model = plan_flags.model_from_flags(32, 4096, 32, 128256, 4096, ffn_hidden_size=14336, num_query_groups=8,
                                      swiglu=True, position_embedding_type="rope", normalization="RMSNorm",
                                      add_bias_linear=False, untie_embeddings_and_output_weights=True,
                                      hidden_dropout=0.0, attention_dropout=0.0)
    return inputs.Workload(model, global_batch_size=64)


@pytest.mark.parametrize("tp,pp,vpp,pp_rank", [(1, 1, 1, 0), (2, 2, 1, 0), (2, 2, 2, 1), (4, 1, 1, 0), (8, 2, 2, 1)])
def test_parameters_per_rank_equal_megalites_sharded_model(tp, pp, vpp, pp_rank):
    """TP shards (KV heads replicated beyond 2 groups), pipeline stages, interleaved chunks, the tied
    output layer's copy on the last stage: the count of the chunks megalite builds for that rank."""
    from megalite.train.command_line import parse_args
    from megalite.model.chunks import build_model_chunks
    from megalite.parallel.tensor.layers import TensorParallel
    for untie in (True, None):
        argv = with_flags(TINY_LLAMA_ARGS, num_layers=8, num_attention_heads=8, num_query_groups=2, hidden_size=64,
                          ffn_hidden_size=128, untie_embeddings_and_output_weights=untie,
                          tensor_model_parallel_size=tp)
        model = parse_args(argv, world_size=tp).model
        chunks = build_model_chunks(model, 1, TensorParallel(rank=tp - 1, size=tp), pp_rank, pp, vpp)
        workload = inputs.Workload(dataclasses.replace(model, vocab_size=model.padded_vocab_size), 4,
                                     make_vocab_size_divisible_by=1)
        expected = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        layout = inputs.Layout(tp=tp, pp=pp, vpp=vpp)
        assert inputs.stage_parameters(workload, layout, pp_rank).total == expected


def test_state_bytes_per_parameter_follow_the_zero_formulas():
    d = 8
    zero = {s: sum(memory.state_bytes_per_parameter(2, s, d, grad_bytes=2)) for s in SHARDING_STRATEGIES}
    assert zero == pytest.approx({"no_shard": 16, "optim": 4 + 12 / d, "optim_grads": 2 + 14 / d,
                                  "optim_grads_params": 16 / d})
    # megalite (and Megatron's distributed optimizer) keep fp32 gradients: 18 B/param, 6 + 12/d
    assert sum(memory.state_bytes_per_parameter(2, "no_shard", d)) == 18
    assert sum(memory.state_bytes_per_parameter(2, "optim", d)) == pytest.approx(6 + 12 / d)
    # fp32 weights are their own master copy: 4 + 4 + 8
    assert sum(memory.state_bytes_per_parameter(4, "no_shard", d)) == 16


@pytest.mark.parametrize("sharding", ["optim", "optim_grads"])
def test_planned_buckets_are_the_gradient_buffers(sharding, monkeypatch):
    """The buckets the planner reasons about are grad_buffer.py's: whole parameters in backward order,
    closed at the bucket size, around a tied embedding and (ZeRO-2/3) at module-unit boundaries."""
    from megalite.train.command_line import parse_args
    from megalite.parallel.data.ddp import DistributedDataParallel
    from megalite.parallel.data.grad_buffer import ParamAndGradBuffer
    from megalite.model.chunks import build_model_chunks
    from megalite.parallel.tensor.layers import TensorParallel
    monkeypatch.setattr(buckets, "default_bucket_size", lambda dp, overlap: 6000 if overlap else None)
    for argv in (with_flags(TINY_LLAMA_ARGS, untie_embeddings_and_output_weights=None), TINY_LLAMA_ARGS,
                 TINY_GPT2_ARGS):            # tied, untied; biases, LayerNorm, learned positions
        for overlap in (True, False):
            model = parse_args(argv, world_size=1).model
            chunk = build_model_chunks(model, 1, TensorParallel(rank=0, size=1), 0, 1, 1)[0]
            wrapper = DistributedDataParallel.__new__(DistributedDataParallel)
            wrapper.models = [chunk]
            named, unit_of, _ = wrapper._collect_units()
            per_unit = sharding != "optim"
            buffer = ParamAndGradBuffer(named, 6000 if overlap else None, 0, 2, shard_grads=per_unit,
                                        units=unit_of if per_unit else None)
            workload = inputs.Workload(dataclasses.replace(model, vocab_size=model.padded_vocab_size), 4,
                                         make_vocab_size_divisible_by=1)
            layout = inputs.Layout(dp=2, sharding=sharding, overlap_grad_reduce=overlap)
            tensors = buckets.backward_tensors(workload, layout, 0)
            ends = buckets.buckets_of(tensors, layout, per_unit)
            planned = [sum(t.size for t in tensors[a:b]) for a, b in zip([0] + ends, ends)]
            assert planned == [sum(p.numel() for p in bucket.params) for bucket in buffer.buckets]


def test_zero_temporaries_follow_the_bucket_lifetimes_of_ddp():
    """ZeRO-2/3 stage a bucket's gradients only from its first gradient to the end of its
    reduce-scatter, so nothing grows with the number of micro-batches. Backward through a layer's
    MLP holds, without --overlap-grad-reduce, that
    layer's staging (one bucket per unit); with it (40M-element buckets) the MAX_IN_FLIGHT buckets
    completed last, each with its 1/d output: the previous layer's input norm and this layer's
    linear_fc2. ZeRO-3 adds the layer's gathered parameters and, with --overlap-param-gather, the
    prefetched next one."""
    workload, d, e = _llama_workload(), 8, 2
    h, ffn = workload.model.hidden_size, workload.model.ffn_hidden_size
    layer = inputs.layer_parameters(workload.model, 1)
    for sharding in ("optim_grads", "optim_grads_params"):
        plain = inputs.Layout(pp=4, dp=d, sharding=sharding, overlap_grad_reduce=False, overlap_param_gather=False)
        overlapped = dataclasses.replace(plain, overlap_grad_reduce=True, overlap_param_gather=True)
        state = inputs.stage_parameters(workload, plain, 1).total
        more_microbatches = dataclasses.replace(workload, global_batch_size=8 * workload.global_batch_size)
        for lay in (plain, overlapped):
            assert memory.rank_memory(workload, lay, 1) == memory.rank_memory(more_microbatches, lay, 1)
        assert memory.rank_memory(workload, plain, 1).grads == pytest.approx(4 * state / d + 4 * layer)
        assert memory.rank_memory(workload, overlapped, 1).grads == pytest.approx(
            4 * state / d + 4 * (h + ffn * h) * (1 + 1 / d))
        gathered = {"optim_grads": (state, state), "optim_grads_params": (state / d + layer, state / d + 2 * layer)}
        assert [memory.rank_memory(workload, lay, 1).weights for lay in (plain, overlapped)] == pytest.approx(
            [e * n for n in gathered[sharding]])


def test_pipeline_in_flight_micro_batches_and_bubble():
    one_f_one_b = inputs.Layout(pp=4, dp=2)
    assert [memory.chunks_in_flight(one_f_one_b, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert memory.chunks_in_flight(one_f_one_b, 0, 2) == 2          # fewer micro-batches than stages
    interleaved = inputs.Layout(pp=4, vpp=2, dp=2)
    layers_in_flight = memory.chunks_in_flight(interleaved, 0, 8) * 32 // (4 * 2)
    assert layers_in_flight == 32 * (1 + (4 - 1) / (4 * 2))             # L(1 + (p-1)/(pv)), Megatron's estimate
    workload, hardware = _llama_workload(), inputs.Hardware(8, 80)
    for layout in (one_f_one_b, interleaved, inputs.Layout(pp=8, vpp=4)):
        time = timing.step_time(workload, layout, hardware)
        m = layout.num_microbatches(workload.global_batch_size)
        # the bubble is a share of the slowest stage's busy time, the last (output layer and loss)
        assert time.bubble / (time.compute + time.imbalance) == pytest.approx((layout.pp - 1) / (layout.vpp * m))
    assert timing.step_time(workload, inputs.Layout(tp=8), hardware).bubble == 0


def test_uneven_splits_schedules_and_context_parallelism():
    """Llama-3.1 405B's 126 layers: the parameters per rank follow each rank's real layers; the slowest
    stage (the last: output layer and loss) sets the step, so counting the embedding and the loss as layers
    shrinks the imbalance; ZB-H1 keeps a third of 1F1B's bubble at its memory; PipeDream stashes weight
    versions; context parallelism halves the activations per rank."""
    model = plan_flags.model_from_flags(126, 16384, 128, 128256, 8192, ffn_hidden_size=53248, num_query_groups=8,
                                      swiglu=True, position_embedding_type="rope", normalization="RMSNorm",
                                      add_bias_linear=False, untie_embeddings_and_output_weights=True,
                                      hidden_dropout=0.0, attention_dropout=0.0)
    workload, hardware = inputs.Workload(model, 256), inputs.Hardware(1024, 80)
    both = SplitFlags(account_for_embedding=True, account_for_loss=True)
    first_last = SplitFlags(first=6, last=6)                  # 6 + 14 x 8 + 6 (still 126)
    balanced = inputs.Layout(tp=8, pp=16, dp=8, split=both, sharding="optim")
    heavy_last = inputs.Layout(tp=8, pp=16, dp=8, split=SplitFlags(first=6, last=8), sharding="optim")
    assert inputs.stage_layers(balanced, 126) == [7] + [8] * 14 + [7]
    layer = inputs.layer_parameters(model, 8)
    assert inputs.stage_parameters(workload, balanced, 0).layers == 7 * layer
    assert inputs.stage_parameters(workload, balanced, 5).layers == 8 * layer
    assert inputs.stage_layers(heavy_last, 126) == [6] + [8] * 14 + [8]
    t_balanced, t_heavy = (timing.step_time(workload, lay, hardware) for lay in (balanced, heavy_last))
    assert 0 < t_balanced.imbalance < t_heavy.imbalance and t_balanced.total < t_heavy.total
    assert search.layout_problem(workload, dataclasses.replace(balanced, split=first_last), 8) is not None  # 114/14
    # zero bubble: a third of 1F1B's bubble, 1F1B's activations
    zb = dataclasses.replace(balanced, schedule="zb-h1")
    assert timing.step_time(workload, zb, hardware).bubble == pytest.approx(t_balanced.bubble / 3)
    assert memory.estimate_memory(workload, zb).activations == memory.estimate_memory(workload, balanced).activations
    # PipeDream: ceil((p - 1 - rank) / m) older versions, p - 1 on the first stage at m = 1; 2BW one
    one = inputs.Workload(model, 8)
    for schedule, first_stage in (("pipedream", 15), ("pipedream-2bw", 1)):
        lay = dataclasses.replace(balanced, schedule=schedule)
        assert memory.weight_versions(lay, 0, lay.num_microbatches(one.global_batch_size)) == first_stage
        assert memory.rank_memory(one, lay, 0).weights == pytest.approx(
            (1 + first_stage) * memory.rank_memory(one, balanced, 0).weights)
    # context parallelism: half the tokens per rank, the same parameters, gradients reduced over dp x cp
    cp2 = inputs.Layout(tp=8, pp=16, dp=4, cp=2, split=both, sharding="optim")
    assert memory.layer_activation_bytes(workload, cp2, inputs.GPU_KERNELS) == pytest.approx(
        memory.layer_activation_bytes(workload, balanced, inputs.GPU_KERNELS) / 2)
    assert cp2.num_gpus == 1024 and cp2.shards == 8
    assert memory.rank_memory(workload, cp2, 5).optimizer == memory.rank_memory(workload, balanced, 5).optimizer


def test_activations_follow_korthikanti_where_the_implementation_agrees():
    """A GPT layer (MHA, learned positions, 4h MLP, hidden dropout, 16-bit, CUDA kernels) keeps
    Korthikanti's 34sbh without the 5as^2b score terms that flash attention never stores (plus an fp32
    log-sum-exp per token and head); under TP t with sequence parallelism 34sbh/t (the column-parallel
    linears keep their sequence shard); full recomputation keeps 2sbh, 2sbh/t with SP."""
    s, b, h, a = 2048, 1, 1024, 16
    gpt = plan_flags.model_from_flags(4, h, a, 50257, s, hidden_dropout=0.1, attention_dropout=0.1)
    workload, gpu = inputs.Workload(gpt, 8), inputs.GPU_KERNELS
    sbh, lse = s * b * h, 4 * s * b * a
    assert memory.layer_activation_bytes(workload, inputs.Layout(), gpu) == 34 * sbh + lse
    for t in (2, 4, 8):
        tp = memory.layer_activation_bytes(workload, inputs.Layout(tp=t), gpu)
        assert tp == pytest.approx(34 * sbh / t + lse / t)
        assert memory.layer_activation_bytes(workload, inputs.Layout(tp=t, recompute="full"), gpu) == 2 * sbh / t
    assert memory.layer_activation_bytes(workload, inputs.Layout(recompute="full"), gpu) == 2 * sbh


# ---- the search ----------------------------------------------------------------------------------------
SMALL = with_flags(TINY_LLAMA_ARGS, num_layers=4, num_attention_heads=8, num_query_groups=2, hidden_size=64,
                   ffn_hidden_size=128, seq_length=64, max_position_embeddings=64, global_batch_size=8)


def test_every_candidate_layout_is_accepted_by_pretrain_gpt_and_no_other():
    """The planner's divisibility rules are megalite's: arguments.parse_args accepts the flags of every
    layout the planner keeps and refuses every other one it enumerates, except ZeRO at data-parallel
    size 1, which megalite runs but which shards nothing."""
    from megalite.train.command_line import parse_args
    from megalite.errors import UserError
    model = parse_args(SMALL, world_size=1).model
    workload = inputs.Workload(model, 8, "bf16")
    hardware = inputs.Hardware(num_gpus=8, gpu_memory_gb=80, gpus_per_node=8)
    kept = set(search.candidate_layouts(workload, hardware))
    assert kept and all(layout.num_gpus == 8 for layout in kept)
    assert {layout.tp for layout in kept} == {1, 2, 4, 8}       # 8 > 2 KV groups: replicated KV heads
    for layout in set(search.layouts_of(workload, 8)):
        argv = with_flags(SMALL, global_batch_size=None, micro_batch_size=None) + plan_flags.pretrain_flags(workload, layout)
        if layout in kept:
            config = parse_args(argv, world_size=8)
            assert plan_flags.workload_and_layout(config)[1] == layout
        elif not (layout.dp == 1 and layout.sharding != "no_shard"):
            with pytest.raises(UserError):
                parse_args(argv, world_size=8)


def test_plan_keeps_only_layouts_that_fit_fastest_first():
    workload, hardware = _llama_workload(), inputs.Hardware(num_gpus=16, gpu_memory_gb=40)
    best = search.plan(workload, hardware, top=50)
    assert best and all(e.fits and e.memory.total <= 40 * inputs.GiB * 0.9 for e in best)
    assert [e.time.total for e in best] == sorted(e.time.total for e in best)
    everything = [search.evaluate(workload, lay, hardware) for lay in search.candidate_layouts(workload, hardware)]
    assert any(not e.fits for e in everything)              # e.g. TP=1 PP=1: 8B x 18 B alone is 150 GB
    dropped = [e for e in everything if not e.fits]
    assert not {e.layout for e in dropped} & {e.layout for e in best}


def test_nothing_fits_is_one_line_naming_the_smallest_layout():
    from megalite.errors import UserError
    with pytest.raises(UserError) as error:
        search.plan(_llama_workload(), inputs.Hardware(num_gpus=8, gpu_memory_gb=16))
    message = str(error.value)
    assert "\n" not in message and message.startswith("no layout fits 8 x 16 GB: the smallest needs")
    assert "TP=8" in message or "PP=8" in message


# ---- Hugging Face configs ---------------------------------------------------------------------------
def _hf_model(family: str):
    import transformers
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=128,
                                         bos_token_id=0, eos_token_id=0)
        return config, transformers.GPT2LMHeadModel(config)
    cls = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "phi3": "Phi3"}[family]
    token_ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None} if family == "phi3" else {}  # (Phi-3's: 32000)
    config = getattr(transformers, f"{cls}Config")(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300, max_position_embeddings=128, tie_word_embeddings=False, **token_ids)
    return config, getattr(transformers, f"{cls}ForCausalLM")(config)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3", "gpt2"])
def test_hf_config_gives_the_parameter_count_of_transformers_and_megalite(family, tmp_path):
    from megalite.model.gpt import GPTModel
    config, hf_model = _hf_model(family)
    config.save_pretrained(tmp_path)
    model = plan_flags.model_from_hf_config(read_hf_config_file(str(tmp_path)), seq_length=128)
    unpadded = inputs.Workload(model, 8, make_vocab_size_divisible_by=1)
    assert inputs.count_parameters(unpadded) == sum(p.numel() for p in hf_model.parameters())
    padded = inputs.Workload(model, 8)                      # megalite pads the vocabulary to 384
    megalite_model = GPTModel(dataclasses.replace(model, padded_vocab_size=padded.padded_vocab(1)))
    assert inputs.count_parameters(padded) == sum(p.numel() for p in megalite_model.parameters())


# ---- the command line --------------------------------------------------------------------------------
TOOL = os.path.join(ROOT, "tools", "plan_parallelism.py")
LLAMA_3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False}


def _tool(*argv):
    return subprocess.run([sys.executable, TOOL, *argv], capture_output=True, text=True, timeout=120)


def test_cli_prints_the_fastest_layouts_and_their_flags(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B))
    proc = _tool("--hf-config", str(tmp_path), "--num-gpus", "8", "--gpu-memory-gb", "80", "--seq-length", "8192",
                 "--global-batch-size", "128", "--top", "3")
    assert proc.returncode == 0, proc.stderr
    assert "8.03B parameters" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\s+\d+\s+\d+\s+\d+", line)]
    flags = [line for line in proc.stdout.splitlines() if re.match(r"\s+#\d+: ", line)]
    assert len(rows) == 3 and len(flags) == 3
    assert all("--tensor-model-parallel-size" in f and "--bf16" in f for f in flags)


PHI_3_MINI = {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
              "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
              "partial_rotary_factor": 0.75, "tie_word_embeddings": False, "resid_pdrop": 0.0, "attention_dropout": 0.0,
              "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000}


def test_a_phi3_config_is_planned(tmp_path, capsys):
    """Phi-3 comes through the conversion's config mapping (fused projections, partial rotary): its
    parameters are Phi-3-mini's 3.82B and the plan gives layouts with their flags."""
    import plan_parallelism
    (tmp_path / "config.json").write_text(json.dumps(PHI_3_MINI))
    model = plan_flags.model_from_hf_config(read_hf_config_file(str(tmp_path)), seq_length=4096)
    assert (model.swiglu, model.rotary_percent, model.num_query_groups) == (True, 0.75, 32)
    code = plan_parallelism.main(["--hf-config", str(tmp_path), "--num-gpus", "8", "--gpu-memory-gb", "80",
                                  "--seq-length", "4096", "--global-batch-size", "64", "--top", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "3.82B parameters" in out
    assert len([line for line in out.splitlines() if re.match(r"\s+#\d+: ", line)]) == 2


def test_cli_mistakes_are_one_line_errors(tmp_path, capsys):
    import plan_parallelism
    proc = _tool("--hf-config", str(tmp_path / "missing.json"), "--num-gpus", "8", "--gpu-memory-gb", "80",
                 "--seq-length", "4096", "--global-batch-size", "64")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: --hf-config")
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_3_8B, "model_type": "t5"}))
    cases = {
        ("--hf-config", str(tmp_path), "--num-layers", "2"): "exclusive",
        ("--hf-config", str(tmp_path)): "model_type 't5' is not supported",
        ("--num-layers", "2", "--hidden-size", "64"): "missing --num-attention-heads, --vocab-size",
        ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "100",
         "--tensor-model-parallel-size", "3"): "no layout of 8 GPUs has --tensor-model-parallel-size 3",
    }
    for argv, expected in cases.items():
        code = plan_parallelism.main([*argv, "--num-gpus", "8", "--gpu-memory-gb", "80", "--seq-length", "64",
                                      "--global-batch-size", "64"])
        err = capsys.readouterr().err
        assert code == 1 and expected in err and err.count("\n") == 1, (argv, err)


# Llama-3 8B's pretrain_gpt.py command as Megatron's examples write it
LLAMA_3_8B_COMMAND = [
    "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
    "--group-query-attention", "--num-query-groups", "8", "--seq-length", "8192", "--max-position-embeddings", "8192",
    "--position-embedding-type", "rope", "--rotary-base", "500000", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--micro-batch-size", "1",
    "--global-batch-size", "128", "--train-iters", "1000", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style",
    "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0", "--bf16", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "128256", "--data-path", "/nonexistent/llama3_text_document", "--save", "/nonexistent/ckpt"]


def test_a_pasted_pretrain_gpt_command_plans_as_the_model_flags_do(capsys, monkeypatch):
    """The planner reads pretrain_gpt.py's own flags: what shapes memory and time is planned, the rest (learning
    rate, data and checkpoint paths) ignored; the world is --num-gpus, not the launcher's WORLD_SIZE."""
    import plan_parallelism
    monkeypatch.setenv("WORLD_SIZE", "3")
    hardware = ["--num-gpus", "64", "--gpu-memory-gb", "80", "--top", "3"]
    # the same model in the planner's own terms: NullTokenizer's vocabulary is --vocab-size plus its end-of-document id
    model_flags = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads",
                   "32", "--group-query-attention", "--num-query-groups", "8", "--seq-length", "8192",
                   "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
                   "--untie-embeddings-and-output-weights", "--micro-batch-size", "1", "--global-batch-size", "128",
                   "--vocab-size", "128257"]
    outputs = []
    for argv in (LLAMA_3_8B_COMMAND, model_flags):
        assert plan_parallelism.main(argv + hardware) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and "8.03B parameters" in outputs[0]
    assert len(re.findall(r"^\s+#\d+: .*--micro-batch-size 1 ", outputs[0], re.M)) == 3
    pinned = LLAMA_3_8B_COMMAND + ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "2"]
    _, _, estimates = plan_parallelism.plan(plan_parallelism.build_parser().parse_args(pinned + hardware))
    assert estimates and {(e.layout.tp, e.layout.pp, e.layout.dp) for e in estimates} == {(8, 2, 4)}
