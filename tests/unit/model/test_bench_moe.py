"""bench/bench_moe.py's equivalence check: megalite's MoE layer and transformers' Mixtral and Qwen3-MoE
sparse MoE blocks (every experts implementation) agree on shared weights, and the check catches a
layer that does not."""
import os
import sys

import pytest
import torch

from megalite_test_utils import ROOT

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_moe  # noqa: E402

TINY = bench_moe.Shape(hidden=32, ffn=48, experts=4, topk=2, tokens=24)
FINE = bench_moe.Shape(hidden=32, ffn=16, experts=16, topk=4, tokens=24)        # Qwen3-MoE's granularity


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", [TINY, FINE], ids=["coarse", "fine"])
def test_transformers_blocks_match_megalite_on_shared_weights(dtype, shape):
    ours, theirs, skipped, errors = bench_moe.contenders(shape, dtype, batched_mm_gb=1.0, quiet=lambda *a, **k: None)
    assert set(ours) == set(bench_moe.FAMILIES) and not skipped
    assert {c.name for c in theirs} == {f"{f} {i}" for f in bench_moe.FAMILIES for i in bench_moe.IMPLEMENTATIONS}
    assert all(max(e.values()) <= bench_moe.TOLERANCE[dtype][1] for e in errors.values())


def test_equivalence_check_fails_on_a_different_layer():
    ours, theirs, _, _ = bench_moe.contenders(TINY, "fp32", batched_mm_gb=0.0, quiet=lambda *a, **k: None)
    with torch.no_grad():
        ours["mixtral"].module.experts.linear_fc2.weight[1] *= 1.01       # one expert's down projection
    with pytest.raises(AssertionError, match="mixtral eager"):
        bench_moe.check_equivalence(ours["mixtral"], theirs[0], "fp32")


def test_routing_check_refuses_tokens_routed_differently_without_a_near_tie():
    """In bf16 some near-tied tokens may route differently; a router that prefers another expert outright may not."""
    ours, theirs, _, _ = bench_moe.contenders(FINE, "bf16", batched_mm_gb=0.0, quiet=lambda *a, **k: None)
    with torch.no_grad():
        weight = ours["qwen3_moe"].module.router.weight
        weight[[0, 1]] = weight[[1, 0]].clone()                  # experts 0 and 1 swap their router rows
    other = next(c for c in theirs if c.name == "qwen3_moe eager")
    with pytest.raises(AssertionError, match="without a near tie"):
        bench_moe.check_equivalence(ours["qwen3_moe"], other, "bf16")


def test_batched_mm_is_left_out_where_its_weight_copies_exceed_the_budget():
    _, theirs, skipped, _ = bench_moe.contenders(TINY, "fp32", batched_mm_gb=0.0, quiet=lambda *a, **k: None)
    assert len(skipped) == 2 and all("batched_mm fp32 h 32 f 48 E 4 k 2 T 24: not run" in line for line in skipped)
    assert "batched_mm" not in " ".join(c.name for c in theirs)


@pytest.mark.parametrize("swiglu,openai_gelu", [(True, False), (False, False), (False, True)])
def test_grouped_experts_gradients_equal_plain_autograd_per_expert(swiglu, openai_gelu):
    """GroupedExperts' own backward (one node for both GEMMs and the activation) against autograd through
    plain per-expert matmuls, in fp64, with an expert that gets no rows."""
    import torch.nn.functional as F
    from megalite.train.command_line import parse_args
    from megalite.model.moe import GroupedExperts
    from megalite.parallel.expert.dispatch import ExpertParallel
    from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
    argv = with_flags(TINY_LLAMA_ARGS, num_experts=4, moe_ffn_hidden_size=24, swiglu=swiglu or None,
                      openai_gelu=openai_gelu or None)
    experts = GroupedExperts(parse_args(argv, world_size=1).model, torch.float64, ExpertParallel())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.1)
    counts = [5, 0, 9, 3]
    rows = torch.randn(sum(counts), 64, generator=generator, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(sum(counts), 64, generator=generator, dtype=torch.float64)
    experts(rows, counts).backward(grad)
    got = [rows.grad, experts.linear_fc1.weight.grad, experts.linear_fc2.weight.grad]

    fc1 = experts.linear_fc1.weight.detach().requires_grad_()
    fc2 = experts.linear_fc2.weight.detach().requires_grad_()
    x = rows.detach().requires_grad_()
    outs = []
    for e, part in enumerate(x.split(counts)):
        hidden = part @ fc1[e].t()
        if swiglu:
            gate, up = hidden.chunk(2, dim=-1)
            act = F.silu(gate) * up
        else:
            act = F.gelu(hidden, approximate="tanh" if openai_gelu else "none")
        outs.append(act @ fc2[e].t())
    torch.cat(outs).backward(grad)
    for ours, reference in zip(got, [x.grad, fc1.grad, fc2.grad]):
        torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    assert not got[1][1].any() and not got[2][1].any()           # the expert without rows
