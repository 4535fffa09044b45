"""FP8 in the planner (megalite/planning/fp8.py): the FP8 GEMM weights per rank against the FP8 layers of
the model pretrain_gpt.py builds, the FP8 peak in the step time, the FP8 parameter gathers' bytes, the
GEMM copies in the memory estimate, and the figures without FP8 unchanged."""
import dataclasses

import pytest
import torch

from megalite.model.chunks import build_model_chunks
from megalite.parallel.tensor.layers import TensorParallel
from megalite.planning import flags as plan_flags
from megalite.planning import fp8, inputs, memory
from megalite.planning import time as timing
from megalite.precision.fp8 import Fp8Gemm, gemm_recipe_for
from megalite.train.command_line import parse_args
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

LLAMA = with_flags(TINY_LLAMA_ARGS, num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=4,
                   ffn_hidden_size=256, fp8_format="hybrid", fp8_recipe="blockwise", fp8_emulate=True, bf16=True,
                   global_batch_size=8)
MOE = with_flags(LLAMA, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128,
                 moe_shared_expert_intermediate_size=128)
HARDWARE = inputs.Hardware(num_gpus=8, gpu_memory_gb=80)


def fp8_weights_built(argv, tp=1) -> tuple[int, int]:
    """(dense, expert) elements of the weights the FP8 recipes multiply in TP rank 0's model."""
    config = parse_args(argv, world_size=tp)
    recipe = gemm_recipe_for(config.model, torch.device("cpu"), torch.float32)
    chunk = build_model_chunks(config.model, 1, TensorParallel(size=tp, gemm_recipe=recipe), 0, 1, 1)[0]
    dense = experts = 0
    for module in chunk.modules():
        if isinstance(getattr(module, "precision", None), Fp8Gemm):
            for p in module.parameters():
                if p.dim() >= 2:
                    dense, experts = (dense, experts + p.numel()) if p.dim() == 3 else (dense + p.numel(), experts)
    return dense, experts


@pytest.mark.parametrize("argv, tp", [(LLAMA, 1), (with_flags(LLAMA, fp8_recipe="tensorwise", tensor_model_parallel_size=2), 2), (with_flags(LLAMA, first_last_layers_bf16=True), 1),
                                      (with_flags(MOE, first_last_layers_bf16=True), 1)],
                         ids=["llama", "llama tp2", "first/last bf16", "moe first/last bf16"])
def test_fp8_weights_per_rank_are_the_built_models(argv, tp):
    workload, layout = plan_flags.workload_and_layout(parse_args(argv, world_size=tp))
    assert fp8.rank_fp8_weights(workload, layout, 0) == fp8_weights_built(argv, tp)


def test_fp8_layers_run_at_twice_the_bf16_peak():
    workload, layout = plan_flags.workload_and_layout(parse_args(LLAMA, world_size=1))
    bf16 = dataclasses.replace(workload, model=dataclasses.replace(workload.model, fp8_format=None))
    assert HARDWARE.peak_flops("fp8") == 2 * HARDWARE.peak_flops("bf16") == 2 * 989e12
    model = workload.model
    flops = timing._dense_hardware_flops(bf16, layout, timing.dense_part(bf16, layout))[1]
    head = 3 * 2 * 8 * model.seq_length * model.hidden_size * workload.padded_vocab(1)
    per_layer = (flops - head) / model.num_layers
    attention = 3 * 4 * model.seq_length * 128 * 8 * model.seq_length          # core attention, 3 x forward
    saved = 4 * (per_layer - attention) / 2                                       # the GEMMs' half
    rate = HARDWARE.peak_flops("bf16") * HARDWARE.compute_efficiency
    assert timing.stage_busy_seconds(workload, layout, HARDWARE)[0] == pytest.approx(
        timing.stage_busy_seconds(bf16, layout, HARDWARE)[0] - saved / rate, rel=1e-9)


