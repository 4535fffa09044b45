"""The quantiser's working copies (precision/fp8_quant.gemm_working_bytes, which the planner counts): the
peak bytes one FP8 GEMM's quantisation allocates, measured over the tensors its operators create (as
the dry run's memory account counts them), equal the formula for every recipe, and a weight that comes
in FP8 (gathered so) is not quantised again."""
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megalite.precision.fp8 import INPUT, WEIGHT, Fp8Recipe
from megalite.precision.fp8_quant import QUANTISE_WORKING_BYTES, gemm_working_bytes

M, N, K = 256, 512, 128


class LiveBytes(TorchDispatchMode):
    """The largest sum of the storages operators create while the mode is on, each until it is freed
    (storages that existed before are not counted)."""

    def __init__(self, before: list[torch.Tensor]):
        super().__init__()
        self.seen = {t.untyped_storage()._cdata for t in before}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, _types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage()._cdata not in self.seen:
                storage = tensor.untyped_storage()
                self.seen.add(storage._cdata)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, storage._cdata, storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


def quantisation_peak(recipe: str, a: torch.Tensor, b) -> int:
    """Peak bytes of quantising a and b (b may come quantised) as the recipe's GEMM does it."""
    gemm = Fp8Recipe(recipe, "hybrid", emulate=True).build()
    with LiveBytes([a] + ([b] if isinstance(b, torch.Tensor) else [])) as live:
        qa = gemm.quantise(a, INPUT)
        qb = b if not isinstance(b, torch.Tensor) else gemm.quantise(b, WEIGHT)
        del qa, qb
    return live.peak


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise", "blockwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gemms_quantisation_holds_what_the_formula_says(recipe, dtype):
    a, b = torch.randn(M, K, dtype=dtype), torch.randn(N, K, dtype=dtype)
    blocks = {"rowwise": M + N, "blockwise": M * K // 128 + N * K // 128 ** 2}.get(recipe, 2)
    scales = 3 * 4 * blocks + 64             # each block's amax, scale and inverse scale (fp32), a few scalars
    measured = quantisation_peak(recipe, a, b)
    expected = gemm_working_bytes(M * K, N * K)
    assert expected <= measured <= expected + scales, (measured, expected)
    assert measured > 3 * (M + N) * K        # far above the FP8 operands' own byte per element


def test_a_weight_that_comes_in_fp8_is_not_quantised_again():
    gemm = Fp8Recipe("tensorwise", "hybrid").build()
    w = gemm.quantise(torch.randn(N, K), WEIGHT)
    measured = quantisation_peak("tensorwise", torch.randn(M, K), w)
    assert gemm_working_bytes(M * K, 0) <= measured <= gemm_working_bytes(M * K, 0) + 64
    assert gemm_working_bytes(M * K, 0) == QUANTISE_WORKING_BYTES * M * K
