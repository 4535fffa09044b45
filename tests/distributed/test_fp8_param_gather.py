"""--fp8-param-gather: DP=2 ZeRO-3 and ZeRO-1 with the FP8 layers' weights gathered in FP8 equal the serial
FP8 run (the scales come from the whole weight: an amax all-reduce over the shard holders), and ZeRO-3's
parameter all-gathers move at most 0.55x the bytes of the bf16 run's, measured at the collectives and
against theory."""
import pytest

from dp_workloads import layout_flags
from fp8_gather_workloads import fp8_losses, gathered_bytes
from harness import run_ranks
from megalite.errors import UserError
from megalite.train.command_line import parse_args
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

# layers wide enough for 128 x 128 weight blocks, whose weights outweigh the embedding and output head
WIDE = dict(num_layers=4, hidden_size=128, ffn_hidden_size=384, num_query_groups=4)
RECIPES = {"tensorwise": dict(fp8_format="hybrid", fp8_recipe="tensorwise"),
           "blockwise": dict(fp8_format="e4m3", fp8_recipe="blockwise", fp8_emulate=True)}
LAYOUTS = [("tensorwise", "optim_grads_params", True, {}), ("tensorwise", "optim", True, {})]
LAYER_WISE = dict(use_layer_wise_distributed_optimizer=True)      # whole weights per rank, broadcast gathers
SLOW_LAYOUTS = [("blockwise", "optim_grads_params", False, {}), ("blockwise", "optim", False, {}),
                ("tensorwise", "optim_grads_params", False, LAYER_WISE)]


def flags(strategy, overlap, recipe=None, **extra):
    fp8 = dict(RECIPES[recipe], fp8_param_gather=strategy != "no_shard") if recipe else {}
    return layout_flags(strategy, overlap, **WIDE, **fp8, **extra)


def _everything(rank, world):
    return {"losses": fp8_losses(rank, world, [flags(s, o, r, **e) for r, s, o, e in LAYOUTS], steps=2),
            "bytes": gathered_bytes(rank, world, [flags("optim_grads_params", False, "tensorwise", bf16=True),
                                                  flags("optim_grads_params", False, bf16=True)])}


@pytest.fixture(scope="module")
def dp2():
    return run_ranks(2, _everything)


def assert_equal_serial(results, layouts, steps):
    serial = {r: fp8_losses(0, 1, [flags("no_shard", False, r)], steps)[0] for r, _, _, _ in layouts}
    for rank, result in enumerate(results):
        for (recipe, strategy, _, extra), losses in zip(layouts, result):
            assert losses == pytest.approx(serial[recipe], rel=1e-5), f"{recipe} {strategy} {extra} rank {rank}"


def test_tensorwise_fp8_gathers_equal_the_serial_fp8_run(dp2):
    assert_equal_serial([r["losses"] for r in dp2], LAYOUTS, 2)


def _blockwise(rank, world):
    return fp8_losses(rank, world, [flags(s, o, r, **e) for r, s, o, e in SLOW_LAYOUTS], steps=2)


@pytest.mark.slow
def test_blockwise_and_layer_wise_fp8_gathers_equal_the_serial_fp8_run():
    """128 x 128 weight blocks straddle the two ranks' shards: their amaxes are all-reduced per block. The
    layer-wise layout gathers whole weights by one broadcast per owner."""
    assert_equal_serial(run_ranks(2, _blockwise), SLOW_LAYOUTS, 2)


def test_zero3_gathers_at_most_055_of_bf16_bytes(dp2):
    fp8, bf16 = dp2[0]["bytes"]
    assert fp8["fp8_numel"] > 0 and bf16["fp8_numel"] == 0
    assert fp8["bytes"] <= 0.55 * bf16["bytes"], (fp8, bf16)
    # theory: the same gathers, the FP8 buckets' elements in one byte instead of two, plus the amax vectors
    ratio = 1 - fp8["fp8_numel"] / (2 * fp8["numel"])
    assert fp8["bytes"] / bf16["bytes"] == pytest.approx(ratio, abs=0.01)


def _nccl_run(rank, world):
    return fp8_losses(rank, world, [flags("optim_grads_params", True, "tensorwise")], steps=2)


@pytest.mark.slow
def test_fp8_gathers_under_nccl_semantics():
    serial = fp8_losses(0, 1, [flags("no_shard", False, "tensorwise")], steps=2)[0]
    for got in run_ranks(2, _nccl_run, nccl=True):
        assert got[0] == pytest.approx(serial, rel=1e-5)


def test_bad_fp8_param_gather_input_is_one_line():
    fp8 = dict(fp8_format="hybrid", fp8_recipe="tensorwise", fp8_param_gather=True)
    no_strategy = "--fp8-param-gather needs a sharding strategy: add --use-distributed-optimizer"
    with pytest.raises(UserError, match=no_strategy):
        parse_args(with_flags(TINY_LLAMA_ARGS, **fp8), world_size=1)
    with pytest.raises(UserError, match="--fp8-param-gather gathers the weights of FP8 layers: add --fp8-format"):
        parse_args(with_flags(TINY_LLAMA_ARGS, fp8_param_gather=True, use_distributed_optimizer=True), world_size=1)
    with pytest.raises(UserError, match="drop --use-torch-fsdp2"):
        parse_args(with_flags(TINY_LLAMA_ARGS, use_torch_fsdp2=True, **fp8), world_size=1)
