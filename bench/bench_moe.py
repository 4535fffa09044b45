#!/usr/bin/env python
"""One MoE layer's forward + backward: megalite's MoELayer against transformers' own sparse MoE blocks.

The blocks: Mixtral's ``MixtralSparseMoeBlock`` (softmax over the top-k logits) and Qwen3-MoE's
``Qwen3MoeSparseMoeBlock`` with ``norm_topk_prob=False`` (softmax over all experts, top-k, not
renormalised: megalite's --moe-router-pre-softmax), each with every experts implementation this
transformers offers on a CPU (config ``_experts_implementation``: "eager", its loop over experts;
"grouped_mm", torch._grouped_mm over rows sorted by expert; "batched_mm", one bmm over per-token copies
of the expert weights, run only where those copies fit in --batched-mm-gb). megalite runs the same
weights (HF's router weight, and its [E, 2f, h] gate_up / [E, h, f] down expert weights, which are
megalite's in-memory layout) on the same tokens; before any timing every contender's output, input
gradient and weight gradients are checked against megalite's.

A step is forward + backward of the layer on [tokens, hidden] with a fixed output gradient, weight
gradients freed after each. megalite's auxiliary loss coefficient is 0 (transformers computes its loss
outside the block). All contenders live in one process with torch's default threads; a round runs every
contender one step, one at a time, in a rotating order. Ratio = the median over rounds of transformers'
step time / the same round's megalite step time (> 1: megalite faster): paired within a round, so load
from other work on the machine, which comes and goes, cancels out. Rounds repeat until no ratio moved
more than --tolerance since the previous round.

    python bench/bench_moe.py                        # fp32 and bf16; writes bench/RESULTS.md
    python bench/bench_moe.py --dtypes fp32
    python bench/bench_moe.py --quick                # smoke test: tiny shape, every implementation
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FAMILIES = ("mixtral", "qwen3_moe")
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")      # transformers' experts implementations that run on a CPU
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# (relative error of the output, of the gradients) allowed: fp32 rounding, bf16 rounding over h or f terms
TOLERANCE = {"fp32": (1e-5, 1e-4), "bf16": (1e-2, 2e-2)}
# share of tokens whose top-k experts may differ: transformers computes bf16 router logits (megalite fp32),
# which can swap two nearly tied experts (more often the more experts lie near the k-th logit: top-8 of 64)
ROUTING_TOLERANCE = {"fp32": 0.0, "bf16": 0.05}
# a differently routed token must be a near tie: each expert transformers picked has an fp32 logit within
# this share of the token's largest |logit| of the k-th largest (two bf16 roundings are 2^-7 at most)
TIE_MARGIN = 2.0 ** -6
ROUTED_DIFFERENTLY = "tokens routed differently"
NOT_TIED = "tokens routed differently without a near tie"


@dataclass(frozen=True)
class Shape:
    hidden: int
    ffn: int
    experts: int
    topk: int
    tokens: int
    headline: bool = False          # its ratios go to the summary

    def describe(self) -> str:
        return f"hidden {self.hidden}, expert ffn {self.ffn}, {self.experts} experts top-{self.topk}, {self.tokens} tokens"

    def label(self) -> str:
        return f"h {self.hidden} f {self.ffn} E {self.experts} k {self.topk} T {self.tokens}"

    def flops(self) -> float:
        """Matmul FLOPs of one forward + backward: 3 x (2 x T k x 3 h f)."""
        return 18.0 * self.tokens * self.topk * self.hidden * self.ffn

    def batched_mm_bytes(self, element: int) -> float:
        """What batched_mm materialises: per (token, slot) copies of both expert weights, and their gradients."""
        return 2 * self.tokens * self.topk * 3 * self.hidden * self.ffn * element


# Mixtral's granularity (8 experts, top-2, expert ffn 3.5 h) at two sizes, and Qwen3-MoE's (128 experts,
# top-8, expert ffn 0.375 h) with half its experts, so that both families' kinds of layer are measured
FULL = (Shape(512, 1024, 8, 2, 2048), Shape(1024, 1792, 8, 2, 4096, headline=True),
        Shape(1024, 384, 64, 8, 2048, headline=True))
QUICK = (Shape(64, 96, 4, 2, 64, headline=True),)


# ---- the layers, on shared weights ------------------------------------------------------------
def megalite_layer(family: str, shape: Shape, dtype):
    from megalite.train.command_line import parse_args
    from megalite.model.moe import MoELayer
    from megalite.parallel.expert.dispatch import ExpertParallel, MoEContext
    from megalite.parallel.tensor.layers import TensorParallel
    argv = ["--num-layers", "1", "--hidden-size", str(shape.hidden), "--ffn-hidden-size", str(shape.ffn),
            "--num-attention-heads", "4", "--seq-length", str(shape.tokens), "--max-position-embeddings",
            str(shape.tokens), "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
            "--num-experts", str(shape.experts), "--moe-router-topk", str(shape.topk), "--moe-grouped-gemm",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-4", "--train-iters", "1",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
    if family == "qwen3_moe":
        argv.append("--moe-router-pre-softmax")
    config = parse_args(argv, world_size=1).model
    return MoELayer(config, dtype, TensorParallel(), MoEContext(ExpertParallel()))


def hf_block(family: str, implementation: str, shape: Shape, dtype):
    import torch
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        config = MixtralConfig(hidden_size=shape.hidden, intermediate_size=shape.ffn,
                               num_local_experts=shape.experts, num_experts_per_tok=shape.topk)
        block_class = MixtralSparseMoeBlock
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        config = Qwen3MoeConfig(hidden_size=shape.hidden, moe_intermediate_size=shape.ffn, num_experts=shape.experts,
                                num_experts_per_tok=shape.topk, norm_topk_prob=False)
        block_class = Qwen3MoeSparseMoeBlock
    config._experts_implementation = implementation
    generator = torch.Generator().manual_seed(0)
    block = block_class(config)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return block.to(dtype)


def copy_weights(block, layer) -> None:
    """transformers' router and expert weights into megalite's layer (same in-memory layout)."""
    import torch
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        layer.experts.linear_fc1.weight.copy_(block.experts.gate_up_proj)
        layer.experts.linear_fc2.weight.copy_(block.experts.down_proj)


def weight_grads(module, megalite: bool) -> list:
    if megalite:
        return [module.router.weight.grad, module.experts.linear_fc1.weight.grad, module.experts.linear_fc2.weight.grad]
    return [module.gate.weight.grad, module.experts.gate_up_proj.grad, module.experts.down_proj.grad]


class Contender:
    """A layer and its step: forward + backward on [T, h] tokens (megalite [s, b, h], transformers [b, s, h])."""

    def __init__(self, name: str, module, megalite: bool, tokens, grad):
        self.name, self.module, self.megalite = name, module, megalite
        self.tokens, self.grad = tokens, grad

    def step(self, keep_grads: bool = False, grad=None):
        x = self.tokens.clone().requires_grad_()
        shaped = x[:, None] if self.megalite else x[None]
        out = self.module(shaped).reshape(x.shape)
        out.backward(self.grad if grad is None else grad)
        result = (out.detach(), x.grad, weight_grads(self.module, self.megalite)) if keep_grads else None
        self.module.zero_grad(set_to_none=True)
        return result

    def run(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - start)
        return times


def worst(errors: dict) -> float:
    return max(v for k, v in errors.items() if k not in (ROUTED_DIFFERENTLY, NOT_TIED))


def relative_error(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def same_routing(reference: Contender, other: Contender):
    """([T] True where transformers' block picks the same top-k experts as megalite's router (fp32 logits;
    top-k of the logits is top-k of their softmax), [T] True where it does or picks others only among near
    ties of the k-th logit (TIE_MARGIN))."""
    import torch
    with torch.no_grad():
        router = reference.module.router
        logits = torch.nn.functional.linear(reference.tokens.float(), router.weight.float())
        top = torch.topk(logits, router.topk, dim=-1)
        theirs = other.module.gate(reference.tokens)[2].sort(-1).values
        same = (top.indices.sort(-1).values == theirs).all(-1)
        margin = TIE_MARGIN * logits.abs().amax(-1, keepdim=True)
        tied = (logits.gather(-1, theirs) >= top.values[:, -1:] - margin).all(-1)
    return same, same | tied


def check_equivalence(reference: Contender, other: Contender, dtype_name: str) -> dict:
    """Output, input gradient and the three weight gradients of ``other`` against megalite's: their
    relative errors (Frobenius norm), each within TOLERANCE, and the share of tokens routed differently
    within ROUTING_TOLERANCE, all of them near ties (those tokens are left out: their outputs, and their
    output gradients, so that no gradient depends on them), or AssertionError."""
    out_tol, grad_tol = TOLERANCE[dtype_name]
    same, tied = same_routing(reference, other)
    grad = reference.grad * same[:, None].to(reference.grad.dtype)
    ref_out, ref_dx, ref_dw = reference.step(keep_grads=True, grad=grad)
    out, dx, dw = other.step(keep_grads=True, grad=grad)
    errors = {"output": relative_error(out[same], ref_out[same]), "input grad": relative_error(dx[same], ref_dx[same])}
    errors.update({name: relative_error(a, b) for name, a, b in zip(("router grad", "fc1 grad", "fc2 grad"), dw, ref_dw)})
    errors[ROUTED_DIFFERENTLY] = 1 - same.float().mean().item()
    errors[NOT_TIED] = 1 - tied.float().mean().item()
    limits = {"output": out_tol, ROUTED_DIFFERENTLY: ROUTING_TOLERANCE[dtype_name], NOT_TIED: 0.0}
    bad = {k: v for k, v in errors.items() if v > limits.get(k, grad_tol)}
    assert not bad, f"{other.name} ({dtype_name}) differs from megalite: relative errors {bad}"
    return errors


def contenders(shape: Shape, dtype_name: str, batched_mm_gb: float, quiet=print):
    """(megalite contender per family, the transformers contenders, the ones left out with why), every
    transformers contender checked against its family's megalite layer."""
    import torch
    dtype = getattr(torch, DTYPES[dtype_name])
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randn(shape.tokens, shape.hidden, generator=generator).to(dtype)
    grad = torch.randn(shape.tokens, shape.hidden, generator=generator).to(dtype)
    ours, theirs, skipped, errors = {}, [], [], {}
    for family in FAMILIES:
        for implementation in IMPLEMENTATIONS:
            name = f"{family} {implementation}"
            copies = shape.batched_mm_bytes(torch.empty((), dtype=dtype).element_size()) / 2 ** 30
            if implementation == "batched_mm" and copies > batched_mm_gb:
                skipped.append(f"{name} {dtype_name} {shape.label()}: not run, its per-token weight copies and their "
                               f"gradients would take "
                               f"{copies:.0f} GiB (over --batched-mm-gb {batched_mm_gb:g})")
                continue
            block = hf_block(family, implementation, shape, dtype)
            if family not in ours:
                layer = megalite_layer(family, shape, dtype)
                copy_weights(block, layer)
                ours[family] = Contender(f"megalite ({family} routing)", layer, True, tokens, grad)
            theirs.append(Contender(name, block, False, tokens, grad))
            errors[name] = check_equivalence(ours[family], theirs[-1], dtype_name)
            quiet(f"  {dtype_name} {name}: same as megalite, worst relative error {worst(errors[name]):.1e}, "
                  f"{100 * errors[name][ROUTED_DIFFERENTLY]:.2f}% of tokens routed differently", flush=True)
    return ours, theirs, skipped, errors


