"""What autograd keeps per transformer layer (bench/activation_memory.py counts it).

A layer keeps what its backward needs and nothing more: at TP=1 no more than transformers'
LlamaForCausalLM on the same config, and the architecture minimum of Korthikanti et al.'s accounting
(norm inputs, QKV and fc1 inputs, unexpanded Q/K/V, one attention output, SwiGLU's fc1 output and fc2
input, 1-byte dropout masks). The memory-saving pieces (RMSNorm and SwiGLU that recompute in
backward, GQA attention on unexpanded K/V) give the same outputs and gradients as the plain ops.
"""
import pytest
import torch
import torch.nn.functional as F

from bench.activation_memory import (LLAMA, Shape, count_saved, megalite_layer_bytes, megatron_formula_bytes,
                                     minimum_bytes, transformers_layer_bytes)
from megalite.model.mlp import swiglu
from megalite.model.kernels import dropout
from megalite.model.norms import RMSNorm

GPT = Shape(heads=4, kv_heads=4, ffn=1024, style="gpt", hidden_dropout=0.1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_layer_keeps_no_more_than_transformers_llama_and_the_minimum(dtype):
    shape = Shape(dtype=dtype)
    measured, hf = megalite_layer_bytes(shape), transformers_layer_bytes(shape)
    assert measured <= hf, (measured, hf)
    # exactly the architecture's minimum (up to the fp32 row statistics' rounding in the estimate)
    assert measured == pytest.approx(minimum_bytes(shape), rel=0.01)


def test_a_gpt_layer_keeps_megatrons_34sbh():
    """MHA, 4h GELU MLP, hidden dropout, 16 bit: Korthikanti's 34sbh per layer (flash attention keeps
    no s x s scores; the remainder is the fp32 log-sum-exp and LayerNorm statistics)."""
    measured = megalite_layer_bytes(GPT)
    assert megatron_formula_bytes(GPT) <= measured <= 1.01 * megatron_formula_bytes(GPT)


def test_gqa_attention_keeps_unexpanded_keys_and_values():
    _, breakdown = megalite_layer_bytes(LLAMA, breakdown=True)
    s, b, d = LLAMA.seq, LLAMA.batch, LLAMA.hidden // LLAMA.heads
    kv_shapes = [shape for _, saved in breakdown for shape, _ in saved if len(shape) == 4 and shape[-1] == d]
    assert (b, LLAMA.kv_heads, s, d) in kv_shapes                      # SDPA's k and v: [b, groups, s, d]
    assert kv_shapes.count((b, LLAMA.heads, s, d)) == 2               # q and the output; no repeated k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_enable_gqa_equals_repeated_keys_and_values(dtype):
    g = torch.Generator().manual_seed(0)
    b, a, groups, s, d = 2, 8, 2, 32, 16
    q = torch.randn(b, a, s, d, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(b, groups, s, d, generator=g).to(dtype).requires_grad_() for _ in range(2))
    grad = torch.randn(b, a, s, d, generator=g).to(dtype)
    expanded = F.scaled_dot_product_attention(q, k.repeat_interleave(a // groups, 1),
                                              v.repeat_interleave(a // groups, 1), is_causal=True)
    grouped = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(expanded, grouped)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    grads = [torch.autograd.grad(out, (q, k, v), grad) for out in (expanded, grouped)]
    for a_grad, b_grad in zip(*grads):
        torch.testing.assert_close(a_grad, b_grad, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_swiglu_and_dropout_equal_the_plain_ops_and_keep_less(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 2, 32, generator=g).to(dtype).requires_grad_()
    norm = RMSNorm(32, 1e-5, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32, generator=g) + 0.5)
    h = torch.randn(16, 2, 64, generator=g).to(dtype).requires_grad_()
    grad_x, grad_h = torch.randn(16, 2, 32, generator=g).to(dtype), torch.randn(16, 2, 32, generator=g).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}

    with count_saved(norm) as saved:
        out = norm(x)
    assert saved.bytes() == x.numel() * x.element_size() + 16 * 2 * 4         # the input + fp32 1/rms per row
    w = norm.weight.detach().clone().requires_grad_()
    ref = F.rms_norm(x.float(), (32,), w.float(), 1e-5)
    assert torch.equal(out, F.rms_norm(x, (32,), norm.weight, 1e-5))
    got = torch.autograd.grad(out, (x, norm.weight), grad_x)
    want = torch.autograd.grad(ref, (x, w), grad_x.float())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), **tol)

    with count_saved() as saved:
        out = swiglu(h)
    assert saved.bytes() == h.numel() * h.element_size()                         # fc1's output only
    gate, up = h.float().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    torch.testing.assert_close(out.float(), ref, **tol)
    torch.testing.assert_close(torch.autograd.grad(out, h, grad_h)[0].float(),
                               torch.autograd.grad(ref, h, grad_h.float())[0].float(), **tol)

    torch.manual_seed(7)
    with count_saved() as saved:
        out = dropout(x, 0.25, True)
    assert saved.bytes() == x.numel()                                           # a 1-byte mask
    torch.manual_seed(7)
    assert torch.equal(out, F.dropout(x, 0.25, True))                           # same draws and values
