"""FP8 through pretrain_gpt.py's flags: each recipe trains a tiny Llama (loss finite and falling), the
transformer layers' linears and the experts run the recipe while the output head and router keep the
model's precision, and bad FP8 input is one line naming the flag and the fix."""
import math

import pytest
import torch

from megalite.errors import UserError
from megalite.model.gpt import GPTModel
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, TensorParallel
from megalite.precision.fp8 import GRAD, INPUT, DelayedScaling, Fp8Gemm, RowwiseScaling, gemm_recipe_for, has_kernel
from megalite.precision.gemm import GemmPrecision
from megalite.train.command_line import parse_args
from megalite_test_utils import TINY_LLAMA_ARGS, log_field, run_pretrain, with_flags

# whole 128-blocks for blockwise: hidden 128, query and key/value widths 2 x 64, FFN 256
FP8_ARGS = with_flags(TINY_LLAMA_ARGS, num_layers=1, hidden_size=128, num_attention_heads=2, ffn_hidden_size=256,
                      global_batch_size=2, train_iters=4, lr="3e-3", fp8_format="hybrid")
MOE_ARGS = with_flags(FP8_ARGS, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128)
EMULATED = ("blockwise", "mxfp8")          # no CPU kernel for their scale layouts


def losses(recipe: str, argv=FP8_ARGS) -> list[float]:
    _, log = run_pretrain(with_flags(argv, fp8_recipe=recipe, fp8_emulate=recipe in EMULATED))
    return [log_field(log, i, "lm loss") for i in range(1, 5)]


def assert_trains(values: list[float]) -> None:
    assert all(math.isfinite(v) for v in values), values
    assert values[-1] < values[0] - 0.3, values


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8"])
def test_each_recipe_trains(recipe):
    assert_trains(losses(recipe))


@pytest.mark.slow
def test_fp8_experts_train():
    assert_trains(losses("tensorwise", MOE_ARGS))


def test_layers_run_the_recipe_and_the_head_and_router_stay_high_precision():
    config = parse_args(with_flags(MOE_ARGS, fp8_recipe="delayed", fp8_amax_history_len=4), world_size=1).model
    recipe = gemm_recipe_for(config, torch.device("cpu"), torch.float32)
    model = GPTModel(config, seed=1, tp=TensorParallel(gemm_recipe=recipe))
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert type(model.output_layer.precision) is GemmPrecision
    assert all(isinstance(m.precision, DelayedScaling) for m in linears if m is not model.output_layer)
    assert all(m.precision.input_amax_history.shape == (4,) for m in linears if m is not model.output_layer)
    experts = model.decoder.layers[0].mlp.experts
    assert isinstance(experts.precision, Fp8Gemm)
    assert not any(isinstance(m, Fp8Gemm) for m in model.decoder.layers[0].mlp.router.modules())
    assert gemm_recipe_for(parse_args(TINY_LLAMA_ARGS, world_size=1).model, torch.device("cpu"),
                           torch.float32) == "default"


