"""The attention seam: core_attention with a V head dim unlike Q/K's, grouped K/V and a non-default scale
equals a plain fp64 softmax(q k^T scale + mask) v, forward and backward, on SDPA, on the meta device's
shapes and on ring attention at CP = 2 (its blocks with the ranks emulated in one process, as
tests/unit/parallel/test_ring_attention.py drives them, and the whole ring over two gloo ranks); and
ModelConfig picks the attention module."""
import pytest
import torch

from megalite.train.command_line import parse_args
from harness import run_ranks
from megalite.model.attention import ATTENTION
from megalite.model.attention.core import core_attention, recomputing_pays
from megalite.model.attention.mask import MaskSpec
from megalite.model.attention.self_attention import SelfAttention
from megalite.model.gpt import GPTModel
from megalite.parallel.context.ring_attention import (ContextParallel, KVBlock, _attend, _attend_backward, _blocks,
                                                      build_context_parallel, local_positions)
from megalite.parallel.mesh import ParallelState
from megalite_test_utils import TINY_LLAMA_ARGS

S, B, NH, GROUPS, D_QK, D_V = 16, 2, 4, 2, 12, 8
SCALE = 0.37                                            # not 1/sqrt(12)


def _inputs(dtype=torch.float32, groups: int = GROUPS):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(S, B, NH, D_QK, generator=g)
    k, v = torch.randn(S, B, groups, D_QK, generator=g), torch.randn(S, B, groups, D_V, generator=g)
    grad = torch.randn(S, B, NH * D_V, generator=g)
    return tuple(t.to(dtype) for t in (q, k, v, grad))


def _reference(q, k, v, grad, causal: bool):
    """(out, dq, dk, dv) of softmax(q k^T SCALE + causal) v in fp64, K/V repeated to every query head."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    per = NH // k.shape[2]
    kk, vv = (t.repeat_interleave(per, dim=2) for t in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q, kk) * SCALE
    if causal:
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vv).reshape(S, B, NH * D_V)
    out.backward(grad.double())
    return out.detach(), q.grad, k.grad, v.grad


def _assert_matches(got, want, **tol):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.double(), w, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("groups", [NH, GROUPS], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_core_attention_with_unequal_head_dims_and_a_scale_equals_the_reference(groups, causal):
    q, k, v, grad = _inputs(groups=groups)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = core_attention(q, k, v, MaskSpec(causal=causal), scale=SCALE)
    assert out.shape == (S, B, NH * D_V)
    out.backward(grad)
    _assert_matches((out, q.grad, k.grad, v.grad), _reference(q, k, v, grad, causal), rtol=1e-5, atol=1e-6)


def test_unequal_head_dims_run_cpu_flash_padded_and_selective_recompute_does_not_pay():
    """CPU's flash kernel takes one head dim: V is zero-padded to it, so no s x s scores are kept and
    recomputing would only run the kernel twice; with attention dropout SDPA's math path runs and it pays."""
    q, k, v, grad = _inputs()
    assert not recomputing_pays(q, k, v, MaskSpec(), dropout=0.0, cp=None)
    assert recomputing_pays(q, k, v, MaskSpec(), dropout=0.1, cp=None)
    q.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        core_attention(q, k, v, MaskSpec(), scale=SCALE)
    assert not any(t.shape[-2:] == (S, S) for t in saved)                 # no s x s scores kept


def test_meta_attention_has_the_value_head_dim_and_keeps_a_fused_kernels_tensors():
    q, k, v, _ = (t.to("meta") for t in _inputs())
    q.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = core_attention(q, k, v, MaskSpec(), scale=SCALE)
    assert out.shape == (S, B, NH * D_V) and out.device.type == "meta"
    assert not any(t.shape[-2:] == (S, S) for t in saved)                 # no s x s scores kept


def _emulated_ring(q, k, v, grad, causal: bool, cp_size: int = 2):
    """(out, dq, dk, dv) of ring attention over the whole sequence, every CP rank run in turn."""
    positions = [local_positions(S, r, cp_size) for r in range(cp_size)]
    kv = [KVBlock.of(k[p], v[p]) for p in positions]
    dkv = [t.new(torch.float32, zeros=True) for t in kv]
    out, dq = torch.empty(grad.shape), torch.empty_like(q)
    for r, p in enumerate(positions):
        cp = ContextParallel(rank=r, size=cp_size)
        steps = [list(_blocks(MaskSpec(causal=causal), cp.chunk_ids(), cp.chunk_ids(src), len(p) // 2, B))
                 for src in range(cp_size)]
        acc, lse = torch.empty(len(p), B, NH, D_V), torch.empty(B, NH, len(p))
        filled = [False, False]
        for src, blocks in enumerate(steps):
            _attend(q[p], kv[src], blocks, acc, lse, filled, SCALE)
        dq_local = torch.zeros(len(p), B, NH, D_QK)
        for src, blocks in enumerate(steps):
            _attend_backward(grad[p].view(acc.shape), q[p], kv[src], acc, lse, blocks, dq_local, dkv[src], SCALE)
        out[p], dq[p] = acc.view(len(p), B, -1), dq_local
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for p, grads in zip(positions, dkv):
        dk[p], dv[p] = grads.k, grads.v
    return out, dq, dk, dv


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_attention_at_cp2_with_unequal_head_dims_and_a_scale_equals_the_reference(causal):
    q, k, v, grad = _inputs()
    _assert_matches(_emulated_ring(q, k, v, grad, causal), _reference(q, k, v, grad, causal), rtol=1e-5, atol=1e-6)


def _ring_ranks(rank, world, causal: bool):
    cp = build_context_parallel(ParallelState.build(world, rank, cp=world))
    p = local_positions(S, cp.rank, cp.size)
    q, k, v, grad = (t[p] for t in _inputs())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = core_attention(q, k, v, MaskSpec(causal=causal), scale=SCALE, cp=cp)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def test_the_ring_over_two_ranks_with_unequal_head_dims_equals_the_reference():
    """The K/V block and its dK/dV accumulator travel as one flat message of both head dims."""
    q, k, v, grad = _inputs()
    want = _reference(q, k, v, grad, causal=True)
    for rank, got in enumerate(run_ranks(2, _ring_ranks, True)):
        p = local_positions(S, rank, 2)
        _assert_matches(got, [w[p] for w in want], rtol=1e-5, atol=1e-6)


def test_the_registry_builds_self_attention_by_default():
    config = parse_args(TINY_LLAMA_ARGS, world_size=1).model
    assert config.attention_type == "self" and ATTENTION["self"] is SelfAttention
    model = GPTModel(config, seed=1)
    assert all(type(layer.self_attention) is SelfAttention for layer in model.decoder.layers)
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in dict(model.named_parameters())