# ---- timing ------------------------------------------------------------------------------------------
def ratios(times: dict, theirs: list) -> dict:
    """Per transformers contender: the median over rounds of its step time / the same round's step time
    of megalite with its family's routing."""
    def paired(name: str) -> float:
        ours = times[f"megalite ({name.split()[0]} routing)"]
        return statistics.median(t / m for t, m in zip(times[name], ours))
    return {c.name: paired(c.name) for c in theirs}


def stable(previous: dict | None, current: dict, tolerance: float) -> bool:
    return previous is not None and all(abs(current[k] / previous[k] - 1) <= tolerance for k in current)


def matmul_peak_flops(dtype_name: str) -> float:
    """Best FLOP/s of a 2048^3 matmul in this dtype: what the layer's matmuls could reach at most."""
    import torch
    dtype = getattr(torch, DTYPES[dtype_name])
    a, b = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * 2048 ** 3 / best


def compare(shape: Shape, dtype_name: str, args) -> dict:
    ours, theirs, skipped, errors = contenders(shape, dtype_name, args.batched_mm_gb)
    everyone = [*ours.values(), *theirs]
    for contender in everyone:
        contender.run(args.warmup)
    times = {c.name: [] for c in everyone}
    peak, previous, history = matmul_peak_flops(dtype_name), None, []
    load_start = os.getloadavg()[0]
    for round_index in range(args.max_rounds):
        shift = round_index % len(everyone)
        for contender in everyone[shift:] + everyone[:shift]:           # nobody always goes first
            times[contender.name] += contender.run(1)
        peak = max(peak, matmul_peak_flops(dtype_name))
        history.append(ratios(times, theirs))
        print(f"  {dtype_name} {shape.label()} round {round_index + 1}: "
              + ", ".join(f"{k} {v:.2f}x" for k, v in history[-1].items()), flush=True)
        if round_index + 1 >= args.rounds and stable(previous, history[-1], args.tolerance):
            break
        previous = history[-1]
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    return {"shape": shape, "dtype": dtype_name, "ms": ms, "ratio": history[-1], "skipped": skipped,
            "errors": errors, "peak": peak, "steps": len(times[everyone[0].name]), "rounds": len(history),
            "converged": stable(history[-2] if len(history) > 1 else None, history[-1], args.tolerance),
            "load": (load_start, os.getloadavg()[0])}


