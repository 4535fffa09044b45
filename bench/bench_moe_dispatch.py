#!/usr/bin/env python
"""The share of a Llama-MoE training step that token dispatch takes, at EP=1, EP=2 and EP=4, with both
dispatchers (--moe-token-dispatcher-type alltoall and allgather), measured with torch.profiler.

Each layout trains the same model on the same global batch (mock tokens) through megalite's Trainer
(build_trainer + train_step, as bench_parallel.py does), with EP = the number of gloo ranks (expert
parallelism inside data parallelism: each rank takes a share of the micro-batches and holds E / EP
experts). Per rank it times some steps without the profiler, then profiles some more and splits each
profiled step by the record_function ranges that MoELayer.forward and the dispatchers open:

- router:      "moe/router" (the gate's GEMM, top-k, the balancing loss);
- counts:      "moe/dispatch/counts" (the count exchange and the host read of the split sizes; alltoall only);
- exchange:    "moe/dispatch/exchange" (all-to-all, all-gather, reduce-scatter of the rows);
- permutation: the rest of "moe/dispatch" (sorting assignments by expert, gathering rows into expert
               order and back, the weighted combine);
- experts:     "moe/experts" (the grouped expert GEMMs and activation);
- rest:        everything else of the step (attention, norms, embedding, loss, gradient sync, optimizer).

Forward time is each range's own time (less the ranges inside it). Backward time is attributed through
the autograd graph: every backward node the engine evaluates carries the sequence number of the forward
op that created it, so a node's time goes to the range that forward op ran in (the backward of an
all-to-all to "exchange", of the row gather to "permutation", and so on). Dispatch = counts + exchange +
permutation. Shares are of the profiled step's wall time, per rank, averaged over ranks, then the
median over rounds; step times are the unprofiled steps' median (per step, the slowest rank).

Ranks wait inside the count exchange and the exchanges for slower ranks (uneven routing and attention
times, and the scheduler: EP=4 runs 4 ranks on however many cores there are), so those shares include
that wait. Every rank runs the same collectives in the same order, and the rank that arrives last at one
waits least, so a rank's wait is, summed over collectives, its time in each less the least time any rank
spent in it (``wait_shares``); the table gives it beside the dispatch share.

    python bench/bench_moe_dispatch.py                 # writes the "MoE dispatch overhead" section
    python bench/bench_moe_dispatch.py --quick         # smoke test: tiny model, EP=1 and EP=2
"""
from __future__ import annotations

import argparse
import bisect
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_parallel import spawn  # noqa: E402
from llama_flags import llama_argv, random_batches  # noqa: E402
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CATEGORIES = ("router", "counts", "exchange", "permutation", "experts", "rest")
DISPATCH = ("counts", "exchange", "permutation")
RANGES = {"moe/router": "router", "moe/dispatch/counts": "counts", "moe/dispatch/exchange": "exchange",
          "moe/dispatch": "permutation", "moe/experts": "experts"}
STEP_RANGE = "bench/step"
BACKWARD = "autograd::engine::evaluate_function: "


@dataclass(frozen=True)
class Shape:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    experts: int = 8
    topk: int = 2
    expert_ffn: int = 512
    vocab: int = 1024
    seq: int = 256
    mbs: int = 2
    gbs: int = 8

    @property
    def ffn(self) -> int:           # the dense MLP's size; every layer here is an MoE layer
        return self.expert_ffn

    def argv(self, ep: int, dispatcher: str) -> list[str]:
        return llama_argv(self, self.mbs, self.gbs) + [
            "--num-experts", str(self.experts), "--moe-router-topk", str(self.topk),
            "--moe-ffn-hidden-size", str(self.expert_ffn), "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-2",
            "--moe-token-dispatcher-type", dispatcher, "--expert-model-parallel-size", str(ep)]

    def describe(self) -> str:
        return (f"Llama-MoE {self.layers} layers (all MoE), hidden {self.hidden}, {self.heads} heads / "
                f"{self.kv_heads} KV heads, {self.experts} experts top-{self.topk}, expert ffn {self.expert_ffn} "
                f"(SwiGLU), vocab {self.vocab}, seq {self.seq}; global batch {self.gbs} in micro-batches of "
                f"{self.mbs}; fp32, mock tokens, aux loss 1e-2")


