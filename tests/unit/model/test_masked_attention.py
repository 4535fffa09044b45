"""Masked attention (megalite/model/attention/masked.py): documents, windows and sinks through
core_attention equal a dense fp64 softmax with MaskSpec.visible's boolean mask (sinks as an extra logit
in the denominator), forward and backward; the tiles follow the documents; plain masks keep SDPA's path
bit for bit; and at s = 8K with 1K-token documents the blockwise path keeps and peaks at no more than
the unmasked flash kernel (x1.2)."""
import pytest
import torch
import torch.nn.functional as F

from bench.activation_memory import count_saved
from bench.cross_entropy_memory import LiveBytes
from megalite.model.attention import core, masked
from megalite.model.attention.core import core_attention, recomputing_pays, run_core_attention
from megalite.model.attention.mask import MaskSpec, Relation

S, B, NH, D_QK, D_V = 40, 2, 4, 12, 8
SCALE = 0.3
# per-sample boundaries: documents of length 1, documents crossing the (test) tile boundaries 8, 16, ...
CU = torch.tensor([[0, 3, 4, 20, 40, 40], [0, 17, 18, 30, 33, 40]], dtype=torch.int32)
DEFAULT_SIZES = {name: getattr(masked, name) for name in ("TILE", "WINDOW_TILE", "PACK")}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles of 8 tokens and packing below 3, so 40 tokens make many tiles, cut and packed blocks."""
    for name, size in (("TILE", 8), ("WINDOW_TILE", 8), ("PACK", 3)):
        monkeypatch.setattr(masked, name, size)


def _inputs(groups: int, dtype=torch.float32, heads: int = NH):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(S, B, heads, D_QK, generator=g)
    k, v = torch.randn(S, B, groups, D_QK, generator=g), torch.randn(S, B, groups, D_V, generator=g)
    grad = torch.randn(S, B, heads * D_V, generator=g)
    sinks = torch.randn(heads, generator=g)
    return [t.to(dtype) for t in (q, k, v, grad)] + [sinks]


def _reference(q, k, v, grad, mask: MaskSpec, sinks):
    """(out, dq, dk, dv, dsinks) of the dense fp64 softmax with the boolean mask and the sink logits."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    sinks = None if sinks is None else sinks.detach().double().requires_grad_()
    heads, per = q.shape[2], q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(per, dim=2) for t in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q, kk) * SCALE
    pos = torch.arange(S)
    seen = torch.stack([mask.visible(i, pos, pos) for i in range(B)])[:, None]
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, heads, 1, 1).expand(B, heads, S, 1)], dim=-1)
    out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1)[..., :S], vv).reshape(S, B, heads * D_V)
    out.backward(grad.double())
    return out.detach(), q.grad, k.grad, v.grad, None if sinks is None else sinks.grad


CASES = {
    "documents": (MaskSpec(cu_seqlens=CU), False),
    "documents-full": (MaskSpec(causal=False, cu_seqlens=CU), False),
    "window-left": (MaskSpec(window=(5, -1)), False),
    "window-both-no-causal": (MaskSpec(causal=False, window=(3, 6)), False),
    "documents-window": (MaskSpec(window=(6, 0), cu_seqlens=CU), False),
    "sinks-causal": (MaskSpec(), True),
    "sinks-documents": (MaskSpec(cu_seqlens=CU), True),
    "sinks-documents-window": (MaskSpec(window=(4, 0), cu_seqlens=CU), True),
}


def _run(case: str, groups: int, dtype=torch.float32, learnable: bool = True):
    mask, with_sinks = CASES[case]
    q, k, v, grad, sinks = _inputs(groups, dtype)
    sinks = sinks.requires_grad_(learnable) if with_sinks else None
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = core_attention(q, k, v, mask, scale=SCALE, sinks=sinks)
    out.backward(grad)
    got = [out] + [t.grad for t in leaves] + [None if sinks is None else sinks.grad]
    return got, _reference(q, k, v, grad, mask, sinks)


