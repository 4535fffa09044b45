"""Masked attention on one GPU: documents and windows in bf16 run torch's varlen flash kernel and equal a
dense fp64 softmax with MaskSpec.visible's mask, forward and backward; sinks run the blockwise path on the
GPU's block kernels and equal the reference too (tests/unit/model/test_masked_attention.py covers CPU)."""
import pytest
import torch

from megalite.model.attention import masked
from megalite.model.attention.core import core_attention
from megalite.model.attention.mask import MaskSpec

pytestmark = pytest.mark.cuda

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
S, B, NH, GROUPS, D = 256, 2, 8, 2, 64
CU = torch.tensor([[0, 1, 100, 256, 256], [0, 60, 61, 200, 256]], dtype=torch.int32)


def _reference(q, k, v, grad, mask: MaskSpec, sinks):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    per = NH // GROUPS
    kk, vv = (t.repeat_interleave(per, dim=2) for t in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q, kk) * D ** -0.5
    pos = torch.arange(S, device=q.device)
    seen = torch.stack([mask.visible(i, pos, pos) for i in range(B)])[:, None]
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(1, NH, 1, 1).expand(B, NH, S, 1)], dim=-1)
    out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1)[..., :S], vv).reshape(S, B, NH * D)
    out.backward(grad.double())
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("with_sinks", [False, True], ids=["varlen", "sinks"])
@pytest.mark.parametrize("mask", [MaskSpec(cu_seqlens=CU.to(DEVICE)), MaskSpec(window=(32, 0)),
                                  MaskSpec(window=(16, 0), cu_seqlens=CU.to(DEVICE))],
                         ids=["documents", "window", "documents-window"])
def test_masked_attention_on_the_gpu_equals_the_reference(mask, with_sinks, monkeypatch):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(S, B, NH, D, generator=g)
    k, v = (torch.randn(S, B, GROUPS, D, generator=g) for _ in range(2))
    grad = torch.randn(S, B, NH * D, generator=g)
    q, k, v, grad = (t.to(DEVICE, torch.bfloat16) for t in (q, k, v, grad))
    sinks = torch.randn(NH, generator=g).to(DEVICE) if with_sinks else None
    blockwise = []
    monkeypatch.setattr(masked.BlockwiseAttention, "apply",
                        (lambda real: lambda *a: blockwise.append(1) or real(*a))(masked.BlockwiseAttention.apply))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = core_attention(q, k, v, mask, sinks=sinks)
    out.backward(grad)
    assert bool(blockwise) == (with_sinks or DEVICE.type != "cuda")
    for got, want in zip([out] + [t.grad for t in leaves], _reference(q, k, v, grad, mask, sinks)):
        torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)
