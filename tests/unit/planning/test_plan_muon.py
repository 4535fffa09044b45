"""The planner under --optimizer muon (megalite/planning/muon.py): which parameters are Muon's matrices
and their bytes against hand counts and against the real optimizer built in-process, Newton-Schulz FLOPs
against torch's FLOP counter running the rule's own code, the TP gathers and ZeRO shares, the memory
report's theory, and AdamW's figures unchanged."""
import dataclasses
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.config.muon_fields import NS_COEFFICIENTS
from megalite.optim.mixed_precision import MixedPrecisionOptimizer
from megalite.optim.muon_matrices import build_matrix, is_muon_matrix
from megalite.optim.rules.muon import newton_schulz
from megalite.parallel.data.grad_buffer import ParamAndGradBuffer
from megalite.planning import flags as plan_flags
from megalite.planning import inputs, memory, muon, search
from megalite.planning import time as timing
from megalite.train.performance import measure

# 2 layers, hidden 64, 8 heads of 8 in 2 KV groups, SwiGLU 128, vocabulary 256
LLAMA = with_flags(TINY_LLAMA_ARGS, num_attention_heads=8, ffn_hidden_size=128, vocab_size=255)
MOE = with_flags(LLAMA, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                 moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True)


def built(argv, tp_size=1, tp_rank=0):
    """(config, this TP rank's model chunk) as pretrain_gpt.py builds them."""
    from megalite.train.command_line import parse_args
    from megalite.model.chunks import build_model_chunks
    from megalite.parallel.tensor.layers import TensorParallel
    config = parse_args(argv, world_size=tp_size)
    return config, build_model_chunks(config.model, 1, TensorParallel(rank=tp_rank, size=tp_size), 0, 1, 1)[0]


def workload_of(config) -> inputs.Workload:
    return plan_flags.workload_and_layout(config)[0]


def planned_state(workload, layout):
    """(weights, gradients, optimizer state) bytes of pipeline rank 0, as memory.rank_memory counts them."""
    return memory.state_bytes(workload, layout, inputs.stage_parameters(workload, layout, 0),
                              muon.matrix_elements(workload, layout, 0))


def test_hand_count_of_a_tiny_llama():
    """Per layer: Q [64, 64], K and V [16, 64], proj [64, 64], gate and up [128, 64], fc2 [64, 128]."""
    config, _ = built(with_flags(LLAMA, optimizer="muon"))
    workload = workload_of(config)
    matrices = muon.rank_matrices(workload, inputs.Layout(), 0)
    assert Counter(b for m in matrices for b in m.blocks) == Counter(
        {(64, 64): 4, (16, 64): 4, (128, 64): 4, (64, 128): 2})
    per_layer = 96 * 64 + 64 * 64 + 256 * 64 + 64 * 128
    assert muon.matrix_elements(workload, inputs.Layout(), 0) == (2 * per_layer, 0)
    # fp32: 4 B weights + 4 B gradients, then 4 B of momentum for a matrix, 8 B of moments for the rest
    params = inputs.stage_parameters(workload, inputs.Layout(), 0)
    assert planned_state(workload, inputs.Layout()) == (4 * params.total, 4 * params.total,
                                                                4 * 2 * per_layer + 8 * (params.total - 2 * per_layer))
    # gate [128, 64]: m = 64, n = 128, per iteration 4 m^2 n + 2 m^3
    assert muon.newton_schulz_flops(128, 64, 5) == 5 * (4 * 64 * 64 * 128 + 2 * 64 ** 3)
    fused = dataclasses.replace(workload, muon=dataclasses.replace(workload.muon, muon_split_qkv=False,
                                                                   muon_fused_gate_up=True))
    assert Counter(b for m in muon.rank_matrices(fused, inputs.Layout(), 0) for b in m.blocks) == Counter(
        {(96, 64): 2, (64, 64): 2, (256, 64): 2, (64, 128): 2})


