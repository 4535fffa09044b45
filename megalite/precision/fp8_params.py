"""FP8 weights gathered by the data-parallel wrapper (--fp8-param-gather), and how a rank quantises its shard.

Under ZeRO a rank holds one contiguous range of a weight's flattened elements, cut anywhere (mid-row
included). The GEMM must see the same FP8 bytes and scales as if it quantised the whole weight itself
(fp8_quant.quantise): tensorwise one scale from the tensor's amax, blockwise one per 128 x 128 block. So
each rank takes the amax of every scaling block over the elements it holds (``shard_block_amax``: zero
for a block it holds none of, which no amax is below), the shard group all-reduces those amaxes with MAX
(a handful of numbers per weight), and each rank quantises its elements with the resulting scales
(``quantise_shard``): elementwise the arithmetic of fp8_quant.quantise, so the gathered bytes and scales
are bit for bit those of the unsharded weight's quantisation.

``GatheredWeight`` is one weight after the gather: its FP8 bytes (a view of the gathered bucket) and its
block scales. A recipe's GEMMs take it in place of quantising their weight (``Fp8Gemm.gathered``), as W
in forward and W^T in the input-gradient GEMM: the recipes whose weight blocks are the same for W and W^T
(one per tensor; square 128 x 128 blocks), ``PARAM_GATHER_RECIPES``. Delayed scaling's weight scale is
fixed for the step by its amax history, so the shards are quantised with it (``gather_scales``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megalite.config.fp8_fields import PARAM_GATHER_RECIPES
from megalite.precision.fp8 import ROLES, WEIGHT, DelayedScaling, Fp8Gemm
from megalite.precision.fp8_quant import AMAX_FLOOR, Quantised, fp8_max


def takes_gathered_weight(precision) -> bool:
    """Whether a layer's GEMM recipe can use a weight gathered in FP8."""
    return isinstance(precision, Fp8Gemm) and precision.recipe.name in PARAM_GATHER_RECIPES


@dataclass(frozen=True)
class WeightBlocks:
    """The scaling blocks of one weight [M, K]: ``rows`` x ``cols`` (clipped to the weight, as quantise does)."""
    shape: tuple
    rows: int
    cols: int

    @classmethod
    def of(cls, precision: Fp8Gemm, shape: tuple) -> "WeightBlocks":
        rows, cols = precision.blocks(WEIGHT)
        return cls(tuple(shape), min(rows, shape[0]), min(cols, shape[1]))

    @property
    def grid(self) -> tuple[int, int]:
        return -(-self.shape[0] // self.rows), -(-self.shape[1] // self.cols)

    @property
    def count(self) -> int:
        return self.grid[0] * self.grid[1]

    def index(self, first: int, n: int, device: torch.device) -> torch.Tensor:
        """The block of each flattened element first .. first + n - 1."""
        i = torch.arange(first, first + n, device=device)
        k = self.shape[1]
        return (i // k // self.rows) * self.grid[1] + (i % k) // self.cols


def shard_block_amax(values: torch.Tensor, first: int, blocks: WeightBlocks) -> torch.Tensor:
    """The amax of each block [count] over ``values``, the weight's flattened elements from ``first`` on
    (zero for blocks none of them is in)."""
    amax = torch.zeros(blocks.count, dtype=torch.float32, device=values.device)
    if not values.numel():
        return amax
    magnitudes = values.detach().float().abs()
    if blocks.count == 1:
        return magnitudes.amax().reshape(1)
    return amax.scatter_reduce_(0, blocks.index(first, values.numel(), values.device), magnitudes, "amax")


def block_scales(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each block's scale from its amax over the whole weight (fp8_quant.quantise's formula)."""
    return fp8_max(dtype) / amax.clamp(min=AMAX_FLOOR)


@torch.no_grad()
def gather_scales(precision: Fp8Gemm, amax: torch.Tensor) -> torch.Tensor:
    """The scales a weight is gathered with, from ``amax`` (its block amaxes over the whole weight): the
    current ones (``block_scales``), or delayed scaling's, fixed for the step by its history. Delayed scaling
    also takes ``amax`` into the step's weight amax, which its own quantisation of the weight would record;
    a gather ahead of an evaluation forward records it too, the same value the step's training forwards
    record, since the weight changes only at the optimizer step."""
    dtype = precision.dtypes[WEIGHT]
    if not isinstance(precision, DelayedScaling):
        return block_scales(amax, dtype)
    i = ROLES.index(WEIGHT)
    precision.step_amax[i] = torch.maximum(precision.step_amax[i], amax.max().to(precision.step_amax.device))
    fixed = precision.fixed_scale(WEIGHT)
    return block_scales(amax, dtype) if fixed is None else fixed.float().reshape(1).to(amax.device)


def quantise_shard(values: torch.Tensor, first: int, blocks: WeightBlocks, scales: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """``values`` (flattened elements from ``first`` on) in FP8 ``dtype`` with their blocks' ``scales``."""
    scale = scales if blocks.count == 1 else scales[blocks.index(first, values.numel(), values.device)]
    limit = fp8_max(dtype)
    return (values.detach().float() * scale).clamp(-limit, limit).to(dtype)


@dataclass
class GatheredWeight:
    """A weight [M, K] gathered in FP8: ``data`` [M, K] (FP8) and ``scale_inv`` [grid] of its ``blocks``."""
    data: torch.Tensor
    scale_inv: torch.Tensor
    blocks: WeightBlocks

    def quantised(self, transposed: bool = False) -> Quantised:
        """The weight (or its transpose) as the GEMM operand fp8_quant.quantise would have made of it."""
        b = self.blocks
        bytes_ = F.pad(self.data.view(torch.uint8), (0, -b.shape[1] % b.cols, 0, -b.shape[0] % b.rows))
        data, scale_inv = bytes_.view(self.data.dtype), self.scale_inv.reshape(b.grid)
        if not transposed:
            return Quantised(data, scale_inv, b.rows, b.cols, b.shape)
        return Quantised(data.t().contiguous(), scale_inv.t().contiguous(), b.cols, b.rows, b.shape[::-1])
