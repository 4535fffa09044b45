"""What an FP8 run adds to the log: the share of the weight GEMMs' FLOPs done in FP8, the range of the
scales the FP8 recipes used since the last log line, and the layer whose FP8 operand first went NaN/Inf.

Each FP8 recipe module (fp8.py's ``Fp8Gemm``) gets an ``Fp8Watch``, which it feeds on the device without
waiting for it: per GEMM operand, the operand's scales (fp8_max / amax per scaling block; delayed scaling
also its newest amax). The watch keeps the smallest and largest finite scale and a flag that any amax was
NaN/Inf. Nothing is read on the host per step: ``Fp8Observer.report`` reads every watch at a log
iteration (one stack, one all-reduce over the ranks, one host read), and ``first_nonfinite`` reads the
flags when the step's gradient norm has already come back NaN/Inf.

FLOP share: a GEMM with weight W [out, in] costs 2 * out * in FLOPs per token in its forward (its two
backward GEMMs cost the same twice over, so the share is the forward's); an expert's, times the
tokens each expert gets on average (top-k / experts). Each rank counts the weights of its own GEMM
modules, each divided by the number of ranks that hold a copy of it (dense: data x context parallel;
experts: expert data parallel), and one all-reduce sums them over all ranks, once per run. The weight
GEMMs are the transformer layers' linears, the experts and the output head (the router's and core
attention's products are not counted).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megalite.model.gpt import GPTModel
from megalite.parallel.param_meta import param_meta
from megalite.precision.fp8 import Fp8Gemm
from megalite.precision.gemm import GemmPrecision
from megalite.train.faults import TrainingFault


class Fp8Watch:
    """One FP8 recipe module's scales and non-finite flag since the last report, on the device."""

    def __init__(self, device: torch.device):
        self.low = torch.full((), float("inf"), device=device)
        self.high = torch.full((), float("-inf"), device=device)
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=device)

    @torch.no_grad()
    def observe_scale_inv(self, scale_inv: torch.Tensor) -> None:
        """An operand's 1 / scale per block (amax / fp8_max): a NaN/Inf one marks a NaN/Inf amax."""
        s = scale_inv.float()
        finite = torch.isfinite(s)
        self.nonfinite |= ~finite.all()
        scale = torch.where(finite, s.reciprocal(), float("nan"))
        self.low.copy_(torch.fmin(self.low, scale.nan_to_num(float("inf")).amin()))
        self.high.copy_(torch.fmax(self.high, scale.nan_to_num(float("-inf")).amax()))

    @torch.no_grad()
    def observe_amax(self, amax: torch.Tensor) -> None:
        """Delayed scaling's newest amax of an operand."""
        self.nonfinite |= ~torch.isfinite(amax)

    def reset(self) -> None:
        self.low.fill_(float("inf"))
        self.high.fill_(float("-inf"))
        self.nonfinite.fill_(False)


def gemm_modules(chunks: list) -> list[tuple[str, nn.Module, GemmPrecision]]:
    """(name, owner, recipe) of every GEMM recipe in ``chunks``: the owner is the module the recipe belongs
    to, which holds the weights it multiplies (a linear, the grouped experts; the model itself for a head
    that reads the word embeddings)."""
    found = []
    for chunk in chunks:
        for name, recipe in chunk.named_modules():
            if isinstance(recipe, GemmPrecision):
                owner_name = name.rpartition(".")[0]
                found.append((owner_name or "output head", chunk.get_submodule(owner_name), recipe))
    return found


def _gemm_weights(owner: nn.Module) -> list[torch.Tensor]:
    if isinstance(owner, GPTModel):        # a recipe of the model itself: the head that reads the word embeddings
        return [owner.embedding.word_embeddings.weight]
    return [p for p in owner.parameters() if p.dim() >= 2]


def gemm_flops_per_token(chunks: list, parallel, topk: int, num_experts: int) -> tuple[float, float]:
    """(FP8, all) forward FLOPs per token of this rank's weight GEMMs, each weight divided by its copies
    (module docstring): summed over all ranks, the whole model's."""
    fp8 = total = 0.0
    dense_copies = parallel.world_size // (parallel.tp_size * parallel.pp_size)
    for _, owner, recipe in gemm_modules(chunks):
        for weight in _gemm_weights(owner):
            expert = param_meta(weight).expert
            flops = 2 * weight.numel() * (topk / num_experts if expert else 1)
            flops /= parallel.edp_size if expert else dense_copies
            total += flops
            fp8 += flops if isinstance(recipe, Fp8Gemm) else 0.0
    return fp8, total


class Fp8Observer:
    """The FP8 figures of the log line and the non-finite check (module docstring). Every rank calls
    ``report`` at the same log iterations (collective).

    Kept out of precision/: counting copies reads the parameters' parallel metadata (a higher package)."""

    def __init__(self, chunks: list, config, parallel, device: torch.device):
        self.device, self.world_size = device, parallel.world_size
        self.watched = [(name, recipe) for name, _, recipe in gemm_modules(chunks) if isinstance(recipe, Fp8Gemm)]
        for _, recipe in self.watched:
            recipe.watch = Fp8Watch(device)
        counts = torch.tensor(gemm_flops_per_token(chunks, parallel, config.moe_router_topk, config.num_experts or 1),
                              dtype=torch.float64, device=device)
        self._all_reduce(counts, dist.ReduceOp.SUM)
        self.fp8_share = float(counts[0] / counts[1]) if counts[1] > 0 else 0.0
        self.recipe = config.fp8_recipe

    def _all_reduce(self, values: torch.Tensor, op) -> None:
        if self.world_size > 1:
            dist.all_reduce(values, op=op)

    @torch.no_grad()
    def report(self) -> dict[str, float]:
        """The interval's figures, on every rank; starts the next interval. Stops the run (``TrainingFault``)
        naming the first layer (on this rank) whose FP8 operand went NaN/Inf."""
        table = torch.tensor([float("inf"), float("-inf"), 0.0], dtype=torch.float64, device=self.device)
        if self.watched:
            watches = [recipe.watch for _, recipe in self.watched]
            table = torch.stack([torch.stack([w.low for w in watches]).amin().double(),
                                 torch.stack([w.high for w in watches]).amax().double(),
                                 torch.stack([w.nonfinite for w in watches]).any().double()])
        table[0] = -table[0]                  # one MAX all-reduce for all three
        self._all_reduce(table, dist.ReduceOp.MAX)
        low, high, nonfinite = -table[0].item(), table[1].item(), table[2].item()
        if nonfinite:
            raise TrainingFault(self.nonfinite_message())
        for _, recipe in self.watched:
            recipe.watch.reset()
        out = {"fp8 GEMM FLOPs share": self.fp8_share}
        if high >= low:
            out |= {f"fp8 {self.recipe} scale min": low, f"fp8 {self.recipe} scale max": high}
        return out

    def first_nonfinite(self) -> str | None:
        """The name of this rank's first layer whose FP8 operand had a NaN/Inf amax, if any (one host read)."""
        if not self.watched:
            return None
        flags = torch.stack([recipe.watch.nonfinite for _, recipe in self.watched]).tolist()
        return next((name for (name, _), bad in zip(self.watched, flags) if bad), None)

    def nonfinite_message(self) -> str:
        layer = self.first_nonfinite()
        where = f"in {layer}" if layer else "on another rank (its log names the layer)"
        return (f"an FP8 GEMM operand went NaN/Inf {where} (--fp8-recipe {self.recipe}); lower --lr, or keep that "
                "layer in high precision (--first-last-layers-bf16)")