@pytest.mark.parametrize("flags, fp8_layers", [
    (dict(first_last_layers_bf16=True), [False, True, True, False]),
    (dict(first_last_layers_bf16=True, num_layers_at_start_in_bf16=0, num_layers_at_end_in_bf16=2),
     [True, True, False, False]),
    (dict(num_layers_at_start_in_bf16=3), [True, True, True, True]),     # counts apply with the switch only
])
def test_first_last_layers_bf16_keeps_those_layers_out_of_fp8(flags, fp8_layers):
    config = parse_args(with_flags(FP8_ARGS, num_layers=4, fp8_recipe="rowwise", **flags), world_size=1).model
    model = GPTModel(config, seed=1, tp=TensorParallel(gemm_recipe=gemm_recipe_for(config, torch.device("cpu"),
                                                                                   torch.float32)))
    for layer, fp8 in zip(model.decoder.layers, fp8_layers):
        kinds = {type(m.precision) for m in layer.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
        assert kinds == ({RowwiseScaling} if fp8 else {GemmPrecision})


def test_bad_fp8_input_is_one_line():
    with pytest.raises(UserError, match=r"--num-layers-at-end-in-bf16 3 is more than the 2 layers of a pipeline "
                                        r"stage"):
        parse_args(with_flags(FP8_ARGS, num_layers=4, pipeline_model_parallel_size=2, first_last_layers_bf16=True,
                              num_layers_at_end_in_bf16=3), world_size=2)
    with pytest.raises(UserError, match=r"--fp8-recipe blockwise scales in blocks of 128: --ffn-hidden-size 176 "
                                        r"is not a multiple of 128"):
        parse_args(with_flags(TINY_LLAMA_ARGS, fp8_format="e4m3", fp8_recipe="blockwise", hidden_size=128,
                              num_attention_heads=2), world_size=1)
    with pytest.raises(UserError, match=r"--fp8-recipe mxfp8 scales in blocks of 32: --ffn-hidden-size 176 \(88 per "
                                        r"tensor-parallel rank\)"):
        parse_args(with_flags(TINY_LLAMA_ARGS, fp8_format="e4m3", fp8_recipe="mxfp8",
                              tensor_model_parallel_size=2), world_size=2)
    with pytest.raises(UserError, match=r"--fp8-recipe mxfp8 scales tokens in tiles of 32: a rank holds runs of "
                                        r"--seq-length 32 / 4 \(--context-parallel-size 2\) positions x --micro-"
                                        r"batch-size 2 = 16 tokens, not whole tiles"):
        parse_args(with_flags(FP8_ARGS, fp8_recipe="mxfp8", context_parallel_size=2), world_size=2)
    for flags in (dict(seq_length=64, max_position_embeddings=64), dict(fp8_recipe="blockwise")):  # whole tiles; one
        parse_args(with_flags(FP8_ARGS, **{"fp8_recipe": "mxfp8", "context_parallel_size": 2, **flags}), world_size=2)
    with pytest.raises(UserError, match="--fp8-recipe"):
        parse_args(with_flags(FP8_ARGS, fp8_recipe="nvfp4"), world_size=1)
    with pytest.raises(UserError, match="--compile builds its own backward, not the FP8 one"):
        parse_args(with_flags(FP8_ARGS, fp8_recipe="tensorwise", compile=True), world_size=1)
    parse_args(with_flags(FP8_ARGS, fp8_recipe="delayed", recompute_granularity="full",     # scales fixed per step
                          recompute_method="uniform", recompute_num_layers=1), world_size=1)
    config = parse_args(with_flags(FP8_ARGS, fp8_recipe="blockwise"), world_size=1).model
    with pytest.raises(UserError, match=r"^--fp8-recipe blockwise has no FP8 kernel on cpu: use --fp8-recipe "
                                        r"tensorwise / delayed / rowwise / rowwise_with_gw_hp or --fp8-emulate"):
        gemm_recipe_for(config, torch.device("cpu"), torch.float32)


def test_delayed_scaling_resumes_with_its_amax_history(tmp_path):
    """The amax histories and scales are checkpointed: a run stopped after 2 iterations and resumed repeats
    the uninterrupted run's losses bit for bit, which a fresh history (tensorwise scales) would not."""
    argv = with_flags(FP8_ARGS, fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max",
                      lr_decay_iters=4)         # the schedule of the 4-iteration run in both
    full_state, _ = run_pretrain(argv)
    ckpt = str(tmp_path / "ckpt")
    run_pretrain(with_flags(argv, train_iters=2, save=ckpt))
    resumed_state, _ = run_pretrain(with_flags(argv, load=ckpt))
    assert resumed_state.history == full_state.history[2:]


def test_a_bf16_models_kernel_checks_run_at_start_up():
    """A bf16 model's weight gradients add into fp32 main grads: that GEMM's kernel check runs when the recipe
    is built, not inside the first step (whose memory the dry run compares)."""
    has_kernel.cache_clear()
    config = parse_args(with_flags(FP8_ARGS, fp8_recipe="tensorwise", bf16=True), world_size=1).model
    gemm_recipe_for(config, torch.device("cpu"), torch.bfloat16)
    checked = has_kernel.cache_info().currsize
    has_kernel("tensorwise", "hybrid", torch.device("cpu"), GRAD, INPUT, torch.float32)
    assert has_kernel.cache_info().currsize == checked > 0
