"""The FP8 recipes behind the GEMM seam (gemm.py): each GEMM of a linear or of the experts quantises its two
operands along the contraction dimension (fp8_quant.py), multiplies them, and returns the product in the
operands' dtype (or adds it into the fp32 ``main_grad``).

Roles: a GEMM operand is an input (activation), a weight or an output gradient. Input and weight are E4M3;
the gradient is E5M2 in the ``hybrid`` format and E4M3 in ``e4m3``. Each role is cut into the recipe's
scaling blocks (``blocks``): tensorwise and delayed one per tensor, rowwise one per row along K, blockwise
1 x 128 tiles for inputs and gradients and 128 x 128 blocks for weights, MXFP8 1 x 32 blocks with
power-of-two scales. Each GEMM quantises its operands anew along its own K (torchao's way), so the weight
gradient's operands are scaled along the tokens.

The product runs on ``torch._scaled_mm`` where the device has the kernel for the recipe's scale layout and
operand dtypes (``has_kernel``, probed once per device and layout against the emulation), the output's
rows and columns are multiples of 16 (an expert's token count need not be) and the recipe was not told to
emulate (--fp8-emulate); otherwise it is emulated: dequantise both, multiply in fp32.
Either way the quantised values and scales are the same. The experts' grouped GEMMs run the same GEMM per
expert and micro-batch: the single process runs each micro-batch alone, so each expert's rows of one
micro-batch are a tensor of their own, whichever ranks the rows came from (expert parallelism over
data-parallel ranks puts several micro-batches into one expert's GEMM; the dispatcher says which rows are
whose). Where both operands are scaled per row (rowwise) the forward and input-gradient GEMMs of all
experts run as one ``torch._scaled_grouped_mm`` where the device has it for the operand dtypes
(``has_grouped_kernel``, probed once against the per-expert emulation) and the shapes are aligned.

Delayed scaling (``DelayedScaling``, Transformer Engine's): each role keeps an amax history
(--fp8-amax-history-len, newest first) and a scale, buffers of the recipe module, and quantises with that
scale. The history takes one entry per optimizer step: every GEMM of a training forward or backward keeps
the running max of its operands' amaxes (``step_amax``; evaluation forwards, the module in eval mode,
keep nothing), and after the step's last backward ``finish_delayed_scaling_step`` reduces those maxima
(MAX) over every rank of the pipeline stage (the tensor-, context-, data- and expert-parallel ranks:
Transformer Engine's amax reduction group), rolls the histories one place with the step's amax first, and
sets each scale to fp8_max / (the newest amax, or the history's max with --fp8-amax-compute-algo max),
kept where that amax is 0 or not finite. The first step, with no history yet, scales each tensor from its
amax now, as tensorwise does (Transformer Engine starts from scale 1, which flushes small gradients to
zero, and flushes others at another layout, where the 1 / micro-batches factor is applied elsewhere).
The scales are therefore fixed through a step: every micro-batch's forward and backward, in any pipeline
schedule (1F1B, interleaved, zero-bubble's deferred weight gradients) and with full recomputation, use the
same ones, and the amax a step records is the max over all of its micro-batches, whichever ranks ran
them, so every layout records serial's history (to the fp32 rounding of the values it takes the max of).

Current scaling (the other recipes) reduces block amaxes over the ranks that hold parts of one block
(fp8_layout.py), per GEMM.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from megalite.config.fp8_fields import EMULATE_FLAG, FP8_BLOCKS, FP8_RECIPES
from megalite.config.schema import ModelConfig
from megalite.errors import UserError
from megalite.precision.fp8_quant import (E4M3, E5M2, E8M0, KERNEL_ALIGNMENT, Quantised, emulated_mm, fp8_max,
                                          kernel_aligned, quantise, scaled_grouped_mm, scaled_mm)
from megalite.precision.fp8_layout import FORWARD_AXES, GRAD_INPUT_AXES, GRAD_WEIGHT_AXES, SERIAL, GemmLayout
from megalite.precision.gemm import DEFAULT_RECIPE, GemmPrecision

INPUT, WEIGHT, GRAD = "input", "weight", "grad"
ROLES = (INPUT, WEIGHT, GRAD)
WHOLE = 1 << 62                      # a block dimension that covers the whole tensor (quantise clips it)
PAIRS = ((INPUT, WEIGHT), (GRAD, WEIGHT), (GRAD, INPUT))      # forward, grad_input, grad_weight


@dataclass(frozen=True)
class Fp8Recipe:
    """The FP8 settings the layers' recipes are built from (``TensorParallel.gemm_recipe``)."""
    name: str
    fp8_format: str = "hybrid"
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    emulate: bool = False
    # the device type whose kernels a GEMM of meta tensors picks (a run without storage plays that device's rank)
    meta_kernels: str = "meta"

    def build(self, layout: GemmLayout = SERIAL) -> "Fp8Gemm":
        return FP8_RECIPE_CLASSES[self.name](self, layout)


