#!/usr/bin/env python
"""Muon against AdamW, per layout, side by side in one run: the optimizer step's time and the
Newton-Schulz share of it, and the optimizer-state bytes per rank (optim/rules/muon.py).

Each (layout, optimizer) pair builds a real trainer (pretrain_gpt.py's command line on mock data) on its
gloo ranks and runs training steps (megalite.train.step.train_step). The bench wraps that trainer's
``optimizer.step`` -- a barrier first, untimed, so no rank's time counts a wait for a slower rank's
backward -- and megalite.optim.rules.muon's Newton-Schulz function, and times both. A step's time is the
slowest rank's; the figure is the median over the timed steps. The Newton-Schulz share is its time over
the step's, summed over steps and ranks; under TP's duplicated mode the momentum all-gather before it
is timed too. The pairs take turns, round after round, so load from other work on the machine falls on
both optimizers alike. The whole training step is timed too, for the optimizer step's share of it. State bytes are the memory report's (train/performance.py ``measure``: the
tensors the rule keeps, the fp32 master copy where the model is not fp32) on each rank, the largest
rank's compared.

A layout is one entry of LAYOUTS (flags for every run, and flags for Muon only, such as its TP mode);
--layouts picks entries by name, so another ZeRO stage is one more entry. "TP=2" stands for one layout
per --muon-tp-modes entry (any mode megalite's --muon-tp-mode accepts), each against its own AdamW run.

    python bench/bench_muon.py                                # default layouts, writes bench/RESULTS.md
    python bench/bench_muon.py --layouts serial "DP=2 ZeRO-1" --steps 5 --rounds 3
    python bench/bench_muon.py --layouts TP=2 --muon-tp-modes duplicated distributed
    python bench/bench_muon.py --quick                        # smoke test: a smaller model, one timed step
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_parallel import spawn  # noqa: E402
from llama_flags import llama_argv, random_batches  # noqa: E402
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megalite.config.muon_fields import MUON_TP_MODES  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """A Llama whose transformer-layer matrices hold most of its parameters (a small vocabulary), as in
    a large model, so the state ratio measures Muon's matrices rather than the embeddings' AdamW."""
    layers: int = 4
    hidden: int = 256
    ffn: int = 704
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512
    seq: int = 128
    mbs: int = 2
    gbs: int = 4

    def describe(self) -> str:
        return (f"Llama {self.layers} layers, hidden {self.hidden}, {self.heads} heads / {self.kv_heads} KV heads, "
                f"SwiGLU {self.ffn}, vocab {self.vocab}, seq {self.seq}, global batch {self.gbs}")


FULL = Shape()
QUICK = replace(FULL, layers=2, hidden=128, ffn=352)


@dataclass(frozen=True)
class Layout:
    name: str
    world: int
    flags: tuple[str, ...] = ()          # both optimizers
    muon_flags: tuple[str, ...] = ()     # Muon only (its TP mode)


ZERO1 = ("--use-distributed-optimizer", "--use-layer-wise-distributed-optimizer")
MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall")
TP = "TP=2"


def tp_layout(mode: str) -> Layout:
    return Layout(f"{TP} {mode}", 2, ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
                  ("--muon-tp-mode", mode))


LAYOUTS = (
    Layout("serial", 1),
    Layout("DP=2 ZeRO-1", 2, ZERO1),
    Layout("DP=2 ZeRO-3", 2, ("--data-parallel-sharding-strategy", "optim_grads_params")),
    Layout("DP=2 FSDP2", 2, ("--use-torch-fsdp2",)),
    Layout(TP, 2),                        # expanded by chosen(): one layout per --muon-tp-modes entry
    Layout("EP=2 MoE (4 experts, top-2)", 2, ("--expert-model-parallel-size", "2") + MOE),
)


def chosen(names: list[str], tp_modes: list[str]) -> list[Layout]:
    """The layouts named, in LAYOUTS' order, TP=2 once per TP mode."""
    picked = []
    for layout in LAYOUTS:
        if layout.name in names:
            picked += [tp_layout(mode) for mode in tp_modes] if layout.name == TP else [layout]
    return picked