@pytest.mark.parametrize("argv", [LLAMA, MOE], ids=["llama", "moe with a gated shared expert"])
@pytest.mark.parametrize("tp", [1, 2])
def test_matrices_are_the_optimizers(argv, tp):
    """The elements the planner gives Muon on a TP rank are those optim/muon_matrices.py picks from the
    model megalite builds; at TP=1 the logical matrices are build_matrix's."""
    config, chunk = built(with_flags(argv, optimizer="muon", tensor_model_parallel_size=tp,
                                     sequence_parallel=tp > 1 or None,
                                     expert_tensor_parallel_size=1 if argv is MOE else None), tp, tp - 1)
    workload, layout = plan_flags.workload_and_layout(config)
    named = [(n, p) for n, p in chunk.named_parameters() if is_muon_matrix(n, p)]
    expert = sum(p.numel() for n, p in named if ".experts." in n)
    assert muon.matrix_elements(workload, layout, 0) == (sum(p.numel() for _, p in named) - expert, expert)
    if tp == 1:
        real = Counter((len(index), build_matrix(n, p, config.model, config.optimizer, None).full_shape[1])
                       for n, p in named for index, _ in build_matrix(n, p, config.model, config.optimizer, None).blocks)
        assert Counter(b for m in muon.rank_matrices(workload, layout, 0) for b in m.blocks) == real