class Fp8Gemm(GemmPrecision):
    """Current scaling with one scale per tensor (--fp8-recipe tensorwise); the other recipes override
    ``blocks`` (their scaling blocks) or the scales they quantise with. ``layout``: the ranks holding the
    other parts of the operands (fp8_layout.py), over which block amaxes are reduced."""
    power_of_two = False
    scales_per_microbatch = True     # each micro-batch's rows of an expert are scaled apart (grouped GEMMs)
    round_scale_down = False         # fp32 scales rounded down to a power of two (fp8_quant.py)
    watch = None            # train/fp8_stats.py's Fp8Watch: scale range and NaN/Inf flag, on the device
    # the layer's weight gathered in FP8 with its scales (fp8_params.GatheredWeight, set and cleared by the
    # data-parallel wrapper under --fp8-param-gather): the GEMMs take it as is instead of quantising the weight
    gathered = None

    def __init__(self, recipe: Fp8Recipe, layout: GemmLayout = SERIAL):
        super().__init__()
        self.recipe, self.layout = recipe, layout
        self.dtypes = {INPUT: E4M3, WEIGHT: E4M3, GRAD: E5M2 if recipe.fp8_format == "hybrid" else E4M3}

    def blocks(self, role: str) -> tuple[int, int]:
        """(rows, cols) of one scaling block of an operand [M, K] of ``role``."""
        return WHOLE, WHOLE

    def quantise(self, x: torch.Tensor, role: str, axes: tuple[str, str] | None = None) -> Quantised:
        """x [M, K] of ``role`` in FP8; ``axes``: the linear's axes along M and K (fp8_layout.py), None for an
        operand no other rank holds part of."""
        rows, cols = self.blocks(role)
        return quantise(x, self.dtypes[role], rows, cols, self.power_of_two,
                        reduce_amax=self.layout.amax_reduction(tuple(x.shape), (rows, cols), axes),
                        round_scale_down=self.round_scale_down)

    def mm(self, a: torch.Tensor, a_role: str, b: torch.Tensor | Quantised, b_role: str, out_dtype: torch.dtype,
           axes: tuple = (None, None)) -> torch.Tensor:
        """a [M, K] times b [N, K] transposed, in FP8, as ``out_dtype`` [M, N]; ``axes``: a's and b's (b may
        come quantised: a weight gathered in FP8)."""
        qa = self.quantise(a, a_role, axes[0])
        qb = b if isinstance(b, Quantised) else self.quantise(b, b_role, axes[1])
        self._observe(qa, qb)
        device = torch.device(self.recipe.meta_kernels) if a.device.type == "meta" else a.device
        if not self.recipe.emulate and kernel_aligned(qa, qb) and has_kernel(
                self.recipe.name, self.recipe.fp8_format, device, a_role, b_role, out_dtype):
            return scaled_mm(qa, qb, out_dtype)
        return emulated_mm(qa, qb, out_dtype)

    def _observe(self, *operands: Quantised) -> None:
        """The operands' scales to the log's watch (train/fp8_stats.py), where one is set."""
        if self.watch is not None:
            for q in operands:
                self.watch.observe_scale_inv(q.scale_inv)

    def weight_operand(self, w: torch.Tensor, transposed: bool = False) -> torch.Tensor | Quantised:
        """W (or W^T) as a GEMM operand: the gathered FP8 weight standing for it, when there is one."""
        if self.gathered is not None:
            return self.gathered.quantised(transposed)
        return w.t() if transposed else w

    # ---- a linear layer ----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.mm(x.reshape(-1, x.shape[-1]), INPUT, self.weight_operand(w), WEIGHT, x.dtype, FORWARD_AXES)
        y = y.reshape(*x.shape[:-1], w.shape[0])
        return y if bias is None else y + bias

    def grad_input(self, grad_out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = self.mm(g, GRAD, self.weight_operand(w, transposed=True), WEIGHT, grad_out.dtype, GRAD_INPUT_AXES)
        return grad_x.reshape(*grad_out.shape[:-1], w.shape[1])

    def grad_weight(self, grad_out: torch.Tensor, x: torch.Tensor,
                    main_grad: torch.Tensor | None = None) -> torch.Tensor | None:
        product = self.mm(grad_out.t(), GRAD, x.t(), INPUT, grad_out.dtype if main_grad is None else main_grad.dtype,
                          GRAD_WEIGHT_AXES)
        if main_grad is None:
            return product
        main_grad.add_(product)
        return None

    # ---- the experts: one FP8 GEMM per expert and micro-batch ---------------------------------------------
    def grouped_forward(self, rows: torch.Tensor, weight: torch.Tensor, counts: list, segments: list | None = None,
                        axes: tuple = (None, None)) -> torch.Tensor:
        """As GemmPrecision's, each expert's rows cut into ``segments`` (per expert, its rows' sizes per
        micro-batch; None: one) with scales of their own; ``axes``: the operands' (fp8_layout.py)."""
        return self._grouped(rows, INPUT, weight, counts, segments, axes)

    def grouped_grad_input(self, grad_out: torch.Tensor, weight: torch.Tensor, counts: list,
                           segments: list | None = None, axes: tuple = (None, None)) -> torch.Tensor:
        return self._grouped(grad_out, GRAD, weight.transpose(-1, -2), counts, segments, axes)

    def _grouped(self, a: torch.Tensor, role: str, weight: torch.Tensor, counts: list, segments: list | None,
                 axes: tuple) -> torch.Tensor:
        """a [N, K] grouped by expert times each expert's weight [E, N', K] transposed -> [N, N']."""
        if self.grouped_on_kernel(a, role, weight, counts):       # rows scaled apart already: segments agree
            qa = self.quantise(a, role, axes[0])
            qw = self.quantise(weight.reshape(-1, weight.shape[-1]), WEIGHT, axes[1])
            self._observe(qa, qw)
            return scaled_grouped_mm(qa, qw, counts, a.dtype)
        out = a.new_empty(a.shape[0], weight.shape[1])
        for e, parts in expert_segments(counts, segments):
            w = self.quantise(weight[e], WEIGHT, axes[1])
            for part in parts:
                out[part] = self.mm(a[part], role, w, WEIGHT, a.dtype, axes)
        return out

    def grouped_on_kernel(self, a: torch.Tensor, role: str, weight: torch.Tensor, counts: list) -> bool:
        """Whether the experts' GEMM of ``a`` by ``weight`` runs as one torch._scaled_grouped_mm: both operands
        scaled per row, every dimension and expert's row count aligned, the kernel on the device."""
        per_row = self.blocks(role) == self.blocks(WEIGHT) == (1, WHOLE)
        aligned = all(n % KERNEL_ALIGNMENT == 0 for n in (*counts, *weight.shape[1:]))
        return per_row and aligned and not self.recipe.emulate and has_grouped_kernel(
            self.recipe.name, self.recipe.fp8_format, a.device, role, a.dtype)

    def grouped_grad_weight(self, grad_out: torch.Tensor, rows: torch.Tensor, counts: list,
                            segments: list | None = None, axes: tuple = (None, None)) -> torch.Tensor:
        """Per expert the sum over its segments of grad_out_s^T rows_s (the contraction runs over tokens, so
        each micro-batch's rows are scaled apart), in fp32 where there are several."""
        out = grad_out.new_zeros(len(counts), grad_out.shape[1], rows.shape[1])
        for e, parts in expert_segments(counts, segments):
            dtype = grad_out.dtype if len(parts) == 1 else torch.float32
            products = [self.mm(grad_out[part].t(), GRAD, rows[part].t(), INPUT, dtype, axes) for part in parts]
            out[e] = functools.reduce(torch.add, products)
        return out


def expert_segments(counts: list, segments: list | None):
    """(expert, [row slices of its non-empty segments]) for each expert with rows, rows grouped by expert
    (``counts`` per expert) and each expert's cut into ``segments`` (None: one segment each)."""
    start = 0
    for e, count in enumerate(counts):
        if count:
            parts, stop = [], start
            for size in (count,) if segments is None else segments[e]:
                if size:
                    parts.append(slice(stop, stop + size))
                stop += size
            yield e, parts
        start += count


class DelayedScaling(Fp8Gemm):
    """One scale per tensor from an amax history (module docstring): buffers ``{role}_amax_history``
    [history length] (newest first) and ``{role}_scale``, and the running max of this step's amaxes
    (``step_amax``, one per role, not saved: a checkpoint is written between steps). Until a step has been
    recorded (a fresh history) it scales like tensorwise, from the amaxes now (``recorded``: whether one
    has, read from the history once, then kept on the host)."""

    def __init__(self, recipe: Fp8Recipe, layout: GemmLayout = SERIAL):
        super().__init__(recipe, layout)
        for role in ROLES:
            self.register_buffer(f"{role}_amax_history", torch.zeros(recipe.amax_history_len, device="cpu"))
            self.register_buffer(f"{role}_scale", torch.ones(1, device="cpu"))
        self.register_buffer("step_amax", torch.zeros(len(ROLES), device="cpu"), persistent=False)
        self.recorded: bool | None = None

    def quantise(self, x: torch.Tensor, role: str, axes: tuple[str, str] | None = None) -> Quantised:
        if self.training and x.numel():
            with torch.no_grad():
                i = ROLES.index(role)
                self.step_amax[i] = torch.maximum(self.step_amax[i], x.detach().abs().max().float())
        scale = self.fixed_scale(role)
        if scale is None:
            return super().quantise(x, role, axes)
        return quantise(x, self.dtypes[role], WHOLE, WHOLE, scale=scale)

    def fixed_scale(self, role: str) -> torch.Tensor | None:
        """The scale ``role`` is quantised with this step, from its history; None before a step was recorded
        (then it scales from its amax now)."""
        if self.recorded is None:            # once (one host sync): the history is the same on every rank of the stage
            history = self.input_amax_history
            self.recorded = history.device.type != "meta" and bool(history.any())
        return self.get_buffer(f"{role}_scale") if self.recorded else None

    @torch.no_grad()
    def finish_step(self, amaxes: torch.Tensor) -> None:
        """Push the step's amax of each role (``amaxes`` [3], reduced) into its history, recompute its scale
        from the history, and start the next step's maxima."""
        for role, amax in zip(ROLES, amaxes):
            history, scale = self.get_buffer(f"{role}_amax_history"), self.get_buffer(f"{role}_scale")
            history.copy_(history.roll(1))
            history[0] = amax
            if self.watch is not None:
                self.watch.observe_amax(history[0])
            amax = history.max() if self.recipe.amax_compute_algo == "max" else history[0]
            usable = torch.isfinite(amax) & (amax > 0)
            scale.copy_(torch.where(usable, fp8_max(self.dtypes[role]) / amax, scale))
        self.step_amax.zero_()
        self.recorded = True


def check_resumed_recipe(has_tensor, chunks: Iterable[nn.Module], fp8_recipe: str | None) -> None:
    """A checkpoint with delayed scaling's amax histories (``has_tensor(name)``: whether it stores ``name``)
    resumes only into delayed scaling: one line naming the flag where a layer's GEMM recipe in this run
    (``fp8_recipe``, None without FP8) is another, which would drop that layer's history. ``chunks``: the
    model chunks, with ``global_name`` (a name in the checkpoint)."""
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, GemmPrecision) and not isinstance(module, DelayedScaling) and \
                    has_tensor(chunk.global_name(f"{name}.{INPUT}_amax_history")):
                this_run = f"--fp8-recipe {fp8_recipe}" if fp8_recipe else "no --fp8-format"
                raise UserError(f"the checkpoint was trained with --fp8-recipe delayed (it holds the amax history of "
                                f"{chunk.global_name(name)}) but this run has {this_run}; resume it with "
                                "--fp8-recipe delayed")