OPTIMIZERS = {"AdamW": ("--optimizer", "adam"), "Muon": ("--optimizer", "muon")}


class Clock:
    """Seconds spent inside a wrapped function, per training step."""

    def __init__(self):
        self.total = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start
        return timed


def _time_steps(rank, world, shape, flags, steps, warmup):
    """Per step: the optimizer step's seconds, and the Newton-Schulz and TP-gather seconds inside it;
    then this rank's memory-report figures."""
    import torch.distributed as dist
    from megalite.optim.rules import muon as muon_rule
    from megalite.train.command_line import parse_args
    from megalite.train.performance import measure
    from megalite.train.step import train_step
    from megalite.train.trainer import build_trainer
    trainer = build_trainer(parse_args(llama_argv(shape, shape.mbs, shape.gbs) + list(flags), world_size=world))
    clocks = {"step": Clock(), "ns": Clock(), "gather": Clock(), "train": Clock()}
    for name, clock in (("newton_schulz", "ns"), ("distributed_newton_schulz", "ns"),
                        ("_gather", "gather")):                              # module globals the rule calls
        if hasattr(muon_rule, name):
            setattr(muon_rule, name, clocks[clock].wrap(getattr(muon_rule, name)))
    inner = clocks["step"].wrap(trainer.optimizer.step)

    def step(*args, **kwargs):
        if world > 1:
            dist.barrier()
        return inner(*args, **kwargs)

    trainer.optimizer.step = step
    data, times, timed_train_step = random_batches(shape, rank), [], clocks["train"].wrap(train_step)
    for i in range(warmup + steps):
        before = {name: clock.total for name, clock in clocks.items()}
        timed_train_step(trainer, data)
        if i >= warmup:
            times.append({name: clock.total - before[name] for name, clock in clocks.items()})
    trainer.ddp.wait_for_param_gather()
    return {"times": times, "memory": measure(trainer.ddp, trainer.optimizer),
            "params": trainer.buffer.numel_unpadded}


def run_pairs(layouts: list[Layout], args) -> dict:
    """(layout, optimizer) -> every rank's results of every round; the pairs take turns each round."""
    runs = {}
    for _ in range(args.rounds):
        for layout in layouts:
            for opt, opt_flags in OPTIMIZERS.items():
                flags = layout.flags + opt_flags + (layout.muon_flags if opt == "Muon" else ())
                ranks = spawn(layout.world, args.threads, _time_steps, args.shape, flags,
                              args.steps, args.warmup)
                runs.setdefault((layout.name, opt), []).append(ranks)
    return runs


def summarise(rounds: list) -> dict:
    """Median optimizer-step and training-step seconds (the slowest rank per step), the Newton-Schulz and
    gather shares of the optimizer step, the largest rank's state bytes and theoretical bytes."""
    def median(key):
        return statistics.median(max(rank["times"][i][key] for rank in ranks) for ranks in rounds
                                 for i in range(len(ranks[0]["times"])))
    total = {key: sum(t[key] for ranks in rounds for rank in ranks for t in rank["times"]) for key in ("step", "ns", "gather")}
    last = rounds[-1]
    return {"step": median("step"), "train": median("train"), "ns": total["ns"] / total["step"], "gather": total["gather"] / total["step"],
            "state": max(rank["memory"]["optimizer"] for rank in last),
            "theory": max(rank["memory"]["theoretical"] for rank in last)}