@pytest.mark.parametrize("optimizer", ["muon", "adam"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_state_bytes_equal_the_real_optimizer_and_the_memory_report(optimizer, precision):
    """The planner's optimizer-state bytes are the real optimizer's (state tensors' storage, the master
    copy included), and so is the start-up memory report's theoretical figure."""
    flag = {"bf16": True} if precision == "bf16" else {}
    config, chunk = built(with_flags(MOE, optimizer=optimizer, **flag))
    named = list(chunk.named_parameters())
    buffer = ParamAndGradBuffer(named)
    optimizer_ = MixedPrecisionOptimizer(buffer, named, config.optimizer, model=config.model)
    workload, layout = plan_flags.workload_and_layout(config)
    planned = planned_state(workload, layout)[2]
    assert optimizer_.state_bytes() == pytest.approx(planned, abs=64)      # (AdamW's step counters)
    ddp = SimpleNamespace(buffer=buffer, shard_optimizer=False, named_params=named)
    assert measure(ddp, optimizer_)["theoretical"] == planned


def test_muon_keeps_about_half_of_adamws_state():
    config, _ = built(with_flags(LLAMA, optimizer="muon", bf16=True))
    muon_workload = workload_of(config)
    adam = dataclasses.replace(muon_workload, optimizer="adam")
    for layout in (inputs.Layout(), inputs.Layout(dp=2, sharding="optim")):
        ratio = planned_state(muon_workload, layout)[2] / planned_state(adam, layout)[2]
        assert 0.6 < ratio < 0.8           # the embedding and output layer are most of a tiny model's AdamW


def test_newton_schulz_flops_are_the_rules():
    """torch's FLOP counter over the rule's own newton_schulz, wide and tall."""
    for shape in ((12, 40), (40, 12), (16, 16)):
        with FlopCounterMode(display=False) as counter:
            newton_schulz(torch.randn(*shape), NS_COEFFICIENTS["quintic"], 5, bf16=False)
        assert counter.get_total_flops() == muon.newton_schulz_flops(*shape, 5)


def test_tp_duplicated_runs_whole_matrices_and_gathers_them():
    """Per rank: the same Newton-Schulz FLOPs at TP=1 and TP=2 (the whole matrices run on every TP rank),
    (tp-1)/tp of each sharded fp32 matrix gathered; ZeRO-1 at DP=2 halves both; AdamW has neither."""
    config, _ = built(with_flags(LLAMA, optimizer="muon"))
    workload = workload_of(config)
    whole, _, _ = muon.optimizer_step_work(workload, inputs.Layout(), 0)
    assert whole == sum(muon.newton_schulz_flops(r, c, 5) for m in muon.rank_matrices(workload, inputs.Layout(), 0)
                        for r, c in m.blocks)
    flops, gathered, reduced = muon.optimizer_step_work(workload, inputs.Layout(tp=2), 0)
    assert flops == whole and gathered == 4 * 2 * (96 * 64 + 64 * 64 + 256 * 64 + 64 * 128) and reduced == 0
    zero1 = inputs.Layout(tp=2, dp=2, sharding="optim")
    assert muon.optimizer_step_work(workload, zero1, 0) == (whole / 2, gathered / 2, 0)
    hardware = inputs.Hardware(num_gpus=4, gpu_memory_gb=80)
    t = timing.step_time(workload, inputs.Layout(tp=2, dp=2, sharding="optim"), hardware)
    assert t.newton_schulz == pytest.approx(whole / 2 / (989e12 * 0.55))
    assert t.muon_gathers == pytest.approx(gathered / 2 / 2 / 360e9)
    adam = timing.step_time(dataclasses.replace(workload, optimizer="adam"), inputs.Layout(tp=2, dp=2, sharding="optim"),
                            hardware)
    assert adam.newton_schulz == adam.muon_gathers == 0.0
    assert t.total - adam.total == pytest.approx(t.newton_schulz + t.muon_gathers)


def test_adam_figures_are_unchanged():
    """AdamW's state is still the ZeRO paper's bytes per parameter, to the bit."""
    config, _ = built(with_flags(MOE, bf16=True))
    workload = workload_of(config)
    assert workload.optimizer == "adam" and not muon.rank_matrices(workload, inputs.Layout(), 0)
    layout = inputs.Layout(dp=4, ep=2, sharding="optim")
    params = inputs.stage_parameters(workload, layout, 0)
    dense = memory.state_bytes_per_parameter(2, "optim", layout.zero_shards)
    experts = memory.state_bytes_per_parameter(2, "optim", layout.expert_zero_shards)
    assert planned_state(workload, layout) == tuple(params.dense * a + params.experts * b
                                                            for a, b in zip(dense, experts))


def test_muon_plans_carry_the_flag_and_only_its_layouts():
    """--optimizer muon reaches the planner's workload and its printed flags; the search keeps Muon's ZeRO
    layouts, ZeRO-3 included (the whole-parameter layout)."""
    config, _ = built(with_flags(LLAMA, optimizer="muon", global_batch_size=8))
    workload = workload_of(config)
    assert workload.optimizer == "muon"
    kept = set(search.candidate_layouts(workload, inputs.Hardware(num_gpus=4, gpu_memory_gb=80)))
    assert {"optim", "optim_grads_params"} <= {lay.sharding for lay in kept}
    zero1 = next(lay for lay in kept if lay.sharding == "optim")
    assert plan_flags.pretrain_flags(workload, zero1)[-2:] == ["--optimizer", "muon"]


def test_the_tool_plans_muon(capsys):
    """tools/plan_parallelism.py reads --optimizer muon and its settings from a pasted command line: Muon's
    optimizer state is smaller, and the printed flags run Muon."""
    import os
    import sys
    from megalite_test_utils import ROOT
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import plan_parallelism
    argv = with_flags(LLAMA, global_batch_size=8) + ["--num-gpus", "2", "--gpu-memory-gb", "80", "--top", "1",
                                                     "--tensor-model-parallel-size", "2"]
    for optimizer in ("adam", "muon"):
        workload, hardware, pins = plan_parallelism.planner_inputs(plan_parallelism.build_parser().parse_args(
            with_flags(argv, optimizer=optimizer, muon_num_ns_steps=3)))
        assert workload.optimizer == optimizer and workload.muon.muon_num_ns_steps == 3
    assert plan_parallelism.main(with_flags(argv, optimizer="muon")) == 0
    assert "--optimizer muon" in capsys.readouterr().out


@pytest.mark.parametrize("shape, split", [((40, 12), 0), ((12, 40), 1), ((12, 40), 0)])
def test_distributed_newton_schulz_flops_are_the_rules(shape, split, monkeypatch):
    """torch's FLOP counter over one rank's part (half the split dimension) in the rule's own
    distributed_newton_schulz, its all-reduces made no-ops: the Gram is n x n, n the unsplit dimension (40
    for a wide matrix whose rows TP splits, which costs more than the whole matrix's 12 x 12)."""
    from megalite.optim.rules import muon as rule
    monkeypatch.setattr(rule.dist, "all_reduce", lambda tensor, group=None: None)
    part = tuple(d // 2 if i == split else d for i, d in enumerate(shape))
    with FlopCounterMode(display=False) as counter:
        rule.distributed_newton_schulz([torch.randn(*part)], split, [None], None, NS_COEFFICIENTS["quintic"], 5, False)
    assert counter.get_total_flops() == muon.distributed_newton_schulz_flops(shape, part, split, 5)


def test_tp_distributed_and_blockwise_split_the_work():
    """At TP=2 per rank: distributed runs each rank's parts with 64 x 64 Grams (hidden 64 is the unsplit
    dimension of every matrix) and all-reduces them, 5 per step and a sum of squares, per logical matrix (7
    per layer), gathering nothing; blockwise runs the parts alone with no collective; both do less than
    duplicated; the step time charges the all-reduces' ring bytes."""
    config, _ = built(with_flags(LLAMA, optimizer="muon"))
    workload = workload_of(config)
    tp2 = inputs.Layout(tp=2)
    duplicated = muon.optimizer_step_work(workload, tp2, 0)
    modes = {mode: dataclasses.replace(workload, muon=dataclasses.replace(workload.muon, muon_tp_mode=mode))
             for mode in ("distributed", "blockwise")}
    flops, gathered, reduced = muon.optimizer_step_work(modes["distributed"], tp2, 0)
    assert gathered == 0 and reduced == 4 * 2 * 7 * (5 * 64 * 64 + 1)
    # per layer, parts on a rank: Q [32, 64], K and V [8, 64], gate and up [64, 64] (rows split); proj [64, 32] and
    # fc2 [64, 64] (columns split): 4 n^2 m_r + 2 n^3 per iteration, n = 64
    parts_m = 32 + 8 + 8 + 32 + 64 + 64 + 64
    assert flops == 2 * 5 * (4 * 64 * 64 * parts_m + 7 * 2 * 64 ** 3) < duplicated[0]
    blockwise = muon.optimizer_step_work(modes["blockwise"], tp2, 0)
    parts = [(32, 64), (8, 64), (8, 64), (64, 32), (64, 64), (64, 64), (64, 64)]
    assert blockwise == (2 * sum(muon.newton_schulz_flops(r, c, 5) for r, c in parts), 0, 0)
    assert blockwise[0] < flops
    hardware = inputs.Hardware(num_gpus=2, gpu_memory_gb=80)
    assert timing.step_time(modes["distributed"], tp2, hardware).muon_gathers == pytest.approx(reduced / 360e9)
    assert timing.step_time(modes["blockwise"], tp2, hardware).muon_gathers == 0.0


@pytest.mark.parametrize("argv", [LLAMA, MOE], ids=["llama", "moe"])
def test_parts_cover_the_ranks_elements(argv):
    """A sharded parameter's logical matrices on one rank hold its local elements, and split the full
    weight's matrices along one dimension (replicated KV heads included: 8 heads, 2 groups at TP=4)."""
    config, _ = built(with_flags(argv, optimizer="muon"))
    workload = workload_of(config)
    layout = inputs.Layout(tp=4, ep=2 if argv is MOE else 1, etp=2 if argv is MOE else 1)
    matrices = [m for m in muon.rank_matrices(workload, layout, 0) if m.sharded]
    assert matrices and all(sum(r * c for r, c in m.parts) == m.local for m in matrices)
    for m in matrices:
        kept = 1 - m.split
        assert [b[kept] for b in m.blocks] == [p[kept] for p in m.parts]
