"""--fp8-param-gather: DP=2 ZeRO-3 and ZeRO-1 (megalite's own) and FSDP2 with the FP8 layers' weights gathered
in FP8 equal the serial FP8 run (the scales come from the whole weight: an amax all-reduce over the shard
holders; delayed scaling's from its history), and ZeRO-3's and FSDP2's parameter all-gathers move at most
0.55x the bytes of the bf16 run's, measured at the collectives and against theory."""
import pytest

from dp_workloads import layout_flags
from fp8_gather_workloads import fp8_losses, gathered_bytes
from harness import run_ranks
from megalite.config.fp8_fields import PARAM_GATHER_RECIPES
from megalite.config.megatron_cli import startup_notes
from megalite.errors import UserError
from megalite.train.command_line import parse_args
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

# layers wide enough for 128 x 128 weight blocks, whose weights outweigh the embedding and output head
WIDE = dict(num_layers=4, hidden_size=128, ffn_hidden_size=384, num_query_groups=4)
RECIPES = {"tensorwise": dict(fp8_format="hybrid", fp8_recipe="tensorwise"),
           "delayed": dict(fp8_format="hybrid", fp8_recipe="delayed"),
           "blockwise": dict(fp8_format="e4m3", fp8_recipe="blockwise", fp8_emulate=True)}
FSDP2 = dict(use_torch_fsdp2=True, bucket_size=None)              # FSDP2 takes no --ddp-bucket-size
LAYOUTS = [("tensorwise", "optim_grads_params", True, {}), ("tensorwise", "optim", True, {}),
           ("tensorwise", "optim_grads_params", True, FSDP2)]
# three steps: the third quantises with the scales of the first two steps' amax histories
DELAYED = [("delayed", "optim_grads_params", True, {}), ("delayed", "optim", True, {})]
LAYER_WISE = dict(use_layer_wise_distributed_optimizer=True)      # whole weights per rank, broadcast gathers
SLOW_LAYOUTS = [("blockwise", "optim_grads_params", False, {}), ("blockwise", "optim", False, {}),
                ("tensorwise", "optim_grads_params", False, LAYER_WISE), ("blockwise", "optim_grads_params", False, FSDP2),
                ("delayed", "optim_grads_params", False, FSDP2)]


def flags(strategy, overlap, recipe=None, **extra):
    fp8 = dict(RECIPES[recipe], fp8_param_gather=strategy != "no_shard") if recipe else {}
    return layout_flags(strategy, overlap, **WIDE, **fp8, **extra)


def _bytes_against_bf16(rank, world, recipe, **extra):
    return gathered_bytes(rank, world, [flags("optim_grads_params", False, recipe, bf16=True, **extra),
                                        flags("optim_grads_params", False, bf16=True, **extra)])


def _everything(rank, world):
    return {"losses": fp8_losses(rank, world, [flags(s, o, r, **e) for r, s, o, e in LAYOUTS], steps=2),
            "delayed": fp8_losses(rank, world, [flags(s, o, r, **e) for r, s, o, e in DELAYED], steps=3),
            "bytes": {what: _bytes_against_bf16(rank, world, recipe, **extra) for what, recipe, extra in
                      (("zero3", "tensorwise", {}), ("zero3 delayed", "delayed", {}), ("fsdp2", "tensorwise", FSDP2))}}


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


def test_delayed_fp8_gathers_equal_the_serial_fp8_run(dp2):
    """Each shard is quantised with the weight scale delayed scaling fixed for the step from its history,
    and the gathers record the weight's amax into that history as the GEMM's own quantisation would."""
    assert_equal_serial([r["delayed"] for r in dp2], DELAYED, 3)


def _blockwise(rank, world):
    return fp8_losses(rank, world, [flags(s, o, r, **e) for r, s, o, e in SLOW_LAYOUTS], steps=3)


@pytest.mark.slow
def test_blockwise_layer_wise_and_fsdp2_fp8_gathers_equal_the_serial_fp8_run():
    """128 x 128 weight blocks straddle the two ranks' shards (ZeRO's flat chunks, FSDP2's row shards):
    their amaxes are all-reduced per block. The layer-wise layout gathers whole weights by one broadcast per
    owner. Three steps, for delayed scaling's history."""
    assert_equal_serial(run_ranks(2, _blockwise), SLOW_LAYOUTS, 3)


