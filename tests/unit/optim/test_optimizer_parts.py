"""The optimizer's parts: the AdamW update rule against torch.optim.AdamW, its named state, the rule
registry against --optimizer's choices, and the whole-parameter ZeRO layout of the flat buffer."""
import copy

import pytest
import torch
from torch import nn

from megalite.config.schema import OPTIMIZERS, OptimizerConfig
from megalite.optim.mixed_precision import MixedPrecisionOptimizer
from megalite.optim.rules import RULES
from megalite.parallel.data.grad_buffer import ParamAndGradBuffer, region_offsets, whole_param_owners


def toy_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    torch.manual_seed(100 + step)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    return ((model(x) - y) ** 2).mean()


def test_adamw_rule_steps_as_torch_adamw_and_names_its_state():
    """Three steps of the optimizer over a flat fp32 buffer equal torch.optim.AdamW with decoupled weight
    decay on the weight matrices only (Megatron's rule: no decay on biases and norm weights)."""
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0, adam_beta2=0.95)
    model, reference = toy_model(), toy_model()
    named = list(model.named_parameters())
    buffer = ParamAndGradBuffer(named)
    optimizer = MixedPrecisionOptimizer(buffer, named, config)
    decay = [p for p in reference.parameters() if p.dim() > 1]
    torch_adamw = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                     {"params": [p for p in reference.parameters() if p.dim() == 1],
                                      "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for step in range(3):
        optimizer.zero_grad()
        loss_of(model, step).backward()
        assert optimizer.step(1e-2).update_successful
        torch_adamw.zero_grad()
        loss_of(reference, step).backward()
        torch_adamw.step()
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7, msg=name)

    assert optimizer.state_names == RULES["adam"].state_names == ("exp_avg", "exp_avg_sq")
    assert optimizer.step_count == 3.0
    (master,) = optimizer.master_pieces
    state = optimizer.named_state(master)
    assert list(state) == ["exp_avg", "exp_avg_sq"]
    for name, param in model.named_parameters():
        slot = buffer.slots[name]
        theirs = torch_adamw.state[dict(reference.named_parameters())[name]]
        for kind in optimizer.state_names:
            torch.testing.assert_close(state[kind][slot.start:slot.end].view(slot.shape), theirs[kind],
                                       rtol=1e-5, atol=1e-8)
    optimizer.set_step_count(7.0)
    assert optimizer.step_count == 7.0


def test_every_optimizer_flag_choice_has_a_rule():
    assert tuple(RULES) == OPTIMIZERS


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_whole_parameter_regions_are_contiguous_without_padding(ranks):
    sizes = [4096, 64, 4096, 11008, 64, 5, 11008, 777, 4096, 1]
    owner = whole_param_owners(sizes, ranks)
    offsets, share = region_offsets(sizes, owner, ranks)
    bounds = [sum(share[:r]) for r in range(ranks + 1)]
    spans = sorted(zip(offsets, sizes))
    assert spans[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))   # back to back
    assert all(bounds[r] <= o and o + n <= bounds[r + 1] for o, n, r in zip(offsets, sizes, owner))
    assert sum(share) == sum(sizes) and max(share) - sum(sizes) / ranks < max(sizes)           # balanced


def test_whole_parameter_owners_balance_what_each_rank_holds():
    """Llama-3 8B's parameters (per-layer matrices, a large embedding and output layer) over 2-8 ranks:
    each rank holds within the largest parameter of the mean, here within 1% of it."""
    sizes = [128256 * 4096] + 32 * ([4096, 6144 * 4096, 4096 * 4096, 4096, 28672 * 4096, 4096 * 14336]) \
        + [4096, 128256 * 4096]
    for ranks in (2, 4, 8):
        owner = whole_param_owners(sizes, ranks)
        held = [sum(n for n, r in zip(sizes, owner) if r == rank) for rank in range(ranks)]
        assert sum(held) == sum(sizes) and max(held) <= 1.01 * sum(sizes) / ranks, (ranks, held)


def test_buffer_whole_parameter_layout_gives_every_rank_whole_parameters():
    """With whole_params each parameter's slot lies in one rank's chunk of its bucket, the chunks lie
    back to back with unequal lengths and no padding, and the model's parameters still view the buffer."""
    model = toy_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for rank in range(3):
        named = list(copy.deepcopy(model).named_parameters())
        buffer = ParamAndGradBuffer(named, bucket_size=40, dp_rank=rank, dp_size=3, whole_params=True)
        assert any(not bucket.even for bucket in buffer.buckets)
        for bucket in buffer.buckets:
            assert bucket.chunk(0)[0] == bucket.start and bucket.chunk(2)[1] == bucket.end
            assert bucket.numel == sum(p.numel() for p in bucket.params)
            for name in bucket.names:
                slot = buffer.slots[name]
                owners = {r for r in range(3) if bucket.chunk(r)[0] < slot.end and slot.start < bucket.chunk(r)[1]}
                assert len(owners) == 1, name
            assert buffer.local_param_chunk(bucket).numel() == bucket.chunk_numel
        for name, param in named:
            assert torch.equal(buffer.view(buffer.param_data, name), before[name])
            assert param.data_ptr() == buffer.view(buffer.param_data, name).data_ptr()
        assert buffer.numel == buffer.numel_unpadded