@pytest.mark.parametrize("recipe, scales", [("tensorwise", 0.0), ("blockwise", 4 / 128 ** 2)])
def test_fp8_param_gather_moves_a_byte_per_fp8_weight_plus_scales(recipe, scales):
    workload, layout = plan_flags.workload_and_layout(parse_args(with_flags(LLAMA, fp8_recipe=recipe), world_size=1))
    psi = inputs.stage_parameters(workload, layout, 0).dense
    fp8_psi, _ = fp8.rank_fp8_weights(workload, layout, 0)
    gathering = dataclasses.replace(workload, fp8_param_gather=True)
    assert fp8.gathered_bytes(workload, psi, fp8_psi) == 2 * psi
    assert fp8.gathered_bytes(gathering, psi, fp8_psi) == pytest.approx(2 * (psi - fp8_psi) + fp8_psi * (1 + scales))
    d, m = 4, 2
    for sharding, gathers in (("optim", 1), ("optim_grads_params", 2 * m)):
        saved = (timing.data_parallel_bytes(workload, sharding, psi, d, m, fp8_psi)
                 - timing.data_parallel_bytes(gathering, sharding, psi, d, m, fp8_psi))
        assert saved == pytest.approx(gathers * (d - 1) / d * fp8_psi * (1 - scales))


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_recipes_the_gather_does_not_take_gather_in_the_models_dtype(recipe):
    workload, layout = plan_flags.workload_and_layout(parse_args(with_flags(LLAMA, fp8_recipe=recipe), world_size=1))
    psi = inputs.stage_parameters(workload, layout, 0).dense
    fp8_psi, _ = fp8.rank_fp8_weights(workload, layout, 0)
    assert fp8_psi and fp8.gathered_bytes(dataclasses.replace(workload, fp8_param_gather=True), psi, fp8_psi) == 2 * psi


def test_zero3_gathers_of_a_large_llama_are_near_half_of_bf16s():
    """A ~1B Llama: the FP8 layers' weights dominate, so the gathers are ~0.55x of bf16's or less."""
    model = plan_flags.model_from_flags(16, 2048, 32, 32000, 4096, ffn_hidden_size=8192, num_query_groups=8,
                                        swiglu=True, untie_embeddings_and_output_weights=True,
                                        fp8_format="hybrid", fp8_recipe="blockwise")
    workload = inputs.Workload(model, 64, fp8_param_gather=True)
    layout = inputs.Layout(dp=8, sharding="optim_grads_params")
    psi = inputs.stage_parameters(workload, layout, 0).dense
    fp8_psi, _ = fp8.rank_fp8_weights(workload, layout, 0)
    assert fp8.gathered_bytes(workload, psi, fp8_psi) / (2 * psi) <= 0.6


def test_memory_adds_the_largest_gemms_fp8_copies():
    workload, layout = plan_flags.workload_and_layout(parse_args(LLAMA, world_size=1))
    tokens, h, fc1 = workload.model.seq_length * 2, 128, 2 * 256                 # micro-batch 2, SwiGLU fc1
    x, w, grad, byte = tokens * h, fc1 * h, tokens * fc1, 1 + 4 / 128 ** 2     # an FP8 element with its scales
    # each GEMM's first operand in FP8 beside the second's working copies (12 bytes per element)
    copy = max(12 * grad, byte * grad + 12 * w, byte * grad + 12 * x, 12 * x, byte * x + 12 * w)
    assert fp8.gemm_copy_bytes(workload, layout) == pytest.approx(copy)
    bf16 = dataclasses.replace(workload, model=dataclasses.replace(workload.model, fp8_format=None))
    first_stage = dataclasses.replace(layout, pp=2)         # no head: backward through a layer is the peak
    with_fp8, without = memory.rank_memory(workload, first_stage, 0), memory.rank_memory(bf16, first_stage, 0)
    assert with_fp8.activations - without.activations == pytest.approx(copy)


def test_a_parsed_command_line_carries_the_fp8_param_gather():
    config = parse_args(with_flags(LLAMA, use_distributed_optimizer=True, fp8_param_gather=True), world_size=2)
    assert plan_flags.workload_and_layout(config)[0].fp8_param_gather
    assert not plan_flags.workload_and_layout(parse_args(LLAMA, world_size=2))[0].fp8_param_gather


def test_the_tool_reads_fp8_flags():
    import os
    import sys
    from megalite_test_utils import ROOT
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import plan_parallelism
    argv = LLAMA + ["--num-gpus", "2", "--gpu-memory-gb", "80", "--fp8-param-gather"]
    workload, _, _ = plan_parallelism.planner_inputs(plan_parallelism.build_parser().parse_args(argv))
    assert workload.fp8_param_gather and workload.model.fp8_recipe == "blockwise"
    assert plan_parallelism.main(argv + ["--top", "1"]) == 0