FULL = Shape()
QUICK = replace(FULL, layers=2, hidden=64, experts=4, expert_ffn=64, vocab=128, seq=32, gbs=4)


def layouts(quick: bool) -> list[tuple[str, int, str]]:
    """(name, EP = processes, dispatcher)."""
    sizes = (1, 2) if quick else (1, 2, 4)
    return [(f"EP={ep} {d}", ep, d) for ep in sizes for d in ("alltoall", "allgather")]


# ---- splitting a profile ----------------------------------------------------------------------------------
def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _ranges(events) -> dict:
    """Per thread: the moe/* and step ranges as sorted (start, end, name), once each."""
    found = {}
    for e in events:
        if e.name in RANGES or e.name == STEP_RANGE:
            found.setdefault(e.thread, set()).add((e.time_range.start, e.time_range.end, e.name))
    return {thread: sorted(spans) for thread, spans in found.items()}


def _innermost(spans: list, starts: list, t: float) -> str | None:
    """The name of the latest-starting range that contains t (ranges nest, so that is the innermost)."""
    i = bisect.bisect_right(starts, t) - 1
    while i >= 0:
        start, end, name = spans[i]
        if end >= t and name != STEP_RANGE:
            return name
        i -= 1
    return None


COLLECTIVES = ("counts", "exchange")                 # the categories whose time is a collective's (and its wait)


@dataclass
class Split:
    """One rank's profiled steps: ``seconds`` per category (and "step": their wall time); ``nodes``, the
    backward nodes per (category, node name); ``collectives``, the seconds of every count-exchange and
    exchange range and exchange backward node in the order the rank ran them (every rank runs the same
    collectives in the same order, so the i-th entries of two ranks are the same collective)."""
    seconds: dict
    nodes: Counter
    collectives: list


def _forward_times(spans: dict, seconds: Counter, collectives: list) -> None:
    """Each range's own time (less the ranges directly inside it) into its category; the step ranges' sum."""
    for thread_spans in spans.values():
        stack = []
        for start, end, name in thread_spans:
            while stack and stack[-1][1] <= start:
                stack.pop()
            if name == STEP_RANGE:
                seconds["step"] += (end - start) / 1e6
            else:
                seconds[RANGES[name]] += (end - start) / 1e6
                if stack and stack[-1][2] != STEP_RANGE:
                    seconds[RANGES[stack[-1][2]]] -= (end - start) / 1e6
                if RANGES[name] in COLLECTIVES:
                    collectives.append((start, (end - start) / 1e6))
            stack.append((start, end, name))


def _backward_nodes(events) -> tuple[list, dict]:
    """The backward nodes the engine evaluated (outermost only), and per (thread, sequence number) the start
    of the forward op that created the node of that number."""
    created, backward = {}, []
    for e in events:
        if e.sequence_nr < 0:
            continue
        inside_backward = any(a.name.startswith(BACKWARD) for a in _ancestors(e))
        if e.name.startswith(BACKWARD):
            if not inside_backward:
                backward.append(e)
        elif not inside_backward:
            key = (e.thread, e.sequence_nr)                 # the last op to see a number is the one that used it
            created[key] = max(created.get(key, e.time_range.start), e.time_range.start)
    return backward, created


def split_profile(events) -> Split:
    """Forward time by the innermost range, backward time by the range of each node's forward op."""
    spans = _ranges(events)
    seconds, nodes, collectives = Counter(), Counter(), []
    _forward_times(spans, seconds, collectives)
    backward, created = _backward_nodes(events)
    starts = {thread: [s[0] for s in thread_spans] for thread, thread_spans in spans.items()}
    for e in backward:
        t = created.get((e.fwd_thread, e.sequence_nr))
        name = None if t is None else _innermost(spans.get(e.fwd_thread, []), starts.get(e.fwd_thread, []), t)
        if name is not None:
            seconds[RANGES[name]] += (e.time_range.end - e.time_range.start) / 1e6
            nodes[(RANGES[name], e.name[len(BACKWARD):])] += 1
            if RANGES[name] in COLLECTIVES:
                collectives.append((e.time_range.start, (e.time_range.end - e.time_range.start) / 1e6))
    seconds["rest"] = seconds["step"] - sum(seconds[c] for c in CATEGORIES if c != "rest")
    return Split(dict(seconds), nodes, [d for _, d in sorted(collectives)])


