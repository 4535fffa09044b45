"""The FP8 figures of the log: the share of the weight GEMMs' FLOPs in FP8 against a count from the model's
shape, the scale range against the operands' own amaxes, and a NaN in an FP8 operand stopping the run
with the layer's name."""
import pytest
import torch

from megalite.errors import UserError
from megalite.model.gpt import GPTModel
from megalite.parallel.mesh import ParallelState
from megalite.parallel.tensor.layers import ColumnParallelLinear, TensorParallel
from megalite.precision.fp8 import Fp8Recipe, gemm_recipe_for
from megalite.train.command_line import parse_args
from megalite.train.faults import TrainingFault
from megalite.train.fp8_stats import Fp8Observer
from megalite_test_utils import TINY_LLAMA_ARGS, log_field, run_pretrain, with_flags

FP8_ARGS = with_flags(TINY_LLAMA_ARGS, num_layers=4, hidden_size=128, num_attention_heads=2, ffn_hidden_size=256,
                      fp8_format="hybrid", fp8_recipe="tensorwise")
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def build(argv):
    config = parse_args(argv, world_size=1).model
    model = GPTModel(config, seed=1, tp=TensorParallel(gemm_recipe=gemm_recipe_for(config, torch.device("cpu"),
                                                                                   torch.float32)))
    return config, model, Fp8Observer([model], config, ParallelState(), torch.device("cpu"))


def layer_flops(c) -> tuple[float, float]:
    """(dense, expert) forward FLOPs per token of one transformer layer's linears, from the shape alone."""
    h, q, kv = c.hidden_size, c.num_attention_heads * c.kv_channels, c.kv_projection_size
    attention = 2 * (h * (q + 2 * kv) + q * h)
    if c.num_experts:
        f = c.expert_ffn_hidden_size
        return attention, 2 * c.moe_router_topk * (h * 2 * f + f * h)
    return attention + 2 * (h * 2 * c.ffn_hidden_size + c.ffn_hidden_size * h), 0.0


@pytest.mark.parametrize("flags, fp8_layers", [
    (dict(), 4), (dict(first_last_layers_bf16=True), 2),
    (dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128, first_last_layers_bf16=True), 2)])
def test_fp8_flops_share_is_the_fp8_layers_over_all_weight_gemms(flags, fp8_layers):
    config, _, observer = build(with_flags(FP8_ARGS, **flags))
    per_layer = sum(layer_flops(config))
    head = 2 * config.hidden_size * config.padded_vocab_size
    assert observer.fp8_share == pytest.approx(fp8_layers * per_layer / (4 * per_layer + head), rel=1e-12)


def test_scale_range_is_fp8_max_over_the_operands_amaxes():
    config = parse_args(FP8_ARGS, world_size=1).model
    linear = ColumnParallelLinear(128, 64, False, torch.float32, TensorParallel(gemm_recipe=Fp8Recipe("tensorwise")))
    torch.nn.init.normal_(linear.weight, std=0.02)
    observer = Fp8Observer([linear], config, ParallelState(), torch.device("cpu"))
    x = (torch.randn(16, 128) * 3).requires_grad_()
    linear(x).mul(torch.randn(16, 64) * 1e-3).sum().backward()       # the gradient's scales are larger
    scales = [E4M3_MAX / x.abs().max().item(), E4M3_MAX / linear.weight.abs().max().item()]
    report = observer.report()
    assert report["fp8 GEMM FLOPs share"] == 1.0
    assert report["fp8 tensorwise scale min"] <= min(scales) * (1 + 1e-6)
    assert report["fp8 tensorwise scale max"] >= max(scales) * (1 - 1e-6)
    linear(x.detach())                                   # a new interval: the forward's operands alone
    report = observer.report()
    assert report["fp8 tensorwise scale min"] == pytest.approx(min(scales), rel=1e-6)
    assert report["fp8 tensorwise scale max"] == pytest.approx(max(scales), rel=1e-6)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_a_nan_in_an_fp8_operand_names_its_layer(recipe):
    _, model, observer = build(with_flags(FP8_ARGS, fp8_recipe=recipe, fp8_emulate=recipe == "blockwise"))
    tokens = torch.randint(0, 200, (2, 32))
    model(tokens)
    assert observer.first_nonfinite() is None
    observer.report()
    fc2 = model.decoder.layers[2].mlp.linear_fc2
    fc2.weight.data[0, 0] = float("nan")
    model(tokens)
    assert observer.first_nonfinite() == "decoder.layers.2.mlp.linear_fc2"
    with pytest.raises(TrainingFault, match=r"^an FP8 GEMM operand went NaN/Inf in decoder\.layers\.2\.mlp\."
                                            r"linear_fc2 \(--fp8-recipe " + recipe):
        observer.report()
    assert issubclass(TrainingFault, UserError)          # one line, no traceback


def test_the_log_line_and_metrics_carry_the_fp8_figures(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    _, log = run_pretrain(with_flags(FP8_ARGS, num_layers=2, first_last_layers_bf16=True,
                                     num_layers_at_end_in_bf16=0, metrics_file=str(metrics)))
    config = parse_args(FP8_ARGS, world_size=1).model
    per_layer, head = layer_flops(config)[0], 2 * 128 * config.padded_vocab_size
    share = per_layer / (2 * per_layer + head)
    assert log_field(log, 4, "fp8 GEMM FLOPs share") == pytest.approx(share, rel=1e-3)
    low, high = log_field(log, 4, "fp8 tensorwise scale min"), log_field(log, 4, "fp8 tensorwise scale max")
    assert 0 < low < high
    assert '"fp8 GEMM FLOPs share"' in metrics.read_text()
