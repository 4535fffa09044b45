"""GPT-OSS's MoE layer: router bias, top-k of the logits then softmax over the k, experts with biases on
both GEMMs and the clamped quick GEGLU with the (linear + 1) offset. One megalite MoE layer equals
transformers' GptOssMLP with the same weights, forward and gradients; the quick GEGLU matches its formula
in the dense MLP too."""
import pytest
import torch

from megalite.model.mlp import MLP, quick_geglu
from megalite.model.moe import MoELayer
from megalite.parallel.expert.dispatch import ExpertParallel, MoEContext
from megalite.parallel.tensor.layers import TensorParallel
from megalite.train.command_line import parse_args
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

transformers = pytest.importorskip("transformers")

E, K, H, F_EXPERT = 4, 2, 64, 32
GPT_OSS_FLAGS = dict(num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=F_EXPERT, disable_bias_linear=None,
                     swiglu=None, quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0)


def gpt_oss_config():
    return parse_args(with_flags(TINY_LLAMA_ARGS, **GPT_OSS_FLAGS), world_size=1).model


def hf_mlp(seed: int):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    config = GptOssConfig(hidden_size=H, intermediate_size=F_EXPERT, num_local_experts=E, num_experts_per_tok=K)
    torch.manual_seed(seed)
    mlp = GptOssMLP(config)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.3)             # large enough that the clamp at 7 bites on some entries
    return mlp


def copy_into(layer: MoELayer, mlp) -> None:
    """transformers' [E, h, 2f] gate_up_proj has the gate and up columns interleaved (gate 0, up 0, gate 1,
    ...); megalite's stacked fc1 is [E, 2f, h] with [gate; up] rows."""
    ex = mlp.experts
    gate_up = ex.gate_up_proj.transpose(1, 2)                             # [E, 2f, h]
    with torch.no_grad():
        layer.router.weight.copy_(mlp.router.weight)
        layer.router.bias.copy_(mlp.router.bias)
        layer.experts.linear_fc1.weight.copy_(torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1))
        layer.experts.linear_fc1.bias.copy_(torch.cat([ex.gate_up_proj_bias[:, 0::2],
                                                       ex.gate_up_proj_bias[:, 1::2]], dim=1))
        layer.experts.linear_fc2.weight.copy_(ex.down_proj.transpose(1, 2))
        layer.experts.linear_fc2.bias.copy_(ex.down_proj_bias)


def test_moe_layer_equals_transformers_gpt_oss_mlp():
    mlp = hf_mlp(seed=3)
    layer = MoELayer(gpt_oss_config(), torch.float32, TensorParallel(), MoEContext(ExpertParallel())).train()
    copy_into(layer, mlp)
    x = torch.randn(8, 2, H) * 3
    ours = layer(x.clone().requires_grad_())                              # [s, b, h]
    theirs, _ = mlp(x.transpose(0, 1))                                    # [b, s, h]
    torch.testing.assert_close(ours, theirs.transpose(0, 1), rtol=1e-5, atol=1e-5)
    pre = x.reshape(-1, H) @ mlp.experts.gate_up_proj[0] + mlp.experts.gate_up_proj_bias[0]
    assert (pre.abs() > 7).any() and (pre.abs() < 7).any()          # the clamp bites on some entries only
    grad = torch.randn_like(ours)
    ours.backward(grad)
    theirs.backward(grad.transpose(0, 1))
    ex = mlp.experts
    pairs = [(layer.router.bias.grad, mlp.router.bias.grad), (layer.router.weight.grad, mlp.router.weight.grad),
             (layer.experts.linear_fc2.bias.grad, ex.down_proj_bias.grad),
             (layer.experts.linear_fc2.weight.grad, ex.down_proj.grad.transpose(1, 2)),
             (layer.experts.linear_fc1.bias.grad, torch.cat([ex.gate_up_proj_bias.grad[:, 0::2],
                                                             ex.gate_up_proj_bias.grad[:, 1::2]], dim=1))]
    for ours_grad, theirs_grad in pairs:
        torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-4, atol=1e-4)


def test_quick_geglu_formula_and_the_dense_mlp():
    h = torch.linspace(-10, 10, 40).view(2, 20)
    gate, linear = h.chunk(2, dim=-1)
    g, lin = gate.clamp(max=7), linear.clamp(-7, 7)
    torch.testing.assert_close(quick_geglu(h, 1.0, 7.0), g * torch.sigmoid(1.702 * g) * (lin + 1))
    config = parse_args(with_flags(TINY_LLAMA_ARGS, swiglu=None, quick_geglu=True, glu_linear_offset=1.0,
                                   activation_func_clamp_value=7.0), world_size=1).model
    mlp = MLP(config, torch.float32, TensorParallel())
    torch.manual_seed(0)
    for weight in (mlp.linear_fc1.weight, mlp.linear_fc2.weight):     # built with torch.empty: set every value
        torch.nn.init.normal_(weight, std=0.5)
    x = torch.randn(3, 2, config.hidden_size)
    expected = mlp.linear_fc2(quick_geglu(mlp.linear_fc1(x), 1.0, 7.0))
    torch.testing.assert_close(mlp(x), expected)
    assert mlp.linear_fc1.weight.shape[0] == 2 * config.ffn_hidden_size