# ---- one rank -----------------------------------------------------------------------------------------------
def profile_steps(rank: int, world: int, shape: Shape, dispatcher: str, steps: int, warmup: int,
                  profiled: int) -> dict:
    """On each rank: ``warmup`` steps, ``steps`` timed steps, ``profiled`` profiled steps. Returns the timed
    steps' seconds, the profiled steps' split (split_profile, summed over them) and the moe/* ranges
    opened per profiled step."""
    import torch
    from megalite.train.command_line import parse_args
    from megalite.train.step import train_step
    from megalite.train.trainer import build_trainer
    trainer = build_trainer(parse_args(shape.argv(world, dispatcher), world_size=world), print_fn=lambda *_: None)

    def barrier():
        if world > 1:
            torch.distributed.barrier()

    data, times = random_batches(shape, rank), []
    for i in range(warmup + steps):
        barrier()
        start = time.perf_counter()
        train_step(trainer, data)
        times.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(profiled):
            barrier()
            with torch.profiler.record_function(STEP_RANGE):
                train_step(trainer, data)
    events = prof.events()
    split = split_profile(events)
    opened = Counter(e.name for e in events if e.name in RANGES)
    return {"step": times[warmup:], "seconds": split.seconds, "nodes": split.nodes,
            "collectives": split.collectives, "profiled": profiled, "ranges_per_step": sum(opened.values()) / profiled}


def record_function_cost(n: int = 20000) -> float:
    """Seconds one record_function range costs with no profiler running (enter + exit, less an empty loop)."""
    import torch
    for _ in range(100):                            # the op's first lookups
        with torch.profiler.record_function("moe/cost"):
            pass
    start = time.perf_counter()
    for _ in range(n):
        pass
    empty = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(n):
        with torch.profiler.record_function("moe/cost"):
            pass
    return max(0.0, time.perf_counter() - start - empty) / n


# ---- the table -------------------------------------------------------------------------------------------------
def shares(result: dict) -> dict:
    """Category -> share of the profiled step on one rank."""
    seconds = result["seconds"]
    return {c: seconds.get(c, 0.0) / seconds["step"] for c in CATEGORIES}


def wait_shares(results: list[dict]) -> list[float]:
    """Per rank, the share of its profiled step spent waiting for the other ranks in collectives: each
    collective's time less the least time any rank spent in it (the rank that arrives last waits least)."""
    calls = [r["collectives"] for r in results]
    assert len({len(c) for c in calls}) == 1, "the ranks ran different collectives"
    least = [min(times) for times in zip(*calls)]
    return [sum(t - m for t, m in zip(c, least)) / r["seconds"]["step"] for c, r in zip(calls, results)]


def measure(args) -> dict:
    """Layout name -> {"step": per-step seconds (slowest rank), "shares": per rank, "rounds": per round the
    shares and the wait averaged over ranks, "ranks": raw results}."""
    runs = {name: {"step": [], "shares": [], "rounds": [], "ranks": []} for name, _, _ in layouts(args.quick)}
    for _ in range(args.rounds):                    # rounds interleave layouts so machine noise hits all alike
        for name, ep, dispatcher in layouts(args.quick):
            results = spawn(ep, args.threads, profile_steps, args.shape, dispatcher, args.steps, args.warmup,
                            args.profiled)
            runs[name]["step"] += [max(r["step"][i] for r in results) for i in range(args.steps)]
            per_rank = [shares(r) for r in results]
            runs[name]["shares"] += per_rank
            mean = {c: statistics.mean(s[c] for s in per_rank) for c in CATEGORIES}
            runs[name]["rounds"].append({**mean, "dispatch": sum(mean[c] for c in DISPATCH),
                                         "wait": statistics.mean(wait_shares(results))})
            runs[name]["ranks"] += results
    return runs


