"""The whole-parameter ZeRO layout under --optimizer muon: each matrix's owner is balanced by its
Newton-Schulz FLOPs (optim/muon_cost.py: the logical matrices its owner orthogonalises, whole), the scalar
optimizer's parameters by size, and AdamW's owners are the size-balanced ones as before."""
import pytest

from megalite.optim.muon_cost import newton_schulz_flops, owner_cost, parameter_flops
from megalite.parallel.data.grad_buffer import ParamAndGradBuffer
from megalite.parallel.data.owners import whole_param_owners
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

# 2 layers, hidden 64, 8 heads of 8 in 2 KV groups, SwiGLU 128; MoE: 4 experts of 32 and a shared expert of 64
LLAMA = with_flags(TINY_LLAMA_ARGS, num_attention_heads=8, ffn_hidden_size=128, vocab_size=255, optimizer="muon")
MOE = with_flags(LLAMA, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                 moe_shared_expert_intermediate_size=64)


def built(argv, tp_size=1, tp_rank=0):
    """(config, this TP rank's model chunk, built on the meta device) as pretrain_gpt.py builds them."""
    from megalite.train.command_line import parse_args
    from megalite.model.chunks import build_model_chunks
    from megalite.parallel.tensor.layers import TensorParallel
    config = parse_args(argv, world_size=tp_size)
    return config, build_model_chunks(config.model, 1, TensorParallel(rank=tp_rank, size=tp_size), 0, 1, 1,
                                      meta=True)[0]


def flops(rows, cols):
    return newton_schulz_flops(rows, cols, 5)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_parameters_cost_is_its_logical_matrices_run_whole(tp_size):
    """Q [64, 64], K and V [16, 64] split from the fused QKV; gate and up [128, 64]; each expert's gate and
    up [32, 64] and down [64, 32]: the same on a TP=2 rank, which gathers each sharded matrix whole."""
    config, chunk = built(MOE, tp_size)
    named = dict(chunk.named_parameters())
    cost = lambda name: parameter_flops(name, named[name], config.model, config.optimizer)  # noqa: E731
    layer = "decoder.layers.0."
    assert cost(layer + "self_attention.linear_qkv.weight") == flops(64, 64) + 2 * flops(16, 64)
    assert cost(layer + "self_attention.linear_proj.weight") == flops(64, 64)
    assert cost(layer + "mlp.experts.linear_fc1.weight") == 8 * flops(32, 64)
    assert cost(layer + "mlp.experts.linear_fc2.weight") == 4 * flops(64, 32)
    assert cost(layer + "mlp.shared_experts.linear_fc1.weight") == 2 * flops(64, 64)


def owners_and_costs(argv, ranks):
    """Per trainable parameter of the model: (owner among ``ranks`` in the whole-parameter layout, its
    Newton-Schulz FLOPs or None, elements), dense weights and expert weights (owned over their own group)
    apart."""
    config, chunk = built(argv)
    named = list(chunk.named_parameters())
    cost = owner_cost(config.model, config.optimizer)
    buffer = ParamAndGradBuffer(named, None, 0, ranks, whole_params=True, owner_cost=cost, device="cpu")
    out = {False: [], True: []}
    for name, param in named:
        slot = buffer.slots[name]
        owner = [(r, b.expert) for b in buffer.buckets for r in range(ranks)
                 if b.chunk(r)[0] <= slot.start and slot.end <= b.chunk(r)[1]]
        assert len(owner) == 1, name
        out[owner[0][1]].append((owner[0][0], cost(name, param), param.numel()))
    return out


@pytest.mark.parametrize("argv", [LLAMA, MOE], ids=["llama", "moe"])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_muon_owners_balance_newton_schulz_flops(argv, ranks):
    """Each rank's Newton-Schulz FLOPs are within the largest matrix's of the mean; the rest (embedding,
    output layer, norms, router) are placed by size after them, every parameter on one rank."""
    for expert, placed in owners_and_costs(argv, ranks).items():
        costs = [c for _, c, _ in placed if c is not None]
        if not costs:
            assert argv is LLAMA and expert
            continue
        work = [sum(c for r, c, _ in placed if r == rank and c is not None) for rank in range(ranks)]
        mean = sum(costs) / ranks
        assert all(abs(w - mean) <= max(costs) for w in work), (work, mean, max(costs))
        print(f"{ranks} ranks, {'expert' if expert else 'dense'} weights: Newton-Schulz FLOPs per rank {work}, "
              f"max / mean = {max(work) / mean:.3f}")


def test_flop_owners_differ_from_size_owners():
    """Balancing by FLOPs is not balancing by size: for the MoE model at DP=3 the size-balanced owners
    leave a rank more than the largest matrix's cost from the mean, which the FLOP-balanced ones do not."""
    placed = owners_and_costs(MOE, 3)[False]
    by_size = whole_param_owners([n for _, _, n in placed], 3)
    costs = [c or 0 for _, c, _ in placed]
    work = [sum(c for r, c in zip(by_size, costs) if r == rank) for rank in range(3)]
    assert max(work) - sum(costs) / 3 > max(costs), work


def test_adamw_owners_stay_balanced_by_size():
    """No cost for AdamW (every owner by size, as before), and no costs at all places as costs of None."""
    config, _ = built(with_flags(LLAMA, optimizer="adam"))
    assert owner_cost(config.model, config.optimizer) is None
    sizes = [4096, 64, 4096, 11008, 64, 5, 11008, 777, 4096, 1]
    for ranks in (2, 3, 4):
        assert whole_param_owners(sizes, ranks) == whole_param_owners(sizes, ranks, [None] * len(sizes))