@torch.no_grad()
def finish_delayed_scaling_step(chunks: Iterable[nn.Module], groups: Iterable) -> None:
    """After a step's last backward: every delayed-scaling recipe of ``chunks`` records the step's amaxes,
    reduced (MAX) over each of ``groups`` (together every rank of the pipeline stage; None: a group of one)
    in one all-reduce per group (module docstring)."""
    recipes = [m for chunk in chunks for m in chunk.modules() if isinstance(m, DelayedScaling)]
    if not recipes:
        return
    amaxes = torch.stack([recipe.step_amax for recipe in recipes])
    for group in groups:
        if group is not None:
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    for recipe, step in zip(recipes, amaxes):
        recipe.finish_step(step)


class RowwiseScaling(Fp8Gemm):
    """One scale per row of each operand along K (torchao's rowwise): the forward's x per token and W per
    output row, the input gradient's grad_out per token and W per input column, the weight gradient's
    grad_out^T per output row and x^T per input column (K the tokens). As in torchao's rowwise recipe
    (its documented default), each scale is rounded down to a power of two."""
    round_scale_down = True

    def blocks(self, role: str) -> tuple[int, int]:
        return 1, WHOLE


class RowwiseScalingHighPrecisionWeightGrad(RowwiseScaling):
    """Rowwise, with the weight-gradient GEMMs in the operands' own precision (torchao's rowwise_with_gw_hp),
    and scales fp8_max / amax as they are (that recipe leaves torchao's power-of-two rounding off)."""
    round_scale_down = False
    grad_weight = GemmPrecision.grad_weight
    grouped_grad_weight = GemmPrecision.grouped_grad_weight


