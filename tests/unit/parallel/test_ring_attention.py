"""Ring attention's blocks on the fused kernels, every CP rank emulated in one process.

Each rank's steps run here in turn, with the KV block of rank (r - step) mod cp handed over directly
and each KV block's dK/dV summed over the ranks that saw it (the ring's communication is tested over
real ranks in tests/distributed/test_context_parallel.py). So the block kernels, the log-sum-exp merge
and the causal / full block choice are checked against plain causal SDPA at cp = 2 and 4, in fp32 and
bf16, with and without GQA; and the memory of one ring step is measured: O(c) in the chunk length c,
no c x c scores. tests/cuda/test_cuda_ring.py runs the same checks on a GPU's kernels.
"""
import pytest
import torch
import torch.nn.functional as F

from bench.cross_entropy_memory import LiveBytes
from megalite.model.attention.mask import MaskSpec
from megalite.parallel.context.ring_attention import (ContextParallel, KVBlock, _attend, _attend_backward, _blocks,
                                                      local_positions)

B, NH, D = 2, 4, 16
# bf16 vs the fp32 reference: a few bf16 roundings of O(1) values (8 mantissa bits)
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def inputs(seq: int, groups: int, dtype: torch.dtype, device="cpu", seed: int = 3):
    """q [s, b, heads, d], k / v [s, b, groups, d] and the output's gradient [s, b, heads * d]."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(seq, B, n, D, generator=g) for n in (NH, groups, groups))
    grad = torch.randn(seq, B, NH * D, generator=g)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v, grad))


def sdpa_reference(q, k, v, grad):
    """(out, dq, dk, dv) of fp32 causal SDPA over the whole sequence."""
    s = q.shape[0]
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, enable_gqa=True)
    out = out.permute(2, 0, 1, 3).reshape(s, B, -1)
    out.backward(grad.float())
    return out.detach(), q.grad, k.grad, v.grad


def emulated_ring(q, k, v, grad, cp_size: int):
    """(out, dq, dk, dv) over the whole sequence of ring attention at ``cp_size``, every rank run in turn."""
    s, scale = q.shape[0], q.shape[-1] ** -0.5
    positions = [local_positions(s, r, cp_size, q.device) for r in range(cp_size)]
    kv = [KVBlock.of(k[p], v[p]) for p in positions]
    dkv = [t.new(torch.float32, zeros=True) for t in kv]
    out, dq = torch.empty(grad.shape, dtype=q.dtype, device=q.device), torch.empty_like(q)
    for r, p in enumerate(positions):
        cp = ContextParallel(rank=r, size=cp_size)
        steps = [(src, list(_blocks(MaskSpec(), cp.chunk_ids(), cp.chunk_ids(src), s // (2 * cp_size), B)))
                 for src in range(cp_size)]
        q_local = q[p]
        acc = torch.empty(q_local.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, NH, len(p), dtype=torch.float32, device=q.device)
        filled = [False, False]
        for src, blocks in steps:
            _attend(q_local, kv[src], blocks, acc, lse, filled, scale)
        result = acc.to(q.dtype)
        dq_local = torch.zeros_like(acc)
        for src, blocks in steps:
            _attend_backward(grad[p].view(q_local.shape), q_local, kv[src], result, lse, blocks, dq_local, dkv[src],
                             scale)
        out[p], dq[p] = result.view(len(p), B, -1), dq_local.to(q.dtype)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for p, grads in zip(positions, dkv):
        dk[p], dv[p] = grads.k.to(k.dtype), grads.v.to(v.dtype)
    return out, dq, dk, dv


def assert_ring_equals_sdpa(cp_size: int, groups: int, dtype: torch.dtype, device="cpu", chunk: int = 16,
                            tolerance: dict | None = None) -> None:
    q, k, v, grad = inputs(2 * cp_size * chunk, groups, dtype, device)
    want = sdpa_reference(q, k, v, grad)
    got = emulated_ring(q, k, v, grad, cp_size)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), w, **(tolerance or TOLERANCES[dtype]), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups", [NH, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("cp_size", [2, 4])
def test_ring_blocks_equal_causal_sdpa(cp_size, groups, dtype):
    assert_ring_equals_sdpa(cp_size, groups, dtype)


def ring_step(chunk: int, dtype=torch.float32, device="cpu"):
    """A function running forward + backward of the ring's first step on CP rank 0 of 2 (the two causal
    diagonal blocks and one full block, on chunks of c = ``chunk``), from inputs made here."""
    q, k, v, grad = inputs(2 * 2 * chunk, 2, dtype, device)
    cp = ContextParallel(rank=0, size=2)
    p = local_positions(q.shape[0], 0, 2, q.device)
    q, kv, grad = q[p], KVBlock.of(k[p], v[p]), grad[p].view(2 * chunk, B, NH, D)
    blocks = list(_blocks(MaskSpec(), cp.chunk_ids(), cp.chunk_ids(), chunk, B))
    assert [blk.causal for blk in blocks] == [True, False, True]

    def run():
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, NH, 2 * chunk, dtype=torch.float32, device=q.device)
        _attend(q, kv, blocks, out, lse, [False, False], D ** -0.5)
        result = out.to(dtype)
        dq, dkv = torch.zeros_like(out), kv.new(torch.float32, zeros=True)
        _attend_backward(grad, q, kv, result, lse, blocks, dq, dkv, D ** -0.5)
    return run


def step_peak_bytes(chunk: int) -> int:
    """Peak bytes of the tensors one ring step creates (accumulators, kernel outputs, temporaries) alive at once."""
    run = ring_step(chunk)
    with LiveBytes() as live:
        run()
    return live.peak


def test_ring_step_memory_is_linear_in_the_chunk_length():
    """What one step holds is a few [2c, b, heads, d] fp32 tensors (output and dQ accumulators, dK/dV,
    kernel outputs), not the [b, heads, c, c] scores of a block: measured against that unit at c and 4c."""
    peaks = {}
    for chunk in (256, 1024):
        unit = 2 * chunk * B * NH * D * 4                       # one fp32 [2c, b, heads, d] tensor
        peaks[chunk] = step_peak_bytes(chunk)
        assert peaks[chunk] <= 6 * unit, (chunk, peaks[chunk] / unit)
    assert peaks[1024] / peaks[256] == pytest.approx(4.0, rel=0.1)          # c x 4: memory x 4, not x 16
    scores = B * NH * 1024 * 1024 * 4                                      # one block's fp32 scores at c = 1024
    assert peaks[1024] < scores / 4


def test_blocks_follow_the_mask_by_global_chunk_positions():
    """Rank 0 of 4 holds chunks 0 and 7 (c = 4), rank 3 chunks 3 and 4: a 3-token window empties every pair
    (no kernel runs); documents make per-sample blocks, cut ones carrying the mask of their positions."""
    assert list(_blocks(MaskSpec(window=(3, 0)), (0, 7), (3, 4), 4, B)) == []
    assert [(b.qi, b.ki, b.causal) for b in _blocks(MaskSpec(), (0, 7), (3, 4), 4, B)] == [(1, 0, False), (1, 1, False)]
    cu = torch.tensor([[0, 20, 32], [0, 14, 32]], dtype=torch.int32)
    blocks = list(_blocks(MaskSpec(cu_seqlens=cu), (0, 7), (3, 4), 4, B))
    # queries [28, 32): sample 0's keys [12, 20) are another document; sample 1's document starts at 14
    assert [(b.qi, b.ki, b.rows.start, b.mask is None) for b in blocks] == [(1, 0, 1, False), (1, 1, 1, True)]
    blocks = list(_blocks(MaskSpec(cu_seqlens=cu), (3, 4), (3, 4), 4, B))
    cut = [b for b in blocks if b.rows.start == 1 and b.qi == 0 and b.ki == 0][0]       # chunk 3 = [12, 16)
    assert cut.mask.tolist() == MaskSpec(cu_seqlens=cu).visible(1, torch.arange(12, 16), torch.arange(12, 16)).tolist()
    assert not cut.mask[2, 1]                                                 # 14 does not see 13
