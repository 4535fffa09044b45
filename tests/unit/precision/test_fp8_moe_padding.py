"""--moe-router-padding-for-fp8: each expert's rows padded to a multiple of 16 give the unpadded layer's
outputs and gradients, and put every expert's FP8 GEMMs on the kernel; without FP8 or experts the flag is
one line."""
import pytest
import torch

import megalite.precision.fp8 as fp8
from megalite.errors import UserError
from megalite.model.gpt import GPTModel
from megalite.parallel.tensor.layers import TensorParallel
from megalite.precision.fp8 import gemm_recipe_for
from megalite.train.command_line import parse_args
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

MOE = with_flags(TINY_LLAMA_ARGS, num_layers=1, hidden_size=128, num_attention_heads=2, ffn_hidden_size=256,
                 num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128, fp8_format="hybrid",
                 fp8_recipe="tensorwise")


def outputs_and_grads(argv):
    config = parse_args(argv, world_size=1).model
    model = GPTModel(config, seed=3, tp=TensorParallel(gemm_recipe=gemm_recipe_for(config, torch.device("cpu"),
                                                                                   torch.float32)))
    tokens = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(0))   # 64 tokens x top-2
    logits = model(tokens)
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_padded_experts_equal_unpadded():
    base_out, base_grads = outputs_and_grads(with_flags(MOE, fp8_emulate=True))
    out, grads = outputs_and_grads(with_flags(MOE, fp8_emulate=True, moe_router_padding_for_fp8=True))
    torch.testing.assert_close(out, base_out, rtol=0, atol=0)
    for name, grad in base_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


def test_padding_puts_every_expert_gemm_on_the_kernel(monkeypatch):
    if not fp8.has_kernel("tensorwise", "hybrid", torch.device("cpu"), fp8.INPUT, fp8.WEIGHT, torch.float32):
        pytest.skip("this torch has no CPU tensorwise FP8 kernel")
    shapes = []
    real = fp8.scaled_mm
    monkeypatch.setattr(fp8, "emulated_mm", lambda a, b, dtype: shapes.append(a.shape) or real(a, b, dtype))
    outputs_and_grads(with_flags(MOE, moe_router_padding_for_fp8=True))
    assert [s for s in shapes if s[0] % 16] == []      # no expert GEMM fell back to the emulation
    shapes.clear()
    outputs_and_grads(MOE)
    assert shapes                                       # without the padding some do


@pytest.mark.parametrize("flags", [dict(fp8_format=None), dict(num_experts=None)])
def test_padding_needs_fp8_and_experts(flags):
    argv = with_flags(MOE, moe_router_padding_for_fp8=True, **flags)
    with pytest.raises(UserError, match=r"^--moe-router-padding-for-fp8 .* needs --fp8-format and --num-experts"):
        parse_args(argv, world_size=1)
