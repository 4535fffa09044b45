"""The FP8 recipes (megalite/precision/fp8.py): each GEMM of a linear, run through the linear's autograd
Function, equals quantise -> dequantise -> fp32 matmul with a quantiser written here (block by block, from
the recipes' definitions), for every recipe and format, on the real (torch._scaled_mm) and the emulated
path; both paths quantise alike; delayed scaling's history (one entry per step) and scales follow Transformer
Engine's rule; the
experts' grouped GEMMs are per-expert FP8 GEMMs."""
import math

import pytest
import torch

from megalite.parallel.tensor.layers import linear
from megalite.precision import fp8, fp8_quant
from megalite.precision.fp8 import FP8_RECIPE_CLASSES, Fp8Recipe, has_kernel

CPU = torch.device("cpu")
FMT_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FMT_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}
# each recipe's scaling block (rows, cols) of an operand [M, K] by role, K the contraction dimension; None:
# the whole tensor
BLOCKS = {
    "tensorwise": dict(input=None, weight=None, grad=None),
    "delayed": dict(input=None, weight=None, grad=None),
    "rowwise": dict(input=(1, None), weight=(1, None), grad=(1, None)),
    "rowwise_with_gw_hp": dict(input=(1, None), weight=(1, None), grad=(1, None)),
    "blockwise": dict(input=(1, 128), weight=(128, 128), grad=(1, 128)),
    "mxfp8": dict(input=(1, 32), weight=(1, 32), grad=(1, 32)),
}
RECIPES = [name for name in BLOCKS if name in FP8_RECIPE_CLASSES]
# the recipes whose scales are not fp8_max / amax: "e8m0" 2^(floor(log2 amax) - emax) (MXFP8, the OCP MX
# rule), "floor" fp8_max / amax rounded down to a power of two (torchao's rowwise)
SCALE_RULES = {"mxfp8": "e8m0", "rowwise": "floor"}


def reference_quantise(x: torch.Tensor, dtype, block, rule: str | None, scale: float | None = None):
    """x [M, K] quantised block by block: (the FP8 values as fp32, the dequantised values)."""
    m, k = x.shape
    rows, cols = (m, k) if block is None else (block[0] or m, block[1] or k)
    q, deq = torch.empty(m, k), torch.empty(m, k)
    for i in range(0, m, rows):
        for j in range(0, k, cols):
            piece = x[i:i + rows, j:j + cols].float()
            if scale is not None:
                s, s_inv = torch.tensor(scale), 1.0 / torch.tensor(scale)
            elif rule == "floor":
                s = torch.tensor(2.0 ** math.floor(math.log2(FMT_MAX[dtype] / max(piece.abs().max().item(), 1e-12))))
                s_inv = 1.0 / s
            elif rule == "e8m0":
                amax = max(piece.abs().max().item(), 1e-12)
                s_inv = torch.tensor(2.0 ** (math.floor(math.log2(amax)) - FMT_EMAX[dtype]))
                s = 1.0 / s_inv
            else:
                s = FMT_MAX[dtype] / torch.tensor(max(piece.abs().max().item(), 1e-12))
                s_inv = 1.0 / s
            values = (piece * s).clamp(-FMT_MAX[dtype], FMT_MAX[dtype]).to(dtype).float()
            q[i:i + rows, j:j + cols], deq[i:i + rows, j:j + cols] = values, values * s_inv
    return q, deq


def reference_products(name: str, fmt: str, x, w, g, scales=None):
    """(y, grad_x, grad_w) of y = x W^T from operands quantised by the reference quantiser."""
    grad_dtype = torch.float8_e5m2 if fmt == "hybrid" else torch.float8_e4m3fn
    e4m3, blocks, rule = torch.float8_e4m3fn, BLOCKS[name], SCALE_RULES.get(name)
    scales = scales or {}

    def deq(t, dtype, role):
        return reference_quantise(t, dtype, blocks[role], rule, scales.get(role))[1]

    y = deq(x, e4m3, "input") @ deq(w, e4m3, "weight").t()
    grad_x = deq(g, grad_dtype, "grad") @ deq(w.t(), e4m3, "weight").t()
    if name == "rowwise_with_gw_hp":
        grad_w = g.t() @ x
    else:
        grad_w = deq(g.t(), grad_dtype, "grad") @ deq(x.t(), e4m3, "input").t()
    return y, grad_x, grad_w


def operands(tokens=144, d_in=256, d_out=128, seed=0):     # 144: a partial 1 x 128 tile along the tokens
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d_in, generator=gen)
    x[3] *= 40.0                                   # rows and blocks of very different ranges
    w = torch.randn(d_out, d_in, generator=gen) * 0.05
    g = torch.randn(tokens, d_out, generator=gen) * 1e-3
    return x, w, g