class BlockwiseScaling(Fp8Gemm):
    """DeepSeek-V3's: 1 x 128 tiles along K for inputs and gradients, 128 x 128 blocks for weights."""

    def blocks(self, role: str) -> tuple[int, int]:
        block = FP8_BLOCKS["blockwise"]
        return (block, block) if role == WEIGHT else (1, block)


class MXFP8Scaling(Fp8Gemm):
    """1 x 32 blocks along K for every operand, power-of-two scales stored as E8M0."""
    power_of_two = True

    def blocks(self, role: str) -> tuple[int, int]:
        return 1, FP8_BLOCKS["mxfp8"]


FP8_RECIPE_CLASSES: dict[str, type[Fp8Gemm]] = {
    "tensorwise": Fp8Gemm, "delayed": DelayedScaling, "rowwise": RowwiseScaling,
    "rowwise_with_gw_hp": RowwiseScalingHighPrecisionWeightGrad, "blockwise": BlockwiseScaling,
    "mxfp8": MXFP8Scaling}
if E8M0 is None:            # torch without the E8M0 dtype has no MXFP8
    del FP8_RECIPE_CLASSES["mxfp8"]


@functools.cache
def has_kernel(name: str, fp8_format: str, device: torch.device, a_role: str, b_role: str,
               out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm on ``device`` runs recipe ``name``'s GEMM of an ``a_role`` by a ``b_role``
    operand and gives the emulation's product (checked once on a small GEMM of whole blocks)."""
    if device.type == "meta":
        return False
    recipe = Fp8Recipe(name, fp8_format, emulate=True)
    gemm = recipe.build()
    g = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(256, 256, generator=g, device=device, dtype=out_dtype) for _ in range(2))
    if isinstance(gemm, DelayedScaling):
        gemm.to(device)
    qa, qb = gemm.quantise(a, a_role), gemm.quantise(b, b_role)
    try:
        real = scaled_mm(qa, qb, out_dtype).float()
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    emulated = emulated_mm(qa, qb, torch.float32)
    return bool(torch.allclose(real, emulated, rtol=1e-2, atol=1e-2 * emulated.abs().max().item()))


