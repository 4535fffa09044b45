"""The fast paths on one GPU: RMSNorm runs torch's fused rms_norm, which keeps only its input and an fp32
1/rms per row and gives the custom Function's values and gradients; selective recomputation leaves the
fused attention kernel alone (same saved bytes and attention calls as no recomputation) and recomputes
the math kernel and expanded K/V (fewer saved bytes), with equal losses and gradients
(tests/unit/model/test_fast_paths.py covers the CPU side)."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from bench.activation_memory import Shape, count_saved, model_config
from megalite.model.gpt import GPTModel
from megalite.model.attention import core
from megalite.model.kernels import _RMSNormFunction
from megalite.model.norms import RMSNorm

pytestmark = pytest.mark.cuda

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_on_the_gpu_keeps_input_and_rstd_and_equals_the_custom_backward(dtype):
    g = torch.Generator().manual_seed(0)
    rows, h = 256 * 2, 1024
    x = torch.randn(256, 2, h, generator=g).to(DEVICE, dtype).requires_grad_()
    grad = torch.randn(256, 2, h, generator=g).to(DEVICE, dtype)
    norm = RMSNorm(h, 1e-5, dtype).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(h, generator=g) + 0.5)
    with count_saved(norm) as saved:
        out = norm(x)
    assert saved.bytes() == x.numel() * x.element_size() + rows * 4
    if DEVICE.type == "cuda":
        assert "RMSNormFunction" not in type(out.grad_fn).__name__
    custom = _RMSNormFunction.apply(x, norm.weight, 1e-5)
    w32 = norm.weight.detach().float().requires_grad_()
    x32 = x.detach().float().requires_grad_()
    ref = F.rms_norm(x32, (h,), w32, 1e-5)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out, custom, **tol)
    torch.testing.assert_close(out.float(), ref, **tol)
    got = torch.autograd.grad(out, (x, norm.weight), grad)
    mine = torch.autograd.grad(custom, (x, norm.weight), grad)
    want = torch.autograd.grad(ref, (x32, w32), grad.float())
    for a, b, c in zip(got, mine, want):
        torch.testing.assert_close(a.float(), c, **tol)
        torch.testing.assert_close(a.float(), b.float(), **tol)


def _layer_run(shape: Shape, **overrides):
    """(bytes the last layer keeps, loss, gradients, core_attention calls) of a 2-layer model on the GPU."""
    calls = []
    real = core.core_attention
    core.core_attention = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        model = GPTModel(dataclasses.replace(model_config(shape), **overrides), seed=1).to(DEVICE)
        tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(0))
        with count_saved(model, {"layer": model.decoder.layers[-1]}) as record:
            loss = model(tokens.to(DEVICE), labels=tokens.to(DEVICE)).float().mean()
        loss.backward()
    finally:
        core.core_attention = real
    return record.bytes("layer"), loss.detach(), [p.grad for p in model.parameters()], len(calls)


@pytest.mark.parametrize("dtype, kv_heads", [("bfloat16", 2), ("float32", 4)])
def test_selective_recompute_leaves_fused_attention_alone_on_the_gpu(dtype, kv_heads):
    """bf16: the flash kernel on grouped K/V; fp32 MHA: the memory-efficient kernel. Both keep the log-sum-exp,
    not the scores: selective recomputation runs no second forward and keeps the same."""
    shape = Shape(dtype=dtype, seq=128, hidden=256, heads=4, kv_heads=kv_heads, ffn=512)
    plain = _layer_run(shape)
    selective = _layer_run(shape, recompute_granularity="selective")
    assert selective[0] == plain[0] and selective[3] == plain[3] == 2
    assert torch.equal(selective[1], plain[1])
    for a, b in zip(selective[2], plain[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_selective_recompute_still_pays_for_expanded_kv_on_the_gpu():
    """fp32 GQA: flash has no fp32 kernel, so K/V are expanded for the memory-efficient one, which keeps them
    expanded; recomputing attention keeps them grouped instead."""
    shape = Shape(dtype="float32", seq=128, hidden=256, heads=4, kv_heads=2, ffn=512)
    plain = _layer_run(shape)
    selective = _layer_run(shape, recompute_granularity="selective")
    if DEVICE.type == "cuda":
        assert selective[0] < plain[0] and selective[3] == 4 and plain[3] == 2
    torch.testing.assert_close(selective[1], plain[1], rtol=0, atol=0)


def test_selective_recompute_still_recomputes_the_math_kernel_on_the_gpu():
    """With only SDPA's math kernel allowed (it keeps the s x s scores), selective recomputation recomputes
    attention in backward and keeps less than no recomputation, with the same loss."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    shape = Shape(dtype="float32", seq=128, hidden=256, heads=4, kv_heads=2, ffn=512)
    with sdpa_kernel(SDPBackend.MATH):
        plain = _layer_run(shape)
        selective = _layer_run(shape, recompute_granularity="selective")
    if DEVICE.type == "cuda":
        assert selective[0] < plain[0] and selective[3] == 4 and plain[3] == 2
    torch.testing.assert_close(selective[1], plain[1])
