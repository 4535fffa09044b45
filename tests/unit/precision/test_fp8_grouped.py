"""The experts' FP8 GEMMs over rows from several micro-batches (expert parallelism over data-parallel ranks
puts them into one grouped GEMM): each micro-batch's rows are quantised as the single process quantises
that micro-batch alone, in every GEMM (the weight gradient contracts over the tokens, so its tiles and
rows along the tokens must not cross micro-batches); one scale over all of them gives other products. The
dispatcher's segments merge the sources that hold parts of one micro-batch."""
import pytest
import torch

from megalite.parallel.expert.dispatch import microbatch_segments
from megalite.precision import fp8, fp8_quant
from megalite.precision.fp8 import Fp8Recipe
from test_fp8_recipes import RECIPES, assert_fp32_close, operands, reference_products

COUNTS, SEGMENTS = [70, 0, 60], [[30, 40], [0, 0], [60, 0]]       # rows per expert, per expert and micro-batch


def grouped(name: str, x, weight, g, segments):
    precision = Fp8Recipe(name, "hybrid", emulate=True).build()
    return (precision.grouped_forward(x, weight, COUNTS, segments),
            precision.grouped_grad_input(g, weight, COUNTS, segments),
            precision.grouped_grad_weight(g, x, COUNTS, segments))


def data():
    x, _, g = operands(tokens=sum(COUNTS))
    x[30:70] *= 10                          # the second micro-batch's rows of expert 0: another amax
    g[30:70] *= 10
    weight = torch.randn(3, 128, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    return x, weight, g


@pytest.mark.parametrize("name", RECIPES)
def test_each_microbatch_is_scaled_as_the_single_process_scales_it(name):
    """Per expert and micro-batch, the products are those of that micro-batch's rows alone (quantise ->
    dequantise -> fp32 matmul); the weight gradient is their sum over the micro-batches."""
    x, weight, g = data()
    out, d_rows, d_weight = grouped(name, x, weight, g, SEGMENTS)
    start = 0
    for e, sizes in enumerate(SEGMENTS):
        grad_w = torch.zeros_like(weight[e])
        for n in sizes:
            if n:
                rows = slice(start, start + n)
                y, grad_x, part_w = reference_products(name, "hybrid", x[rows], weight[e], g[rows])
                assert_fp32_close(out[rows], y)
                assert_fp32_close(d_rows[rows], grad_x)
                grad_w += part_w
            start += n
        assert_fp32_close(d_weight[e], grad_w)


@pytest.mark.parametrize("name", [name for name in RECIPES if not name.startswith("rowwise")])
def test_one_scale_over_the_microbatches_differs(name):
    """Without the segments a tensor scale (tensorwise, fresh delayed) covers both micro-batches' rows in
    every GEMM, and the block recipes' tiles along the tokens do in the weight gradient. (Rowwise scales are
    powers of two: a row's scale over both micro-batches is its own times a power of two, which quantises
    to the same values outside the subnormals.)"""
    x, weight, g = data()
    apart, together = grouped(name, x, weight, g, SEGMENTS), grouped(name, x, weight, g, None)

    def differs(a, b):
        return ((a - b).abs().max() / b.abs().max()).item() > 1e-3
    assert differs(together[2], apart[2])
    assert differs(together[0], apart[0]) == (name in ("tensorwise", "delayed"))


def test_sources_of_one_microbatch_merge():
    """Per expert, the group's ranks in order: ranks 0 and 1 hold one micro-batch, 2 and 3 another."""
    assert microbatch_segments([[1, 2, 3, 4], [0, 5, 6, 0]], (0, 0, 1, 1)) == [[3, 7], [5, 6]]
    assert microbatch_segments([[1, 2]], (0, 1)) == [[1, 2]]


def _grouped_mm_by_definition(a, b, scale_a, scale_b, offs, out_dtype):
    """torch._scaled_grouped_mm's 2-D x 3-D product by its definition: group g's rows of a (rows up to
    offs[g]) times b[g], each row of a times its scale_a, each column of b[g] times scale_b[g]."""
    out, start = [], 0
    for group, stop in enumerate(offs.tolist()):
        out.append((a[start:stop].float() * scale_a[start:stop, None]) @ (b[group].float() * scale_b[group][None]))
        start = stop
    return torch.cat(out).to(out_dtype)


@pytest.mark.parametrize("role", ["input", "grad"])
def test_rowwise_experts_run_one_grouped_kernel_where_there_is_one(monkeypatch, role):
    """The CPU has no torch._scaled_grouped_mm (the probe says so, and the experts loop); its argument
    contract holds (torch's meta kernel checks layouts, strides and scale shapes), and with the product
    by definition in its place the grouped GEMM gives the per-expert emulation's."""
    assert not fp8.has_grouped_kernel("rowwise", "e4m3", torch.device("cpu"), role, torch.bfloat16)
    counts = [32, 0, 48, 16]
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(sum(counts), 256, generator=g, dtype=torch.bfloat16)
    weight = (torch.randn(len(counts), 128, 256, generator=g) * 0.05).to(torch.bfloat16)
    real = Fp8Recipe("rowwise", "e4m3").build()
    qa, qw = real.quantise(rows, role), real.quantise(weight.reshape(-1, 256), "weight")
    meta = [fp8_quant.Quantised(q.data.to("meta"), q.scale_inv.to("meta"), q.rows, q.cols, q.shape) for q in (qa, qw)]
    assert fp8_quant.scaled_grouped_mm(*meta, counts, torch.bfloat16).shape == (sum(counts), 128)
    monkeypatch.setattr(fp8, "has_grouped_kernel", lambda *args: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _grouped_mm_by_definition)
    assert real.grouped_on_kernel(rows, role, weight, counts)
    emulated = Fp8Recipe("rowwise", "e4m3", emulate=True).build()
    assert torch.equal(real._grouped(rows, role, weight, counts, None, (None, None)),
                       emulated._grouped(rows, role, weight, counts, None, (None, None)))
