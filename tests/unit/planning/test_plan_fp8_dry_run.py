"""The planner's FP8 memory (megalite/planning/fp8.py) against a dry run of the same run (planning/verify.py:
one --no-storage dry run per role, its step's peak by category): for tensorwise, delayed and blockwise,
and ZeRO-1 and ZeRO-3 with --fp8-param-gather, the peak within verify.TOLERANCE, the weights (FP8 chunk
copies, ZeRO-1's kept FP8 weights, ZeRO-3's FP8 gathers) to the bytes the planner leaves out (delayed
scaling's histories, the gathered weights' scales), and FP8's quantisation at least what the dry run adds
over the same run without FP8 (the planner counts it at the layer's fullest backward moment)."""
import pytest

from megalite.planning import flags as plan_flags
from megalite.planning import verify
from megalite.train.command_line import parse_args
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

BASE = with_flags(TINY_LLAMA_ARGS, num_layers=2, hidden_size=128, num_attention_heads=2, ffn_hidden_size=256,
                  seq_length=256, max_position_embeddings=256, global_batch_size=8, bf16=True)
FP8 = dict(fp8_format="hybrid")
RUNS = {
    "tensorwise": (dict(FP8, fp8_recipe="tensorwise"), 1),
    "delayed": (dict(FP8, fp8_recipe="delayed"), 1),
    "blockwise": (dict(FP8, fp8_recipe="blockwise", fp8_emulate=True), 1),
    "zero1-fp8-param-gather": (dict(FP8, fp8_recipe="blockwise", fp8_emulate=True, use_distributed_optimizer=True,
                                    fp8_param_gather=True), 2),
    "zero3-fp8-param-gather": (dict(FP8, fp8_recipe="tensorwise", data_parallel_sharding_strategy="optim_grads_params",
                                    fp8_param_gather=True), 2),
}
LEFT_OUT = 512       # bytes: delayed scaling's histories and scales (36 per linear here), the gathered weights' scales


def checked(flags: dict, world: int) -> verify.RoleCheck:
    workload, layout = plan_flags.workload_and_layout(parse_args(with_flags(BASE, **flags), world_size=world))
    (check,) = verify.verify(workload, layout, log=lambda *_: None)
    return check


@pytest.fixture(scope="module")
def without_fp8() -> verify.RoleCheck:
    """The serial run without FP8."""
    return checked({}, 1)


@pytest.mark.parametrize("run", RUNS)
def test_the_planners_fp8_memory_agrees_with_a_dry_run(run, without_fp8):
    flags, world = RUNS[run]
    check = checked(flags, world)
    assert not check.off, (check.estimate, check.measured)
    assert abs(check.estimate["weights"] - check.measured["weights"]) <= LEFT_OUT, (check.estimate, check.measured)
    if world == 1:
        plain = without_fp8
        measured = check.measured["activations"] - plain.measured["activations"]
        estimated = check.estimate["activations"] - plain.estimate["activations"]
        assert 0 < measured <= estimated, (measured, estimated)


def test_fp8_param_gather_changes_the_weights_and_the_planner_follows():
    """ZeRO-1 keeps the whole FP8 weights and a byte per element of its chunk beside its bf16 parameters."""
    flags, world = RUNS["zero1-fp8-param-gather"]
    with_gather = checked(flags, world)
    without = checked({k: v for k, v in flags.items() if k != "fp8_param_gather"}, world)
    grown = with_gather.measured["weights"] - without.measured["weights"]
    fp8_weights = 2 * (128 * (128 + 2 * 128) + 128 * 128 + 3 * 256 * 128)      # qkv, proj, fc1, fc2 of 2 layers
    assert grown == fp8_weights + fp8_weights // world
    assert abs(with_gather.estimate["weights"] - without.estimate["weights"] - grown) <= LEFT_OUT