@functools.cache
def has_grouped_kernel(name: str, fp8_format: str, device: torch.device, role: str, out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_grouped_mm on ``device`` runs recipe ``name``'s experts' GEMM of a ``role`` by a
    weight operand and gives the per-expert emulation's product (checked once on small aligned experts)."""
    if device.type == "meta":
        return False
    emulated, real = (Fp8Recipe(name, fp8_format, emulate=emulate).build() for emulate in (True, False))
    g = torch.Generator(device=device).manual_seed(0)
    counts = [32, 0, 16, 48]
    a = torch.randn(sum(counts), 64, generator=g, device=device, dtype=out_dtype)
    weight = torch.randn(len(counts), 32, 64, generator=g, device=device, dtype=out_dtype)
    qa, qw = real.quantise(a, role), real.quantise(weight.reshape(-1, 64), WEIGHT)
    try:
        product = scaled_grouped_mm(qa, qw, counts, out_dtype).float()
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    expected = emulated._grouped(a, role, weight, counts, None, (None, None)).float()
    return bool(torch.allclose(product, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item()))


def check_fp8_kernels(recipe: Fp8Recipe, device: torch.device, dtype: torch.dtype) -> None:
    """A one-line error unless ``device`` has the kernels of ``recipe``'s GEMMs or the recipe emulates them."""
    if recipe.emulate or device.type == "meta":        # a dry run multiplies nothing
        return
    if recipe.name not in FP8_RECIPE_CLASSES:
        raise UserError(f"--fp8-recipe {recipe.name} needs torch's float8_e8m0fnu dtype (torch >= 2.7); "
                        "upgrade torch or pick another recipe")

    def works(name: str) -> bool:
        return all(has_kernel(name, recipe.fp8_format, device, a, b, dtype) for a, b in PAIRS)

    if not works(recipe.name):
        usable = [name for name in FP8_RECIPES if name in FP8_RECIPE_CLASSES and works(name)]
        instead = f"--fp8-recipe {' / '.join(usable)} or " if usable else ""
        raise UserError(f"--fp8-recipe {recipe.name} has no FP8 kernel on {device.type}: use {instead}{EMULATE_FLAG} "
                        "(quantise, dequantise, multiply in fp32)")


def gemm_recipe_for(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                    kernels: torch.device | None = None):
    """The layers' GEMM recipe for ``config``: its FP8 recipe with --fp8-format (after checking ``device``
    has the kernels for its ``dtype`` GEMMs, or the recipe emulates them), else the default recipe.
    ``kernels``: the device whose path GEMMs of meta tensors take (a run without storage plays its rank;
    default ``device``)."""
    if config.fp8_format is None:
        return DEFAULT_RECIPE
    recipe = Fp8Recipe(config.fp8_recipe, config.fp8_format, config.fp8_amax_history_len,
                       config.fp8_amax_compute_algo, config.fp8_emulate, meta_kernels=(kernels or device).type)
    check_fp8_kernels(recipe, device, dtype)
    if not recipe.emulate and recipe.name in FP8_RECIPE_CLASSES:
        _probe_kernels(recipe, torch.device(recipe.meta_kernels) if device.type == "meta" else device, dtype)
    return recipe


def _probe_kernels(recipe: Fp8Recipe, device: torch.device, dtype: torch.dtype) -> None:
    """Run the GEMMs' one-time kernel checks at start-up, not inside the first step's memory: the layers'
    ``dtype`` GEMMs (a run without storage plays its rank's device) and the weight gradient added into an
    fp32 main_grad."""
    for a, b in PAIRS:
        has_kernel(recipe.name, recipe.fp8_format, device, a, b, dtype)
    has_kernel(recipe.name, recipe.fp8_format, device, GRAD, INPUT, torch.float32)