def through_linear(precision, x, w, g):
    """(y, grad_x, grad_w) of the linear's autograd Function with ``precision``."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = linear(x, w, None, precision)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def assert_fp32_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def paths(name: str, fmt: str) -> list[bool]:
    """The emulate settings to test: emulated always, real where this machine has the kernels."""
    real = all(has_kernel(name, fmt, CPU, a, b, torch.float32) for a, b in fp8.PAIRS)
    return [True, False] if real else [True]


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("name", RECIPES)
def test_each_gemm_equals_quantise_dequantise_fp32_matmul(name, fmt):
    x, w, g = operands()
    expected = reference_products(name, fmt, x, w, g)        # delayed with a fresh history: tensorwise
    for emulate in paths(name, fmt):
        precision = Fp8Recipe(name, fmt, emulate=emulate).build()
        for got, want in zip(through_linear(precision, x, w, g), expected):
            assert_fp32_close(got, want)


def test_cpu_runs_tensorwise_and_rowwise_for_real_and_blockwise_mxfp8_emulated():
    assert len(paths("tensorwise", "hybrid")) == len(paths("rowwise", "e4m3")) == 2
    assert paths("blockwise", "hybrid") == [True]
    if "mxfp8" in RECIPES:
        assert paths("mxfp8", "e4m3") == [True]


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_real_and_emulated_paths_quantise_alike(name, monkeypatch):
    seen = {}
    assert paths(name, "hybrid") == [True, False]                  # the kernel probes, before recording

    def recording(kind, original):
        def mm(a, b, out_dtype):
            seen.setdefault(kind, []).append((a, b))
            return original(a, b, out_dtype)
        return mm

    monkeypatch.setattr(fp8, "scaled_mm", recording("real", fp8_quant.scaled_mm))
    monkeypatch.setattr(fp8, "emulated_mm", recording("emulated", fp8_quant.emulated_mm))
    x, w, g = operands()
    real = through_linear(Fp8Recipe(name, "hybrid").build(), x, w, g)
    emulated = through_linear(Fp8Recipe(name, "hybrid", emulate=True).build(), x, w, g)
    assert len(seen["real"]) == len(seen["emulated"]) == 3
    for pair_real, pair_emulated in zip(seen["real"], seen["emulated"]):
        for a, b in zip(pair_real, pair_emulated):
            assert a.data.dtype == b.data.dtype and torch.equal(a.data.float(), b.data.float())
            assert torch.equal(a.scale_inv, b.scale_inv)
    for got, want in zip(real, emulated):
        assert_fp32_close(got, want)


@pytest.mark.parametrize("name", RECIPES)
def test_main_grad_accumulates_the_fp8_weight_gradient(name):
    x, w, g = operands(tokens=64)
    precision = Fp8Recipe(name, "hybrid", emulate=True).build()
    expected = reference_products(name, "hybrid", x, w, g)[2]
    main_grad = torch.full_like(w, 0.5)
    assert precision.grad_weight(g, x, main_grad) is None
    assert_fp32_close(main_grad, expected + 0.5)


def test_quantised_values_match_the_reference_quantiser():
    x = operands(tokens=40)[0]
    for name in RECIPES:
        recipe = Fp8Recipe(name, "e4m3").build()
        if name == "delayed":
            continue
        for role in ("input", "weight"):
            q = recipe.quantise(x, role)
            ref_q, ref_deq = reference_quantise(x, torch.float8_e4m3fn, BLOCKS[name][role], SCALE_RULES.get(name))
            assert torch.equal(q.data.float()[:x.shape[0], :x.shape[1]], ref_q), (name, role)
            assert_fp32_close(q.dequantise(), ref_deq)
    assert Fp8Recipe("mxfp8", "e4m3").build().quantise(x, "input").scale_inv.dtype == torch.float8_e8m0fnu


@pytest.mark.parametrize("name", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_scales_each_gemm_operand_per_row_along_its_contraction(name):
    """The six operands rowwise quantises in a linear's three GEMMs, each one scale per row along K: x per
    token and W per output row (forward), grad_out per token and W^T per input column (input gradient),
    grad_out^T per output row and x^T per input column (weight gradient, K the tokens); rowwise rounds each
    scale fp8_max / amax down to a power of two (torchao's rowwise), rowwise_with_gw_hp keeps it as is."""
    x, w, g = operands(tokens=48)
    precision = Fp8Recipe(name, "hybrid", emulate=True).build()
    seen = []
    quantise = precision.quantise
    precision.quantise = lambda t, role, axes=None: seen.append((t.detach().clone(), role)) or quantise(t, role, axes)
    through_linear(precision, x, w, g)
    expected = [(x, "input"), (w, "weight"), (g, "grad"), (w.t(), "weight")]
    if name == "rowwise":
        expected += [(g.t(), "grad"), (x.t(), "input")]
    assert [role for _, role in seen] == [role for _, role in expected]
    for (operand, role), (want, _) in zip(seen, expected):
        torch.testing.assert_close(operand, want, rtol=0, atol=0)
        scale = quantise(operand, role).scale_inv.reciprocal()
        assert scale.shape == (operand.shape[0], 1)
        exact = FMT_MAX[precision.dtypes[role]] / operand.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        if name == "rowwise":
            assert torch.equal(scale, torch.exp2(torch.floor(torch.log2(exact)))), role
        else:                               # the reciprocal of the reciprocal: within fp32 rounding
            torch.testing.assert_close(scale, exact, rtol=1e-6, atol=0)


def test_delayed_scaling_history_and_scales():
    """Every GEMM of a step quantises with the scales of the earlier steps' amaxes (the first step, with no
    history, from its own amaxes, as tensorwise); the step's amax (the max over its micro-batches) enters the
    history once, after the step; an evaluation forward records nothing."""
    precision = Fp8Recipe("delayed", "hybrid", amax_history_len=3, amax_compute_algo="max").build()
    amaxes, grad_amaxes = [], []
    for step, factors in enumerate([(2.0, 3.0), (8.0, 1.0), (1.0, 0.5), (0.5, 0.25)]):
        scales = {"input": precision.input_scale.item(), "weight": precision.weight_scale.item(),
                  "grad": precision.grad_scale.item()} if step else None        # the first step: tensorwise
        step_max, grad_max, before = 0.0, 0.0, precision.input_amax_history.clone()
        for micro, factor in enumerate(factors):
            x, w, g = operands(tokens=64, seed=2 * step + micro)
            x, g = x * factor, g * factor
            for got, want in zip(through_linear(precision, x, w, g), reference_products("delayed", "hybrid", x, w,
                                                                                        g, scales)):
                assert_fp32_close(got, want)
            step_max, grad_max = max(step_max, x.abs().max().item()), max(grad_max, g.abs().max().item())
        precision.eval()
        precision(operands(seed=99)[0] * 100.0, w)           # evaluation: no record
        precision.train()
        assert torch.equal(precision.input_amax_history, before)          # unchanged until the step finishes
        fp8.finish_delayed_scaling_step([precision], [None])
        amaxes.append(step_max)
        grad_amaxes.append(grad_max)
        recent = list(reversed(amaxes[-3:])) + [0.0] * (3 - len(amaxes[-3:]))
        assert precision.input_amax_history.tolist() == pytest.approx(recent)
        assert precision.input_scale.item() == pytest.approx(448.0 / max(amaxes[-3:]))
        assert precision.grad_amax_history[0].item() == pytest.approx(grad_max)
        assert precision.grad_scale.item() == pytest.approx(57344.0 / max(grad_amaxes[-3:]))
    newest = Fp8Recipe("delayed", "e4m3", amax_history_len=3).build()
    for factor in (4.0, 1.0):
        newest(operands(seed=1)[0] * factor, operands()[1])
        fp8.finish_delayed_scaling_step([newest], [None])
    assert newest.input_scale.item() == pytest.approx(448.0 / newest.input_amax_history[0].item())
    assert newest.input_amax_history[0].item() < newest.input_amax_history[1].item()
    assert set(newest.state_dict()) == {f"{r}_{s}" for r in ("input", "weight", "grad") for s in ("amax_history", "scale")}


@pytest.mark.parametrize("name", RECIPES)
def test_grouped_gemms_are_per_expert_fp8_gemms(name):
    """Experts' GEMMs: each expert's rows and weight quantised as tensors of their own (delayed too while its
    history is fresh; then the whole grouped operand shares the recipe's scale)."""
    counts = [70, 0, 60]
    x, _, g = operands(tokens=sum(counts))
    weight = torch.randn(3, 128, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    precision = Fp8Recipe(name, "hybrid", emulate=True).build()
    out = precision.grouped_forward(x, weight, counts)
    d_rows = precision.grouped_grad_input(g, weight, counts)
    d_weight = precision.grouped_grad_weight(g, x, counts)
    start = 0
    scales = None                                   # delayed with a fresh history scales like tensorwise
    for e, n in enumerate(counts):
        rows, grad = x[start:start + n], g[start:start + n]
        if n:
            y, grad_x, grad_w = reference_products(name, "hybrid", rows, weight[e], grad, scales)
            assert_fp32_close(out[start:start + n], y)
            assert_fp32_close(d_rows[start:start + n], grad_x)
            assert_fp32_close(d_weight[e], grad_w)
        else:
            assert not d_weight[e].any()
        start += n


def test_an_output_the_kernels_cannot_take_is_emulated(monkeypatch):
    """130 tokens: the forward's and input gradient's outputs are not multiples of 16 rows, so they are
    emulated; the weight gradient (K = 130 tokens, padded) runs for real."""
    real = []
    assert paths("tensorwise", "hybrid") == [True, False]         # the kernel probes, before counting calls
    monkeypatch.setattr(fp8, "scaled_mm", lambda a, b, out_dtype: real.append(a.shape) or
                        fp8_quant.scaled_mm(a, b, out_dtype))
    x, w, g = operands(tokens=130)
    for got, want in zip(through_linear(Fp8Recipe("tensorwise", "hybrid").build(), x, w, g),
                         reference_products("tensorwise", "hybrid", x, w, g)):
        assert_fp32_close(got, want)
    assert real == [(128, 130)]
