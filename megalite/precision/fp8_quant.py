"""FP8 quantisation of a GEMM operand, and the FP8 GEMM of two quantised operands.

Every recipe scales an operand in blocks along the GEMM's contraction dimension K: an operand [M, K] is
cut into blocks of ``rows`` x ``cols`` elements (M x K: one scale per tensor; 1 x K: one per row; 1 x 128
tiles; 128 x 128 blocks; 1 x 32 blocks), and each block b gets a scale s_b that maps its amax onto the
format's largest value:

    s_b = fp8_max / amax_b           q = saturate(x * s_b) in FP8          x ~ q * scale_inv_b, scale_inv_b = 1 / s_b

(an all-zero block takes amax 1e-12, so its scale stays finite). MXFP8 rounds the other way, to a power of
two stored as E8M0 (the OCP MX rule): scale_inv_b = 2^(floor(log2 amax_b) - emax), emax the exponent of
the format's largest value (8 for E4M3, 15 for E5M2). Rowwise scales are rounded down to a power of two
(torchao's rowwise recipe): s_b = 2^floor(log2(fp8_max / amax_b)), so a block's amax lands in
(fp8_max / 2, fp8_max], nothing saturates, and scaling and unscaling are exact in fp32 (the scale only moves
exponents). A delayed-scaling operand brings its scale instead.

A dimension that is not a whole number of blocks (the token count along a 1 x 128 tile) is padded with
zeros, which change neither an amax nor a product; ``Quantised`` keeps the padded shape and the true one.

The product of two quantised operands a [M, K] and b [N, K] (both with K last), a b^T, runs either on
``torch._scaled_mm`` (``scaled_mm``: the real path, where the device has the kernel for the scale layout
and the output's shape is aligned, ``kernel_aligned``) or as dequantise, dequantise, fp32 matmul
(``emulated_mm``); both read the same ``Quantised`` operands. The experts' GEMMs of rowwise-scaled operands
run all experts in one ``torch._scaled_grouped_mm`` (``scaled_grouped_mm``) where the device has it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# bytes per element that ``quantise`` holds at once for the operand it quantises (whole blocks): its fp32
# copy in blocks, the scaled copy and the clamped one (the 1-byte result comes after the scaled copy is freed)
QUANTISE_WORKING_BYTES = 12
AMAX_FLOOR = 1e-12                   # the amax of an all-zero block (torchao's EPS)
E8M0 = getattr(torch, "float8_e8m0fnu", None)       # torch >= 2.7: MXFP8's power-of-two scale dtype
KERNEL_ALIGNMENT = 16                # torch._scaled_mm's operands: every dimension a multiple of 16 (CUDA)


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


@dataclass
class Quantised:
    """An operand [M, K] in FP8: ``data`` [M', K'] (padded to whole blocks), ``scale_inv`` [M'/rows, K'/cols]
    (fp32, or E8M0 for MXFP8) with x ~ data * scale_inv over each block, ``shape`` the true [M, K]."""
    data: torch.Tensor
    scale_inv: torch.Tensor
    rows: int
    cols: int
    shape: tuple

    def dequantise(self) -> torch.Tensor:
        """The fp32 values the FP8 data stand for, [M, K]."""
        values = by_blocks(self.data.float(), self.rows, self.cols) * self.scale_inv.float()[:, None, :, None]
        return values.reshape(self.data.shape)[:self.shape[0], :self.shape[1]]


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    m, k = x.shape
    return F.pad(x, (0, -k % cols, 0, -m % rows))


def by_blocks(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A 2-D ``x`` of whole blocks viewed as [M / rows, rows, K / cols, cols]."""
    m, k = x.shape
    return x.reshape(m // rows, rows, k // cols, cols)


def quantise(x: torch.Tensor, dtype: torch.dtype, rows: int, cols: int, power_of_two: bool = False,
             scale: torch.Tensor | None = None, reduce_amax: Callable | None = None,
             round_scale_down: bool = False) -> Quantised:
    """``x`` [M, K] in ``dtype`` with one scale per ``rows`` x ``cols`` block (clipped to the tensor: a block
    larger than x is the whole tensor). ``power_of_two``: MXFP8's E8M0 scales; ``round_scale_down``: fp32
    scales fp8_max / amax rounded down to a power of two (module docstring).
    ``scale``: the scalar scale of a delayed-scaling operand (one block).
    ``reduce_amax``: takes the block amaxes [M/rows, K/cols] and returns them reduced (MAX) over the ranks
    that hold the other parts of the same blocks."""
    shape = tuple(x.shape)
    rows, cols = min(rows, shape[0]), min(cols, shape[1])
    blocks = by_blocks(_pad_to(x, rows, cols).float(), rows, cols)
    if scale is None:
        amax = blocks.abs().amax(dim=(1, 3))
        amax = (amax if reduce_amax is None else reduce_amax(amax)).clamp(min=AMAX_FLOOR)
        if power_of_two:
            emax = math.floor(math.log2(fp8_max(dtype)))
            scale_inv = torch.exp2(torch.floor(torch.log2(amax)) - emax).clamp(min=2.0 ** -127, max=2.0 ** 127)
            scale = scale_inv.reciprocal()
        else:
            scale = fp8_max(dtype) / amax
            if round_scale_down:            # frexp: scale = m 2^e with m in [0.5, 1), so 2^(e-1) <= scale exactly
                scale = torch.ldexp(torch.ones_like(scale), torch.frexp(scale).exponent - 1)
            scale_inv = scale.reciprocal()
    else:
        scale = scale.float().reshape(1, 1)
        scale_inv = scale.reciprocal()
    limit = fp8_max(dtype)
    data = (blocks * scale[:, None, :, None]).clamp(-limit, limit).to(dtype)
    data = data.reshape(blocks.shape[0] * rows, blocks.shape[2] * cols).contiguous()    # row-major, as the kernel reads
    if power_of_two:
        scale_inv = scale_inv.to(E8M0)
    return Quantised(data, scale_inv, rows, cols, shape)


def gemm_working_bytes(first: float, second: float, fp8_element_bytes: float = 1.0) -> float:
    """Peak bytes that quantising an FP8 GEMM's operands of ``first`` and ``second`` elements allocates, in the
    order the GEMM quantises them: the first's working copies, then the first in FP8 (``fp8_element_bytes``
    per element, scales included) beside the second's working copies. ``second`` 0: an operand that comes
    in FP8 (a weight gathered so). Counted from the code above, the planner's estimate of the copies a dry
    run measures."""
    return max(QUANTISE_WORKING_BYTES * first, fp8_element_bytes * first + QUANTISE_WORKING_BYTES * second)


def emulated_mm(a: Quantised, b: Quantised, out_dtype: torch.dtype) -> torch.Tensor:
    """a b^T [M, N] from the dequantised operands, multiplied in fp32."""
    return a.dequantise().matmul(b.dequantise().t()).to(out_dtype)


def _kernel_scale(q: Quantised) -> torch.Tensor:
    """A scale_inv in the layout torch._scaled_mm reads: a 0-d tensor for one scale per tensor; otherwise
    [M/rows, K/cols] (an A operand) whose transpose is the B operand's [K/cols, N/rows], stored with its
    M dimension contiguous for 1 x 128 tiles, as the blockwise kernels read them."""
    s = q.scale_inv
    if s.numel() == 1 and q.rows == q.data.shape[0] and q.cols == q.data.shape[1]:
        return s.reshape(())
    if q.rows == 1 and q.cols < q.data.shape[1]:
        return s.t().contiguous().t()
    return s


def kernel_aligned(a: Quantised, b: Quantised) -> bool:
    """Whether the FP8 GEMM kernels take a b^T's output shape: M and N multiples of KERNEL_ALIGNMENT
    (``scaled_mm`` pads K itself)."""
    return a.data.shape[0] % KERNEL_ALIGNMENT == 0 and b.data.shape[0] % KERNEL_ALIGNMENT == 0


def scaled_mm(a: Quantised, b: Quantised, out_dtype: torch.dtype) -> torch.Tensor:
    """a b^T [M, N] by torch._scaled_mm on the FP8 data and their scales (the real path), K padded with
    zeros to the kernels' alignment (a scale per row or per tensor covers the padding too)."""
    sa, sb = _kernel_scale(a), _kernel_scale(b)
    pad = -a.data.shape[1] % KERNEL_ALIGNMENT
    data_a, data_b = (F.pad(q.data.view(torch.uint8), (0, pad)).view(q.data.dtype) for q in (a, b))
    out = torch._scaled_mm(data_a, data_b.t(), scale_a=sa, scale_b=sb.t() if sb.dim() else sb, out_dtype=out_dtype)
    return out[:a.shape[0], :b.shape[0]]


def scaled_grouped_mm(a: Quantised, b: Quantised, counts: list, out_dtype: torch.dtype) -> torch.Tensor:
    """Rows a [N, K] grouped by expert (``counts`` per expert) times each expert's b_e [N', K] transposed,
    b [E x N', K] the experts' stacked, both scaled per row: one torch._scaled_grouped_mm -> [N, N']."""
    experts = len(counts)
    offsets = torch.tensor(counts, dtype=torch.int32, device=a.data.device).cumsum(0, dtype=torch.int32)
    data_b = b.data.view(experts, -1, b.data.shape[1]).transpose(-1, -2)          # [E, K, N'] column-major
    return torch._scaled_grouped_mm(a.data, data_b, a.scale_inv.reshape(-1), b.scale_inv.view(experts, -1),
                                    offs=offsets, out_dtype=out_dtype)
