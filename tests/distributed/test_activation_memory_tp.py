"""What a layer keeps per rank under TP + sequence parallelism, and the column-parallel linear that
keeps only the local sequence shard, on 4 gloo ranks (one spawn: TP=4, then TP=2 x DP=2, then CP=2).

- per-rank saved bytes of a Llama layer at TP=t + SP are <= 1.05/t of TP=1; with more TP ranks than
  KV heads the excess is exactly the replicated K/V (each rank keeps its group's whole K and V);
- ColumnParallelLinear under SP (gather in forward, re-gather in backward) gives the outputs and
  x / W / b gradients of gather_from_sp_region + F.linear, and saves only the [s/t, b, h] shard;
- ring attention keeps q, the unexpanded k and v, its output and the log-sum-exp, and in bf16 matches
  fp32 full attention to bf16 rounding.
"""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from bench.activation_memory import LLAMA, count_saved, megalite_layer_bytes
from harness import run_ranks
from megalite.model.attention.mask import MaskSpec
from megalite.parallel.context import build_context_parallel, local_positions, ring_attention
from megalite.parallel.mesh import ParallelState
from megalite.parallel.param_meta import param_meta
from megalite.parallel.tensor.layers import ColumnParallelLinear, TensorParallel
from megalite.parallel.tensor.mappings import gather_from_sp_region
from megalite.parallel.tensor.random import build_rng_tracker

SHAPES = (LLAMA, replace(LLAMA, heads=8, kv_heads=4, dtype="float32"))     # 2 KV heads (bf16), 4 (fp32)
S, B, H, OUT = 16, 2, 8, 12


def _sp_linear(tp: TensorParallel, dtype: torch.dtype, frozen_weight: bool) -> None:
    g = torch.Generator().manual_seed(11)
    x_full, w, b = torch.randn(S, B, H, generator=g), torch.randn(OUT, H, generator=g), torch.randn(OUT, generator=g)
    grad = torch.randn(tp.size, S, B, OUT // tp.size, generator=g)[tp.rank]
    x_full, w, b, grad = (t.to(dtype) for t in (x_full, w, b, grad))
    layer = ColumnParallelLinear(H, OUT, True, dtype, tp)
    with torch.no_grad():
        layer.weight.copy_(param_meta(layer.weight).take_shard(w)); layer.bias.copy_(param_meta(layer.bias).take_shard(b))
    layer.weight.requires_grad_(not frozen_weight)
    x_local = tp.chunk(x_full, dim=0)
    xa, xb = x_local.clone().requires_grad_(), x_local.clone().requires_grad_()
    wb = layer.weight.detach().clone().requires_grad_(not frozen_weight)
    bb = layer.bias.detach().clone().requires_grad_()
    with count_saved(layer) as saved:
        ya = layer(xa)
    assert saved.bytes() == x_local.numel() * x_local.element_size()         # the local shard only
    yb = F.linear(gather_from_sp_region(xb, tp.group), wb, bb)                # the plain path
    ya.backward(grad)
    yb.backward(grad)
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0.0, "rtol": 0.0}
    torch.testing.assert_close(ya, yb, **tol)
    torch.testing.assert_close(xa.grad, xb.grad, **tol)
    torch.testing.assert_close(layer.bias.grad, bb.grad, **tol)
    if frozen_weight:
        assert layer.weight.grad is None
    else:
        torch.testing.assert_close(layer.weight.grad, wb.grad, **tol)


def _ring(state: ParallelState) -> None:
    cp = build_context_parallel(state)
    g = torch.Generator().manual_seed(5)
    s, b, nh, groups, d = 32, 2, 8, 2, 16
    q, k, v = torch.randn(s, b, nh, d, generator=g), torch.randn(s, b, groups, d, generator=g), \
        torch.randn(s, b, groups, d, generator=g)
    grad = torch.randn(s, b, nh * d, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in full)
    ref = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
    ref = ref.permute(2, 0, 1, 3).reshape(s, b, -1)
    ref.backward(grad)
    mine = local_positions(s, cp.rank, cp.size)
    local = [t.index_select(0, mine).to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    with count_saved() as saved:
        out = ring_attention(*local, cp, MaskSpec())
    lse = b * nh * len(mine) * 4
    assert saved.bytes() == sum(t.numel() * 2 for t in local) + out.numel() * 2 + lse
    out.backward(grad.index_select(0, mine).to(torch.bfloat16))
    for got, want in zip([out, *(t.grad for t in local)], [ref, *(t.grad for t in full)]):
        torch.testing.assert_close(got.float(), want.detach().index_select(0, mine), atol=3e-2, rtol=3e-2)


def _rank_checks(rank, world):
    out = {}
    for tp_size in (4, 2):
        state = ParallelState.build(world, rank, tp=tp_size)
        tp = TensorParallel(state.group("tp"), state.tp_rank, state.tp_size, sequence_parallel=True,
                            rng=build_rng_tracker(1234, state.tp_rank, torch.device("cpu")))
        out[tp_size] = [megalite_layer_bytes(shape, tp) for shape in SHAPES]
        for dtype in (torch.float32, torch.bfloat16):
            _sp_linear(tp, dtype, frozen_weight=False)
        _sp_linear(tp, torch.float32, frozen_weight=True)
    _ring(ParallelState.build(world, rank, cp=2))
    return out


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(4, _rank_checks)


def test_per_rank_activations_with_tp_and_sp_are_a_tth_of_tp1(per_rank):
    serial = [megalite_layer_bytes(shape) for shape in SHAPES]
    for t in (2, 4):
        for i, shape in enumerate(SHAPES):
            measured = max(rank[t][i] for rank in per_rank)
            d, e = shape.hidden // shape.heads, shape.element_size
            # more TP ranks than KV heads: each keeps its group's whole K and V, not a 1/t share
            replicated_kv = 2 * shape.seq * shape.batch * d * e * max(0.0, 1 - shape.kv_heads / t)
            assert measured <= 1.05 * serial[i] / t + replicated_kv, (shape.describe(), t, measured, serial[i])
            if t <= shape.kv_heads:
                assert measured <= 1.05 * serial[i] / t


def test_sp_column_parallel_linear_and_ring_attention_checks_ran_on_every_rank(per_rank):
    assert len(per_rank) == 4          # the per-rank assertions (_sp_linear, _ring) raised nowhere