def _assert_matches(got, want, **tol):
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        if w is None:
            assert g is None, name
            continue
        torch.testing.assert_close(g.double(), w, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("groups", [NH, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("case", list(CASES))
def test_masked_attention_equals_the_dense_fp64_reference(case, groups):
    got, want = _run(case, groups)
    _assert_matches(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("case", ["documents-window", "sinks-documents-window"])
def test_masked_attention_in_bf16_is_close_to_the_reference(case):
    got, want = _run(case, 2, torch.bfloat16)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16
    _assert_matches(got, want, rtol=5e-2, atol=5e-2)


def test_a_fixed_sink_logit_off_by_one_gets_no_gradient_and_lowers_every_row():
    """Megatron's off-by-one softmax: a sink logit 0 that is no parameter."""
    mask = MaskSpec(cu_seqlens=CU)
    q, k, v, grad, _ = _inputs(2)
    zero = torch.zeros(NH)
    out = core_attention(q, k, v, mask, scale=SCALE, sinks=zero)
    _assert_matches([out], _reference(q, k, v, grad, mask, zero)[:1], rtol=1e-5, atol=2e-6)
    assert not torch.equal(out, core_attention(q, k, v, mask, scale=SCALE))


def test_tiles_follow_the_documents():
    """One causal block per document shorter than a tile; longer ones cut into causal diagonal and full
    blocks; very short documents packed into one masked block; different documents never paired."""
    cu = torch.tensor([[0, 5, 11, 12, 13, 14, 30, 40]], dtype=torch.int32)
    plan = list(masked.tiles(MaskSpec(cu_seqlens=cu), S, S, 1))
    kinds = {(t.q, k): (r if isinstance(r, str) else "mask") for t in plan for k, r in t.blocks}
    assert kinds == {((0, 5), (0, 5)): Relation.CAUSAL, ((5, 11), (5, 11)): Relation.CAUSAL,
                     ((11, 14), (11, 14)): "mask",
                     ((14, 22), (14, 22)): Relation.CAUSAL, ((22, 30), (14, 22)): Relation.FULL,
                     ((22, 30), (22, 30)): Relation.CAUSAL, ((30, 35), (30, 35)): Relation.CAUSAL,
                     ((35, 40), (30, 35)): Relation.FULL, ((35, 40), (35, 40)): Relation.CAUSAL}


def test_a_window_skips_the_tiles_outside_it():
    plan = list(masked.tiles(MaskSpec(window=(3, -1)), S, S, B))
    assert all(t.samples == slice(None) for t in plan)                    # one mask: the whole batch at once
    assert max(len(t.blocks) for t in plan) == 2 and sum(len(t.blocks) for t in plan) == 9


def test_plain_masks_keep_the_sdpa_path_bit_for_bit(monkeypatch):
    monkeypatch.setattr(core, "masked_attention", lambda *a, **kw: pytest.fail("plain mask took the masked path"))
    q, k, v, _, _ = _inputs(NH)
    for causal in (True, False):
        out = run_core_attention(q, k, v, MaskSpec(causal=causal), scale=SCALE)
        # V zero-padded to Q/K's head dim for CPU's fused kernel (core._sdpa_inputs), its padding cut off
        padded = F.pad(v, (0, D_QK - D_V))
        want = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, padded)), is_causal=causal,
                                              scale=SCALE)[..., :D_V]
        assert torch.equal(out, want.permute(2, 0, 1, 3).reshape(S, B, -1))


def test_masked_attention_is_never_recomputed_and_refuses_dropout():
    q, k, v, _, sinks = _inputs(2)
    assert not recomputing_pays(q, k, v, MaskSpec(cu_seqlens=CU), dropout=0.0, cp=None)
    assert not recomputing_pays(q, k, v, MaskSpec(), dropout=0.0, cp=None, sinks=sinks)
    with pytest.raises(ValueError, match="--attention-dropout"):
        core_attention(q, k, v, MaskSpec(window=(4, 0)), dropout=0.1)


def test_meta_masked_attention_has_the_right_shape():
    q, k, v, _, sinks = (t.to("meta") for t in _inputs(2))
    out = core_attention(q, k, v, MaskSpec(cu_seqlens=CU.to("meta")), sinks=sinks)
    assert out.shape == (S, B, NH * D_V) and out.device.type == "meta"


# ---- memory: the blockwise path against the unmasked flash kernel -----------------------------------
def _forward_memory(mask: MaskSpec, q, k, v) -> tuple[int, int]:
    """(bytes saved for backward, distinct storages; peak bytes the forward's ops hold at once)."""
    with count_saved() as saved, LiveBytes() as live:
        out = core_attention(q, k, v, mask)
    del out
    return saved.bytes(), live.peak


def _document_rows(batch: int, seq: int, lengths: list[int]) -> torch.Tensor:
    cu = torch.tensor([0] + lengths).cumsum(0)
    return torch.stack([cu] * batch).to(torch.int32)


def _assert_within_flash_memory(batch, heads, groups, d, cu, monkeypatch):
    for name in ("TILE", "WINDOW_TILE", "PACK"):
        monkeypatch.setattr(masked, name, DEFAULT_SIZES[name])
    seq = int(cu[0, -1])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(seq, batch, heads, d, generator=g).requires_grad_()
    k, v = (torch.randn(seq, batch, groups, d, generator=g).requires_grad_() for _ in range(2))
    saved, peak = _forward_memory(MaskSpec(cu_seqlens=cu), q, k, v)
    flash_saved, flash_peak = _forward_memory(MaskSpec(), q, k, v)
    assert saved <= 1.2 * flash_saved and peak <= 1.2 * flash_peak, (saved, flash_saved, peak, flash_peak)


def test_masked_attention_memory_at_8k_with_1k_documents_is_within_flash(monkeypatch):
    _assert_within_flash_memory(1, 4, 2, 32, _document_rows(1, 8192, [1024] * 8), monkeypatch)


@pytest.mark.slow
def test_masked_attention_memory_with_uneven_documents_is_within_flash(monkeypatch):
    g = torch.Generator().manual_seed(1)
    lengths = (torch.rand(15, generator=g) * 1000 + 40).long().tolist()
    _assert_within_flash_memory(2, 8, 2, 64, _document_rows(2, 8192, lengths + [8192 - sum(lengths)]), monkeypatch)


@pytest.mark.parametrize("mask", [MaskSpec(window=(5, 0)), MaskSpec(cu_seqlens=CU)], ids=["window", "documents"])
def test_queries_that_are_the_last_of_the_keys_see_what_their_positions_see(mask):
    """With a KV cache the s queries are the last s of t positions (generation with a window)."""
    s = 13
    q, k, v, _, sinks = _inputs(2)
    q = q[-s:]
    out = core_attention(q, k, v, mask, scale=SCALE, sinks=sinks)
    kk, vv = (t.double().repeat_interleave(NH // 2, dim=2) for t in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q.double(), kk) * SCALE
    seen = torch.stack([mask.visible(i, torch.arange(S - s, S), torch.arange(S)) for i in range(B)])[:, None]
    scores = torch.cat([scores.masked_fill(~seen, float("-inf")), sinks.double().view(1, NH, 1, 1).expand(B, NH, s, 1)],
                       dim=-1)
    want = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1)[..., :S], vv).reshape(s, B, NH * D_V)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-6)