def table(runs: dict, args) -> tuple[list[str], dict]:
    """The rows, and per layout (the dispatch share, the share of waiting inside it): medians over rounds."""
    rows = ["| layout | processes x threads | ms / step | profiled ms / step | dispatch share | of which waiting "
            "for other ranks | counts | exchange | permutation | experts | router | rest | dispatch share per "
            "round | dispatch share, min-max over ranks |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    figures = {}
    for name, ep, _ in layouts(args.quick):
        run = runs[name]
        med = {key: statistics.median(r[key] for r in run["rounds"]) for key in run["rounds"][0]}
        figures[name] = (med["dispatch"], med["wait"])
        profiled = statistics.median(r["seconds"]["step"] / r["profiled"] for r in run["ranks"]) * 1000
        per_rank = [sum(s[c] for c in DISPATCH) for s in run["shares"]]
        rounds = " / ".join(f"{r['dispatch']:.1%}" for r in run["rounds"])
        rows.append(f"| {name} | {ep} x {args.threads} | {statistics.median(run['step']) * 1000:.0f} | "
                    f"{profiled:.0f} | **{med['dispatch']:.1%}** | {med['wait']:.1%} | {med['counts']:.1%} | "
                    f"{med['exchange']:.1%} | {med['permutation']:.1%} | {med['experts']:.1%} | "
                    f"{med['router']:.1%} | {med['rest']:.1%} | {rounds} | {min(per_rank):.1%}-{max(per_rank):.1%} |")
    return rows, figures


def describe(args, runs: dict, load_before: float) -> str:
    """The section's text: what ran, how it is split, and what a range costs without a profiler."""
    cost = record_function_cost()
    reference = runs[layouts(args.quick)[0][0]]
    ranges = statistics.mean(r["ranges_per_step"] for r in reference["ranks"])
    return (
        f"{args.shape.describe()}. EP = processes (gloo on localhost, expert parallelism inside data parallelism, "
        f"same global batch), {args.threads} intra-op thread(s) per rank (OMP_NUM_THREADS={args.threads}) on "
        f"{os.cpu_count()} cores: EP=4 oversubscribes them, so its absolute times are the scheduler's as much as "
        f"the model's; compare shares. Per layout, {args.rounds} round(s) of {args.warmup} warm-up, {args.steps} "
        f"timed and {args.profiled} profiled steps (torch.profiler, CPU). Shares are of the profiled step, "
        f"averaged over ranks, medians over rounds (so a row need not add up to 100%); dispatch = counts + exchange + permutation (module docstring of "
        f"bench/bench_moe_dispatch.py: forward by record_function ranges, backward by the autograd node's "
        f"forward op). Counts and exchange include the wait for the slower rank; the waiting column is, per "
        f"collective, a rank's time in it less the least any rank spent in it (the last rank to arrive waits "
        f"least), summed. Load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} (start -> end; the benchmark's "
        f"own ranks add up to {max(ep for _, ep, _ in layouts(args.quick))}). record_function without a profiler: "
        f"{cost * 1e6:.2f} us per range, {ranges:.0f} ranges per EP=1 step = "
        f"{cost * ranges / statistics.median(reference['step']):.4%} of its step.")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, help="timed steps per layout and round (default 5; 1 with --quick)")
    p.add_argument("--warmup", type=int, help="warm-up steps per layout and round (default 2; 1 with --quick)")
    p.add_argument("--profiled", type=int, help="profiled steps per layout and round (default 3; 1 with --quick)")
    p.add_argument("--rounds", type=int, help="rounds over the layouts (default 2; 1 with --quick)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (OMP_NUM_THREADS; default 1)")
    p.add_argument("--no-write", action="store_true", help="print only; leave the results file alone")
    add_common_args(p)
    args = p.parse_args(argv)
    args.shape = QUICK if args.quick else FULL
    args.steps = args.steps or (1 if args.quick else 5)
    args.warmup = args.warmup or (1 if args.quick else 2)
    args.profiled = args.profiled or (1 if args.quick else 3)
    args.rounds = args.rounds or (1 if args.quick else 2)
    load_before = os.getloadavg()[0]
    runs = measure(args)
    rows, figures = table(runs, args)
    header = describe(args, runs, load_before)
    print(header + "\n" + "\n".join(rows), flush=True)
    headlines = [(f"MoE dispatch share of the training step, {name}",
                  f"EP=1 {dispatcher} (one process), same model and batch",
                  f"{figures[name][0]:.1%} of the step, {figures[name][0] - figures[name][1]:.1%} less the wait "
                  f"for other ranks (EP=1: {figures[f'EP=1 {dispatcher}'][0]:.1%})")
                 for name, ep, dispatcher in layouts(args.quick) if ep > 1]
    command = command_line("bench_moe_dispatch.py", argv)
    publish(args, "bench_moe_dispatch", "MoE dispatch overhead", command, [Headline(*h, command) for h in headlines],
            [header, "", *rows])


if __name__ == "__main__":
    main(sys.argv[1:])
