"""FP8 experts at the expert-parallel layouts that put other ranks' rows into one expert GEMM equal the
serial FP8 run (pretrain_gpt.py, the tiny MoE of test_fp8_layouts.py).

EP=2 over the data-parallel ranks (no TP): an expert's GEMM takes the rows of two micro-batches, which the
single process quantises one at a time; each is scaled apart (tests/unit/precision/test_fp8_grouped.py),
so every recipe logs serial's losses. With one scale over both the step-1 loss differs by 2.5e-4
(tensorwise).

ETP=2 (over the TP + SP ranks, EP=1): each rank holds half of every expert's hidden dimension, so a scaling
block along it (a tensor's, a row's along fc2's K) spans both ranks and its amax is reduced over the ETP
group; without the reduction the step-1 loss differs by 7e-4 (tensorwise). The experts' hidden size, 128,
is half a 128-block per ETP rank, so the blockwise weights' 128 x 128 blocks (and MXFP8's, whole) are
checked at EP=2 only.

The allgather dispatcher at EP=2 over DP, and EP=2 x ETP=2 over TP=2 + SP and DP=2 (within an expert the
rows of the two micro-batches come interleaved from the ETP gather; the dispatcher orders them by rank)
equal serial too."""
import pytest

from test_fp8_layouts import MOE_ARGV, RECIPES, assert_equal_runs, flags_of, serial, train

EP2_OVER_DP = dict(expert_model_parallel_size=2, expert_tensor_parallel_size=1)
ETP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=1,
            expert_tensor_parallel_size=2)


def tiers(recipes, default):
    return [pytest.param(r, marks=() if r == default else pytest.mark.slow) for r in recipes]


@pytest.mark.parametrize("recipe", tiers(RECIPES, "tensorwise"))
def test_fp8_experts_at_ep2_over_dp_equal_serial(recipe):
    assert_equal_runs(serial(recipe, MOE_ARGV), train(2, flags_of(recipe, **EP2_OVER_DP), base=MOE_ARGV), (1,))


@pytest.mark.parametrize("recipe", tiers(["tensorwise", "rowwise", "delayed"], "tensorwise"))
def test_fp8_experts_at_etp2_equal_serial(recipe):
    assert_equal_runs(serial(recipe, MOE_ARGV), train(2, flags_of(recipe, **ETP2), base=MOE_ARGV), (1,))


@pytest.mark.slow
@pytest.mark.parametrize("nproc, flags", [
    (2, dict(EP2_OVER_DP, moe_token_dispatcher_type="allgather")),
    (4, dict(ETP2, expert_model_parallel_size=2))], ids=["ep2-over-dp-allgather", "ep2-etp2-dp2"])
def test_fp8_experts_at_other_expert_layouts_equal_serial(nproc, flags):
    assert_equal_runs(serial("tensorwise", MOE_ARGV), train(nproc, flags_of("tensorwise", **flags), base=MOE_ARGV),
                      (1,))


@pytest.mark.parametrize("flags", [EP2_OVER_DP, pytest.param(ETP2, marks=pytest.mark.slow)],
                         ids=["ep2-over-dp", "etp2"])
def test_fp8_experts_under_nccl_semantics(flags):
    """The dispatcher's per-micro-batch row counts and the ETP amax reductions are collectives every rank
    issues in the same order (the NCCL-semantics tier compares the ranks' logs)."""
    assert_equal_runs(serial("tensorwise", MOE_ARGV), train(2, flags_of("tensorwise", **flags), nccl=True,
                                                             base=MOE_ARGV), (1,))
