"""The GEMM seam: every dense GEMM of the tensor-parallel linears and every grouped GEMM of the experts is
a call to the layer's ``GemmPrecision``, so a lower-precision recipe (FP8 tensorwise, delayed, rowwise or
blockwise scaling) is one subclass and one line in ``RECIPES``, and no layer changes.

A linear layer runs three GEMMs per step, for y = x W^T with x [.., in] and W [out, in]:
- ``forward(x, w, bias)``: y = x W^T (+ bias) [.., out];
- ``grad_input(grad_out, w)``: grad_x = grad_y W [.., in];
- ``grad_weight(grad_out, x, main_grad)``: grad_W = grad_y^T x [out, in] over 2-D [tokens, ..] operands,
  or that added into the weight's fp32 ``main_grad`` by the GEMM itself (gradient-accumulation fusion:
  the layer passes ``main_grad`` when the weight is marked for it, and then gets None back).
The experts run the same three over rows grouped by expert, ``counts`` rows per expert, with one weight
[E, out, in] per expert: ``grouped_forward``, ``grouped_grad_input``, ``grouped_grad_weight``.

The layers' autograd Functions call these in both the plain backward and the zero-bubble split (B calls
the input GEMMs, the deferred W pass the weight GEMMs). Inside a torch.compile region the linears call
``forward`` alone and autograd derives its backward (compile builds the backward graph itself).

A recipe is an ``nn.Module`` that each layer owns as its ``precision`` submodule (one instance per layer,
from ``build_gemm_precision``): whatever state a recipe keeps (scales, amax histories) it registers as
buffers, which makes them persistent state of the layer that owns the GEMM, saved and loaded with it.

``GemmPrecision`` itself is the default recipe: every GEMM in its operands' own dtype (fp32, bf16, fp16),
with the fp32 accumulator of ``main_grad``. A recipe overrides the GEMMs it changes and inherits the rest.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GemmPrecision(nn.Module):
    """The GEMMs of the linear and expert layers, in the operands' own dtype (module docstring). The grouped
    GEMMs take each expert's rows' sizes per micro-batch (``segments``) and the operands' axes (``axes``),
    which a recipe that scales its operands (precision/fp8.py) uses and these GEMMs ignore."""
    # whether the grouped GEMMs need ``segments``: the dispatcher then orders each expert's rows by source
    scales_per_microbatch = False

    # ---- a linear layer: W [out, in] ------------------------------------------------------------------
    def forward(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x W^T (+ bias)."""
        return F.linear(x, w, bias)

    def grad_input(self, grad_out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """grad_x = grad_y W."""
        return grad_out.matmul(w)

    def grad_weight(self, grad_out: torch.Tensor, x: torch.Tensor,
                    main_grad: torch.Tensor | None = None) -> torch.Tensor | None:
        """grad_W = grad_out^T x for 2-D grad_out [T, out] and x [T, in]; with ``main_grad``, that added into
        it in the same GEMM, and None returned (nothing is left for autograd to accumulate)."""
        if main_grad is None:
            return grad_out.t().matmul(x)
        if main_grad.dtype == grad_out.dtype:
            main_grad.addmm_(grad_out.t(), x)
        else:       # bf16/fp16 operands, fp32 accumulator: PyTorch's mixed-dtype addmm
            torch.addmm(main_grad, grad_out.t(), x, out_dtype=main_grad.dtype, out=main_grad)
        return None

    # ---- the experts: rows [N, in] grouped by expert, weight [E, out, in] ------------------------------
    def grouped_forward(self, rows: torch.Tensor, weight: torch.Tensor, counts: list, segments: list | None = None,
                        axes: tuple = (None, None)) -> torch.Tensor:
        """Expert e's ``counts[e]`` rows times its weight transposed -> [N, out]."""
        return grouped_mm(rows, weight, counts)

    def grouped_grad_input(self, grad_out: torch.Tensor, weight: torch.Tensor, counts: list,
                           segments: list | None = None, axes: tuple = (None, None)) -> torch.Tensor:
        """grad_out [N, out] times each expert's weight -> grad_rows [N, in]."""
        return grouped_mm(grad_out, weight.transpose(-1, -2), counts)

    def grouped_grad_weight(self, grad_out: torch.Tensor, rows: torch.Tensor, counts: list,
                            segments: list | None = None, axes: tuple = (None, None)) -> torch.Tensor:
        """Per expert grad_out_e^T rows_e -> [E, out, in] (zero for an expert that got no rows)."""
        out = grad_out.new_empty(len(counts), grad_out.shape[1], rows.shape[1])
        for g, part, result in zip(grad_out.split(counts), rows.split(counts), out):
            if part.shape[0]:
                torch.mm(g.t(), part, out=result)
            else:
                result.zero_()
        return out


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, counts: list) -> torch.Tensor:
    """rows [N, in] grouped by expert x weight [E, out, in] per expert -> [N, out]. On a GPU in bf16
    torch._grouped_mm, one kernel for every expert, where its layout rule holds (every row stride a
    multiple of 16 bytes); elsewhere one matmul per expert written into its slice of the output
    (torch._grouped_mm on a CPU runs the same loop inside)."""
    width = rows.element_size()
    # CUDA's grouped GEMM kernel takes bf16 operands (fp32 and fp16 take the loop below)
    if (rows.device.type == "cuda" and rows.dtype == torch.bfloat16 and rows.shape[1] * width % 16 == 0
            and weight.shape[1] * width % 16 == 0
            and hasattr(torch, "_grouped_mm")):         # probe: torch's private grouped GEMM, absent before 2.8
        offsets = torch.tensor(counts, dtype=torch.int32, device=rows.device).cumsum(0, dtype=torch.int32)
        return torch._grouped_mm(rows, weight.transpose(-1, -2), offs=offsets)
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    for part, result, w in zip(rows.split(counts), out.split(counts), weight):
        if part.shape[0]:
            torch.mm(part, w.t(), out=result)
    return out


# ---- the recipes, by name ----------------------------------------------------------------------------------
DEFAULT_RECIPE = "default"
RECIPES: dict[str, type[GemmPrecision]] = {DEFAULT_RECIPE: GemmPrecision}


def build_gemm_precision(recipe=DEFAULT_RECIPE, layout=None) -> GemmPrecision:
    """A new instance of ``recipe`` (one per layer: a recipe's state is that layer's): a name in RECIPES,
    or a recipe with settings, which builds itself (fp8.py's Fp8Recipe) for the layer's ``layout`` (the
    ranks holding other parts of its operands, fp8_layout.py's GemmLayout; None: no other rank does)."""
    if not isinstance(recipe, str):
        return recipe.build() if layout is None else recipe.build(layout)
    if recipe not in RECIPES:
        raise ValueError(f"unknown GEMM precision recipe {recipe!r}; known: {', '.join(sorted(RECIPES))}")
    return RECIPES[recipe]()


def high_precision_recipe(recipe=DEFAULT_RECIPE):
    """The recipe of the GEMMs that stay out of FP8 (the output head, the layers --first-last-layers-bf16
    names): the default for a recipe with settings (FP8); a named recipe applies to them too."""
    return recipe if isinstance(recipe, str) else DEFAULT_RECIPE