def table(layouts: list[Layout], runs: dict) -> tuple[list[str], dict]:
    rows = ["| layout | optimizer | opt. step ms | Muon / AdamW | Newton-Schulz share | TP gather share | "
            "training step ms | opt. step share | state bytes (largest rank) | theory | Muon / AdamW |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios = {}
    for layout in layouts:
        s = {opt: summarise(runs[(layout.name, opt)]) for opt in OPTIMIZERS}
        time_ratio, state_ratio = s["Muon"]["step"] / s["AdamW"]["step"], s["Muon"]["state"] / s["AdamW"]["state"]
        ratios[layout.name] = (time_ratio, state_ratio, s["Muon"]["ns"])
        for opt, r in s.items():
            muon = opt == "Muon"
            rows.append(f"| {layout.name} | {opt} | {r['step'] * 1e3:.1f} | {f'**{time_ratio:.2f}x**' if muon else '1.00x'} | "
                        f"{r['ns'] * 100:.0f}% | {r['gather'] * 100:.0f}% | {r['train'] * 1e3:.0f} | "
                        f"{r['step'] / r['train'] * 100:.0f}% | {r['state']:,} | {r['theory']:,} | "
                        f"{f'**{state_ratio:.3f}x**' if muon else '1.000x'} |")
            print(rows[-1], flush=True)
    return rows, ratios


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    names = [lay.name for lay in LAYOUTS]
    parser.add_argument("--layouts", nargs="+", default=names, choices=names, metavar="LAYOUT",
                        help=f"layouts to measure, of: {', '.join(names)}")
    parser.add_argument("--muon-tp-modes", nargs="+", default=list(MUON_TP_MODES), choices=MUON_TP_MODES,
                        help="Muon's TP modes to measure at TP=2 (--muon-tp-mode)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every pair, taking turns")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (one: every layout's "
                        "ranks compute alike, and a machine shared with other work is not oversubscribed)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    args.shape = QUICK if args.quick else FULL
    if args.quick:
        args.steps, args.rounds = 1, 1
    layouts = chosen(args.layouts, args.muon_tp_modes)
    rows, ratios = table(layouts, run_pairs(layouts, args))
    command = command_line("bench_muon.py", argv)
    body = [f"{args.shape.describe()}; fp32, gloo on localhost, {args.threads} thread(s) per rank on "
            f"{os.cpu_count()} cores. Both optimizers at Megatron's defaults (Muon: momentum 0.9, 5 quintic Newton-Schulz "
            f"iterations in bf16, Q/K/V and gate/up split). Optimizer step: median of {args.rounds} rounds x "
            f"{args.steps} steps after {args.warmup} warm-up per run, the slowest rank per step, a barrier before "
            "it (untimed); it includes the gradient-norm all-reduce, clipping and ZeRO's parameter all-gather. "
            "Training step: the whole iteration (forward, backward, gradient sync, optimizer step), whose share "
            "the optimizer step is; this model is small, so the optimizer's share is far larger than in a "
            "billion-parameter run, where forward and backward grow with the tokens and Newton-Schulz does not. "
            "State bytes: the memory report's optimizer state on the largest rank (an fp32 model: no master "
            "copy), beside its theoretical figure. ZeRO-1 gives each rank whole matrices, so each orthogonalises "
            "about half of them; TP's duplicated mode gathers each sharded matrix and orthogonalises it whole on "
            "every TP rank. The matrices' share of the parameters sets the state ratio: "
            "their state halves, the embedding's, output layer's, norms' and routers' stays AdamW's.", "", *rows]
    headlines = [Headline(f"Muon optimizer step, {name}", "AdamW optimizer step, same layout and model",
                          f"{t:.2f}x time (Newton-Schulz {ns * 100:.0f}% of Muon's step)", command)
                 for name, (t, _, ns) in ratios.items()]
    headlines += [Headline(f"Muon optimizer-state bytes per rank, {name}", "AdamW, same layout and model (goal <= 0.55x)",
                           f"{s:.3f}x", command) for name, (_, s, _) in ratios.items()]
    publish(args, "bench_muon", "Muon vs AdamW: optimizer step time and state per rank, per layout", command,
            headlines, body)


if __name__ == "__main__":
    main(sys.argv[1:])