# ---- report ------------------------------------------------------------------------------------------
def table_rows(r: dict) -> list[str]:
    rows, shape = [], r["shape"]
    for name, ms in r["ms"].items():
        ratio = "baseline of its family" if name.startswith("megalite") else f"**{r['ratio'][name]:.2f}x**"
        error = "" if name.startswith("megalite") else (f"{worst(r['errors'][name]):.0e}; "
                                                          f"{100 * r['errors'][name][ROUTED_DIFFERENTLY]:.2f}%")
        share = shape.flops() / (ms / 1000) / r["peak"]
        rows.append(f"| {shape.hidden} / {shape.ffn} / {shape.experts} / {shape.topk} / {shape.tokens} | "
                    f"{r['dtype']} | {name} | {ms:.1f} | {ratio} | {100 * share:.0f}% | {error} |")
    return rows


def headlines(results: list, command: str) -> list[Headline]:
    """Per dtype and headline shape: megalite against each family's eager block and against the fastest
    transformers contender."""
    out = []
    for r in (r for r in results if r["shape"].headline):
        s, fastest = r["shape"], min(r["ratio"], key=lambda name: r["ms"][name])
        for name in dict.fromkeys([f"{family} eager" for family in FAMILIES] + [fastest]):
            family, implementation = name.split()
            out.append(Headline(f"MoE layer forward+backward vs transformers {family} {implementation}, {r['dtype']}, "
                                f"{s.label()}",
                                f"transformers {family} sparse MoE block, experts_implementation={implementation}"
                                f"{' (its fastest here)' if name == fastest else ''}, same weights and tokens",
                                f"{r['ratio'][name]:.2f}x (HF ms / megalite ms)", command))
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--rounds", type=int, default=8, help="at least this many rounds (default 8)")
    parser.add_argument("--max-rounds", type=int, default=24, help="at most this many rounds (default 24)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per contender (default 2)")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="stop when no ratio moved more than this (relative) in the last round (default 0.02)")
    parser.add_argument("--batched-mm-gb", type=float, default=4.0,
                        help="run transformers' batched_mm only where its weight copies take at most this (GiB)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.max_rounds, args.warmup = 1, 1, 1
    import torch
    command = command_line("bench_moe.py", argv)
    results = []
    for shape in QUICK if args.quick else FULL:
        for dtype_name in args.dtypes.split(","):
            results.append(compare(shape, dtype_name, args))
            print("\n".join(table_rows(results[-1])), flush=True)
    skipped = sorted({line for r in results for line in r["skipped"]})
    body = [f"Shapes: {'; '.join(s.describe() for s in (QUICK if args.quick else FULL))}; SwiGLU experts, no biases; "
            f"torch {torch.__version__} with {torch.get_num_threads()} threads, transformers "
            f"{__import__('transformers').__version__}. One step = forward + backward of the layer. Before timing, "
            "every transformers block's output, input gradient and router / fc1 / fc2 weight gradients matched "
            "megalite's on the same weights and tokens (the worst relative error, Frobenius norm, is in the table; "
            "in bf16 transformers' router computes bf16 logits and may swap two nearly tied experts of a token: "
            "the share of such tokens is in the table; each was a near tie of the k-th fp32 logit, and their "
            "outputs and output gradients are left out of the comparison, so no compared gradient depends on them). "
            f"After {args.warmup} warm-up steps, rounds of one step per contender in a rotating order until no "
            f"ratio moved more than {100 * args.tolerance:g}% "
            f"(at least {args.rounds}, at most {args.max_rounds}). Matmul share: the layer's matmul FLOPs "
            "(18 T k h f per step) per second over the best 2048^3 matmul rate in the same dtype and run.", "",
            *([f"Left out: {'; '.join(skipped)}.", ""] if skipped else []),
            "| hidden / ffn / experts / top-k / tokens | dtype | contender | ms / step (median) | "
            "vs megalite (median of HF / megalite "
            "step time, same round) | matmul share | worst relative error; tokens routed differently |",
            "|---|---|---|---|---|---|---|", *[row for r in results for row in table_rows(r)], "",
            "Steps and rounds: " + "; ".join(f"{r['dtype']} {r['shape'].label()}: {r['steps']} steps in "
                                              f"{r['rounds']} rounds{'' if r['converged'] else ' (not stable)'}, "
                                              f"load {r['load'][0]:.1f} -> {r['load'][1]:.1f}" for r in results) + "."]
    publish(args, "bench_moe", "MoE layer vs transformers", command, headlines(results, command), body)


if __name__ == "__main__":
    main(sys.argv[1:])
