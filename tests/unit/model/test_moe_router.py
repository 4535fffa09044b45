"""The MoE layer against direct formulas: routing weights of each score function, the load-balancing losses
and their gradient, capacity with both drop policies, padding, and the layer's output against a per-token
loop over the experts."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from megalite.train.command_line import parse_args
from megalite.errors import UserError
from megalite.model.moe import MoELayer
from megalite.parallel.expert.dispatch import ExpertParallel, MoEContext
from megalite.parallel.tensor.layers import TensorParallel
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

E, K, H, F_EXPERT = 8, 2, 64, 32


def moe_config(**flags):
    flags = {"num_experts": E, "moe_router_topk": K, "moe_ffn_hidden_size": F_EXPERT, **flags}
    argv = with_flags(TINY_LLAMA_ARGS, **flags)
    return parse_args(argv, world_size=1).model


def layer_for(config, seed: int = 0) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(config, torch.float32, TensorParallel(), MoEContext(ExpertParallel()))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
    return layer.train()


def per_token_reference(layer: MoELayer, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor):
    """sum_j w_tj * expert_{e_tj}(x_t), one token and one expert at a time."""
    fc1, fc2 = layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            gate, up = (fc1[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (fc2[e] @ (F.silu(gate) * up))
    return out


def routing_of(config, logits: torch.Tensor):
    """The expected (experts, weights) of each router mode, written out."""
    if config.moe_router_score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        experts = torch.topk(scores, K).indices
        w = scores.gather(1, experts)
        return experts, w / w.sum(-1, keepdim=True)
    if config.moe_router_pre_softmax:
        probs = torch.softmax(logits, -1)
        top = torch.topk(probs, K)
        return top.indices, top.values
    top = torch.topk(logits, K)
    return top.indices, torch.softmax(top.values, -1)


@pytest.mark.parametrize("flags", [{}, {"moe_router_pre_softmax": True}, {"moe_router_score_function": "sigmoid"},
                                   {"moe_router_topk_scaling_factor": 2.5}])
def test_layer_output_equals_a_per_token_loop(flags):
    config = moe_config(**flags)
    layer = layer_for(config)
    x = torch.randn(6, 3, H)
    out = layer(x)
    tokens = x.reshape(-1, H)
    experts, weights = routing_of(config, tokens @ layer.router.weight.t())
    weights = weights * (config.moe_router_topk_scaling_factor or 1.0)
    expected = per_token_reference(layer, tokens, experts, weights).view_as(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_aux_and_z_losses_follow_their_formulas_and_reach_the_router():
    config = moe_config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    layer = layer_for(config)
    layer.moe.grad_scale = 1.0
    x = torch.randn(8, 2, H)
    layer(x).sum().backward()
    with_losses = layer.router.weight.grad.clone()
    aux, z, forwards = layer.router.loss_sums.tolist()
    logits = x.reshape(-1, H) @ layer.router.weight.detach().t()
    t = logits.shape[0]
    probs = torch.softmax(logits, -1)
    counts = torch.zeros(E).scatter_add_(0, torch.topk(logits, K).indices.reshape(-1), torch.ones(t * K))
    assert aux == pytest.approx(float((probs.sum(0) * counts).sum() * 0.1 * E / (K * t * t)), rel=1e-5)
    assert z == pytest.approx(float(torch.logsumexp(logits, -1).square().mean() * 0.01), rel=1e-5)
    assert forwards == 1
    # the losses' own gradient: the same backward without them differs by d(aux + z)/dW
    layer.router.weight.grad = None
    plain = layer_for(dataclasses.replace(config, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None))
    plain.load_state_dict(layer.state_dict())
    plain(x).sum().backward()
    w = layer.router.weight.detach().clone().requires_grad_()
    lg = x.reshape(-1, H) @ w.t()
    loss = (torch.softmax(lg, -1).sum(0) * counts).sum() * 0.1 * E / (K * t * t) + \
        torch.logsumexp(lg, -1).square().mean() * 0.01
    loss.backward()
    difference = with_losses - plain.router.weight.grad       # fp32 cancellation: compare as a whole
    assert float((difference - w.grad).norm() / w.grad.norm()) < 1e-3


def test_seq_aux_loss_is_the_mean_over_sequences():
    config = moe_config(moe_aux_loss_coeff=0.1, moe_router_load_balancing_type="seq_aux_loss")
    layer = layer_for(config)
    s, b = 8, 3
    x = torch.randn(s, b, H)
    layer(x)
    logits = (x.reshape(-1, H) @ layer.router.weight.detach().t()).view(s, b, E)
    expected = 0.0
    for seq in range(b):
        counts = torch.zeros(E).scatter_add_(0, torch.topk(logits[:, seq], K).indices.reshape(-1), torch.ones(s * K))
        f = counts * E / (K * s)
        p = torch.softmax(logits[:, seq], -1).mean(0)
        expected += float((f * p).sum()) * 0.1 / b
    assert layer.router.loss_sums[0].item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_keeps_the_chosen_assignments(policy):
    config = moe_config(moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy)
    layer = layer_for(config)
    tokens = torch.randn(16, H)
    routed, _ = layer.router(tokens, (16, 1))
    capacity = math.ceil(0.5 * 16 * K / E)
    logits = tokens @ layer.router.weight.detach().t()
    experts, weights = routing_of(config, logits)
    probs = torch.softmax(logits, -1)
    for e in range(E):
        chosen = [(t, j) for t in range(16) for j in range(K) if experts[t, j] == e]
        if policy == "position":
            keep = chosen[:capacity]
        else:
            keep = sorted(chosen, key=lambda tj: -float(probs[tj[0], e]))[:capacity]
        kept = {(t, j) for t, j in chosen if routed.keep[t, j]}
        assert kept == set(keep), f"expert {e}"


def test_padding_to_capacity_changes_nothing():
    config = moe_config(moe_expert_capacity_factor=1.0)
    x = torch.randn(8, 2, H)
    plain = layer_for(config)(x)
    padded = layer_for(dataclasses.replace(config, moe_pad_expert_input_to_capacity=True))(x)
    torch.testing.assert_close(plain, padded)


def test_forced_balance_spreads_tokens_evenly():
    layer = layer_for(moe_config(moe_router_force_load_balancing=True))
    layer(torch.randn(8, 2, H))
    assert layer.router.step_counts.tolist() == [16 * K / E] * E


def test_expert_bias_moves_towards_the_mean_load():
    config = moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                        moe_router_bias_update_rate=0.1)
    layer = layer_for(config)
    layer(torch.randn(8, 2, H))
    load = layer.router.step_counts.clone()
    layer.router.finish_step(load)
    expected = 0.1 * torch.sign(load.mean() - load)
    torch.testing.assert_close(layer.router.expert_bias, expected)
    assert layer.router.step_counts.sum() == 0 and torch.equal(layer.router.last_load, load)


@pytest.mark.parametrize("flags, message", [
    (dict(moe_router_topk=9), "--moe-router-topk 9 exceeds --num-experts 8"),
    (dict(moe_expert_capacity_factor=0), "--moe-expert-capacity-factor must be > 0"),
    (dict(moe_layer_freq="[1,0,1]"), "--moe-layer-freq lists 3 layers"),
])
def test_bad_moe_flags_are_one_line(flags, message):
    with pytest.raises(UserError, match=message.replace("-", r"\-")):
        moe_config(**flags)


@pytest.mark.parametrize("world, flags, message", [
    (3, dict(expert_model_parallel_size=3, global_batch_size=6), "--expert-model-parallel-size 3 does not divide --num-experts 8"),
    (2, dict(expert_model_parallel_size=4), "must divide the 2 ranks of each pipeline stage"),
    (4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2), "needs --sequence-parallel"),
    (2, dict(expert_model_parallel_size=2, use_torch_fsdp2=True), "--use-torch-fsdp2 does not shard experts"),
    (2, dict(tensor_model_parallel_size=2, sequence_parallel=True, disable_bias_linear=None),
     "add --expert-tensor-parallel-size 1"),
])
def test_bad_expert_layouts_are_one_line(world, flags, message):
    argv = with_flags(TINY_LLAMA_ARGS, **{"num_experts": E, "moe_router_topk": K, "global_batch_size": 8, **flags})
    with pytest.raises(UserError, match=message.replace("-", r"\-")):
        parse_args(argv, world_size=world)


def test_moe_layer_freq_patterns():
    config = moe_config(num_layers=4, moe_layer_freq="([0]*1+[1]*3)")
    assert [config.is_moe_layer(i) for i in range(1, 5)] == [False, True, True, True]
    config = moe_config(num_layers=4, moe_layer_freq=2)
    assert [config.is_moe_layer(i) for i in range(1, 5)] == [True, False, True, False]