@pytest.mark.parametrize("what", ["zero3", "zero3 delayed", "fsdp2"])
def test_zero3_gathers_at_most_055_of_bf16_bytes(dp2, what):
    fp8, bf16 = dp2[0]["bytes"][what]
    assert fp8["fp8_numel"] > 0 and bf16["fp8_numel"] == 0
    assert fp8["bytes"] <= 0.55 * bf16["bytes"], (fp8, bf16)
    # theory: the same gathers, the FP8 weights' elements in one byte instead of two (the amaxes travel
    # in an all-reduce, the scales in none)
    ratio = 1 - fp8["fp8_numel"] / (2 * fp8["numel"])
    assert fp8["bytes"] / bf16["bytes"] == pytest.approx(ratio, abs=0.01)


def _nccl_run(rank, world):
    return fp8_losses(rank, world, [flags("optim_grads_params", True, "tensorwise"),
                                    flags("optim_grads_params", True, "tensorwise", **FSDP2),
                                    flags("optim_grads_params", True, "delayed")], steps=2)


@pytest.mark.slow
def test_fp8_gathers_under_nccl_semantics():
    """ZeRO-3's, FSDP2's (its pre-all-gather hook's amax all-reduce) and delayed scaling's FP8 gathers."""
    serial = {r: fp8_losses(0, 1, [flags("no_shard", False, r)], steps=2)[0] for r in ("tensorwise", "delayed")}
    for got in run_ranks(2, _nccl_run, nccl=True):
        for losses, recipe in zip(got, ("tensorwise", "tensorwise", "delayed")):
            assert losses == pytest.approx(serial[recipe], rel=1e-5), recipe


def test_bad_fp8_param_gather_input_is_one_line():
    fp8 = dict(fp8_format="hybrid", fp8_recipe="tensorwise", fp8_param_gather=True)
    no_strategy = "--fp8-param-gather needs a sharding strategy: add --use-distributed-optimizer"
    with pytest.raises(UserError, match=no_strategy):
        parse_args(with_flags(TINY_LLAMA_ARGS, **fp8), world_size=1)
    with pytest.raises(UserError, match="--fp8-param-gather gathers the weights of FP8 layers: add --fp8-format"):
        parse_args(with_flags(TINY_LLAMA_ARGS, fp8_param_gather=True, use_distributed_optimizer=True), world_size=1)


def test_recipes_without_fp8_gathers_say_why_at_start_up():
    """rowwise and MXFP8 scale W along in-features in forward and along out-features in the input-gradient
    GEMM: one FP8 copy serves only one of them, and two copies weigh at least bf16's two bytes."""
    for recipe in ("rowwise", "rowwise_with_gw_hp", "mxfp8"):
        argv = with_flags(TINY_LLAMA_ARGS, fp8_format="hybrid", fp8_recipe=recipe, fp8_param_gather=True,
                          use_distributed_optimizer=True, bf16=True)
        assert startup_notes(argv) == [
            f"--fp8-param-gather: --fp8-recipe {recipe}'s weights are gathered in their own dtype (bf16): its "
            "forward GEMM scales W in blocks along in-features and its input-gradient GEMM scales W^T along "
            "out-features, so one FP8 copy cannot serve both, and both copies with their scales move at least "
            f"bf16's bytes; FP8 gathers take --fp8-recipe {' or '.join(PARAM_GATHER_RECIPES)}"]
    assert startup_notes(with_flags(TINY_LLAMA_ARGS, fp8_format="hybrid", fp8_recipe="delayed",
                                    fp8_param_gather=True, use_distributed_optimizer=True)) == []


def _tp2_dp2(rank, world, extra):
    fp8 = flags("optim_grads_params", False, "tensorwise", tensor_model_parallel_size=2, sequence_parallel=True,
                **extra)
    return fp8_losses(rank, world, [fp8, with_flags(fp8, fp8_param_gather=None)], steps=2)


@pytest.mark.parametrize("extra", [{}, pytest.param(FSDP2, marks=pytest.mark.slow)], ids=["zero3", "fsdp2"])
def test_tensorwise_fp8_gathers_under_tensor_parallelism_equal_the_unsharded_gather(extra):
    """TP=2 x DP=2, megalite's ZeRO-3 and FSDP2: a tensorwise weight's scale is the amax of the whole weight,
    over the TP ranks' parts as well as the DP shards, as the layer's own quantisation takes it: the FP8
    gathers give the losses of the same layout gathering its weights in their own dtype. Two steps: the FP8
    buckets of their own change the order the gradient norm sums its pieces in, which moves it by an fp32
    ulp, and FP8's few mantissa bits turn that into a flipped quantised value a step or two later."""
    for gathered, own_dtype in run_ranks(4, _tp2_dp2, extra):
        assert gathered == pytest.approx(own_dtype, rel=1e-6, abs=0), (gathered, own_dtype)
