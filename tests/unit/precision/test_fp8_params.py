"""--fp8-param-gather's quantisation of a weight held in shards: block amaxes over each shard, MAX over the
shards, each shard quantised with the resulting scales gives exactly the bytes and scales of quantising the
whole weight, as W and as W^T; a recipe's GEMMs taking the gathered weight equal those quantising it."""
import pytest
import torch

from megalite.precision.fp8 import WEIGHT, Fp8Recipe
from megalite.precision.fp8_params import (GatheredWeight, WeightBlocks, block_scales, quantise_shard,
                                           shard_block_amax)


def gathered(precision, w: torch.Tensor, cuts: list[int]) -> GatheredWeight:
    """``w`` as ranks holding flat ranges [cuts[i], cuts[i + 1]) would gather it."""
    flat, blocks, dtype = w.reshape(-1), WeightBlocks.of(precision, tuple(w.shape)), precision.dtypes[WEIGHT]
    ranges = list(zip(cuts, cuts[1:]))
    amax = torch.stack([shard_block_amax(flat[a:b], a, blocks) for a, b in ranges]).amax(dim=0)
    scales = block_scales(amax, dtype)
    data = torch.cat([quantise_shard(flat[a:b], a, blocks, scales, dtype) for a, b in ranges])
    return GatheredWeight(data.view(w.shape), scales.reciprocal(), blocks)


@pytest.mark.parametrize("recipe, shape", [("tensorwise", (48, 40)), ("blockwise", (300, 200)),
                                           ("blockwise", (96, 256))])
def test_shards_quantise_to_the_whole_weights_bytes_and_scales(recipe, shape):
    precision = Fp8Recipe(recipe, "e4m3", emulate=True).build()
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 5, shape[1])
    n = w.numel()
    cuts = [0, n // 3 + 7, n // 3 + 7, 2 * n // 3 - 5, n]         # cut mid-row, mid-block, one shard empty
    got = gathered(precision, w, cuts)
    for transposed, operand in ((False, w), (True, w.t())):
        ref, q = precision.quantise(operand, WEIGHT), got.quantised(transposed)
        assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)), transposed
        assert torch.equal(q.scale_inv, ref.scale_inv) and (q.rows, q.cols, q.shape) == (ref.rows, ref.cols, ref.shape)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_gemms_taking_the_gathered_weight_equal_those_quantising_it(recipe):
    g = torch.Generator().manual_seed(1)
    precision = Fp8Recipe(recipe, "hybrid", emulate=recipe == "blockwise").build()
    w, x, dy = torch.randn(256, 128, generator=g), torch.randn(32, 128, generator=g), torch.randn(32, 256, generator=g)
    expected = precision.forward(x, w), precision.grad_input(dy, w)
    precision.gathered = gathered(precision, w, [0, 5000, w.numel()])
    empty = torch.empty(w.shape, device="meta")        # no values: the GEMMs must not read the parameter
    assert torch.equal(precision.forward(x, empty), expected[0])
    assert torch.equal(precision.grad_input(dy, empty), expected[1])
