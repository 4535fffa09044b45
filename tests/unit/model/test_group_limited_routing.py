"""Group-limited routing (--moe-router-num-groups, --moe-router-group-topk) against transformers' DeepSeek-V3
router on the same weights and expert bias, against a per-token loop for softmax routing, and its bad input."""
import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from megalite.errors import UserError
from megalite.model.moe import MoELayer
from megalite.parallel.expert.dispatch import ExpertParallel, MoEContext
from megalite.parallel.tensor.layers import TensorParallel
from megalite.train.command_line import parse_args
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

E, K, G, KEEP, H = 16, 4, 8, 2, 64


def router_config(**flags):
    flags = {"num_experts": E, "moe_router_topk": K, "moe_ffn_hidden_size": 32, "moe_router_num_groups": G,
             "moe_router_group_topk": KEEP, **flags}
    return parse_args(with_flags(TINY_LLAMA_ARGS, **flags), world_size=1).model


def router_of(config, seed: int = 0):
    torch.manual_seed(seed)
    layer = MoELayer(config, torch.float32, TensorParallel(), MoEContext(ExpertParallel()))
    with torch.no_grad():
        layer.router.weight.normal_(0, 0.3)
    return layer.router.train()


def test_sigmoid_routing_with_expert_bias_equals_transformers_deepseek_v3_router():
    config = router_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                           moe_router_topk_scaling_factor=2.5)
    router = router_of(config)
    router.expert_bias.copy_(torch.randn(E) * 0.1)
    peer = DeepseekV3TopkRouter(DeepseekV3Config(
        hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=G, topk_group=KEEP,
        routed_scaling_factor=2.5, norm_topk_prob=True))
    with torch.no_grad():
        peer.weight.copy_(router.weight)
        peer.e_score_correction_bias.copy_(router.expert_bias)
    x = torch.randn(64, H)
    routed, _ = router(x, (16, 4))
    _, peer_weights, peer_experts = peer(x)
    ours = torch.sort(routed.experts, dim=-1)
    theirs = torch.sort(peer_experts, dim=-1)
    assert torch.equal(ours.values, theirs.values)
    torch.testing.assert_close(routed.weights.gather(1, ours.indices), peer_weights.gather(1, theirs.indices))
    # the restriction bites: without groups some tokens pick experts outside their best groups
    ungrouped, _ = router_of(router_config(moe_router_num_groups=None, moe_router_group_topk=None,
                                           moe_router_score_function="sigmoid"))(x, (16, 4))
    assert not torch.equal(torch.sort(ungrouped.experts, -1).values, ours.values)


def test_softmax_routing_keeps_each_token_within_its_best_groups():
    config = router_config()
    router = router_of(config, seed=1)
    x = torch.randn(32, H)
    routed, _ = router(x, (8, 4))
    logits = x @ router.weight.detach().t()
    size = E // G
    for t in range(x.shape[0]):                    # written out one token at a time
        group_scores = [float(logits[t, g * size:(g + 1) * size].topk(K // KEEP).values.sum()) for g in range(G)]
        best = sorted(range(G), key=lambda g: -group_scores[g])[:KEEP]
        allowed = [e for g in best for e in range(g * size, (g + 1) * size)]
        top = sorted(allowed, key=lambda e: -float(logits[t, e]))[:K]
        assert sorted(routed.experts[t].tolist()) == sorted(top)
        expected = torch.softmax(logits[t, top], -1)
        got = routed.weights[t][[routed.experts[t].tolist().index(e) for e in top]]
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("flags, message", [
    ({"moe_router_group_topk": None}, "needs both --moe-router-num-groups and --moe-router-group-topk"),
    ({"moe_router_num_groups": 5}, "--moe-router-num-groups 5 does not divide --num-experts 16"),
    ({"moe_router_group_topk": 9}, "--moe-router-group-topk 9 exceeds --moe-router-num-groups 8"),
    ({"moe_router_group_topk": 3}, "--moe-router-group-topk 3 does not divide --moe-router-topk 4"),
    ({"moe_router_num_groups": 16, "moe_router_group_topk": 1}, "--moe-router-topk 4 exceeds the 1 experts"),
    ({"num_experts": None, "moe_router_topk": None, "moe_ffn_hidden_size": None},
     "--moe-router-num-groups applies to MoE layers"),
])
def test_bad_group_routing_is_one_line(flags, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        router_config(**flags)
