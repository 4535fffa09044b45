#!/usr/bin/env python
"""Single-process training speed: megalite (eager and --compile) vs transformers' LlamaForCausalLM.

Same config and batch. Both sides train with AdamW (same betas, eps, weight decay) and gradient clipping
at 1.0 on random tokens; transformers runs bf16 the usual way (fp32 weights under autocast), megalite
with its --bf16 (bf16 weights, fp32 master weights and gradient accumulation).

megalite is timed by its own training loop: the worker builds what pretrain_gpt.py builds (trainer, mock
data loader with its workers) and runs megalite.train.loop.train with --log-interval 1, and the figure is
the "elapsed time per iteration (ms)" of its log lines, i.e. what pretrain_gpt.py prints. Only the
checkpoint and evaluation steps are left out, which the command line disables anyway. transformers'
step (batch, forward, backward, clip, AdamW step, zero_grad) is timed around the call.

Each side lives in its own process (neither inherits the other's allocator or thread state); megalite's
first sets the CPU allocator policy pretrain_gpt.py sets (megalite/train/allocator.py), transformers'
runs as a user runs it (with whatever the environment gives, glibc's defaults on a bare command); steps run
in rounds, one side at a time, in a rotating order, so machine noise hits all alike. Rounds repeat until
every ratio (from medians of all steps so far) moved less than --tolerance since the previous round
(at least --rounds rounds, at most --max-rounds). The ratio is HF ms / megalite ms per iteration (>1:
megalite faster). Model FLOP/s is reported as a share of the best bf16/fp32 matmul rate measured in
the same run (between rounds). The load average at the start and the end is published with the figures.

    python bench/bench_vs_hf.py                  # fp32 and bf16, eager and compiled; writes bench/RESULTS.md
    python bench/bench_vs_hf.py --dtypes bf16 --no-compile
    python bench/bench_vs_hf.py --quick          # smoke test: 2 layers, seq 256, few steps
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_flags import llama_argv  # noqa: E402
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@dataclass(frozen=True)
class Shape:
    layers: int = 8
    hidden: int = 512
    ffn: int = 1408
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 8192
    seq: int = 512
    mbs: int = 8

    def describe(self) -> str:
        return (f"Llama {self.layers} layers, hidden {self.hidden}, {self.heads} heads / {self.kv_heads} KV heads, "
                f"SwiGLU {self.ffn}, vocab {self.vocab}, seq {self.seq}, micro-batch {self.mbs}")


FULL = Shape()
QUICK = replace(FULL, layers=2, seq=256, mbs=4)


CONTENDERS = ("megalite", "megalite-compiled", "hf")
TIME_FIELD = "elapsed time per iteration (ms):"


def megalite_args(shape: Shape) -> list[str]:
    return llama_argv(shape, shape.mbs, shape.mbs) + ["--adam-beta1", "0.9", "--adam-beta2", "0.95",
                                                      "--log-interval", "1"]


def compile_flag_available() -> bool:
    """--compile is megalite's (megalite/train/compile.py); an older checkout without it compares eager only."""
    from megalite.train.command_line import parse_args
    try:
        parse_args(megalite_args(QUICK) + ["--compile"], world_size=1)
        return True
    except (SystemExit, Exception):
        return False


def random_batches(shape: Shape):
    import torch
    while True:
        x = torch.randint(0, shape.vocab, (shape.mbs, shape.seq + 1))
        yield {"tokens": x[:, :-1], "labels": x[:, 1:]}


class MegaliteLoop:
    """pretrain_gpt.py's loop: megalite.train.loop.train on the trainer and mock-data loader that pretrain
    builds, run ``n`` iterations at a time; the times are those its log lines report."""

    def __init__(self, shape: Shape, dtype: str, compiled: bool):
        from megalite.train.command_line import parse_args
        from megalite.data.tokenizers import build_tokenizer
        from megalite.train.trainer import build_data_iterators, build_trainer
        argv = megalite_args(shape) + (["--bf16"] if dtype == "bf16" else []) + (["--compile"] if compiled else [])
        config = parse_args(argv, world_size=1)
        self.trainer = build_trainer(config, print_fn=lambda *_: None)
        self.train_iter, _, _ = build_data_iterators(self.trainer, build_tokenizer(config.data))
        self.times: list[float] = []

    def log(self, line: str) -> None:
        if TIME_FIELD in line:
            self.times.append(float(line.split(TIME_FIELD)[1].split("|")[0]) / 1000)

    def run(self, n: int) -> list[float]:
        from megalite.train.loop import train
        self.times = []
        t = self.trainer.config.training
        t.train_iters = self.trainer.state.iteration + n
        train(self.trainer, self.train_iter, None, self.log, None)
        assert len(self.times) == n, f"expected {n} iteration lines, got {len(self.times)}"
        return self.times


class HFLoop:
    def __init__(self, shape: Shape, dtype: str):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                             num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                             num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.seq,
                             tie_word_embeddings=False, attention_dropout=0.0)
        config._attn_implementation = "sdpa"
        self.model = LlamaForCausalLM(config)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                                     weight_decay=0.1)
        self.batches = random_batches(shape)
        self.bf16 = dtype == "bf16"

    def step(self) -> None:
        import torch
        batch = next(self.batches)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.model(input_ids=batch["tokens"], labels=batch["tokens"]).loss   # HF shifts labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def run(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - start)
        return times


def worker(kind: str, shape: Shape, dtype: str, conn) -> None:
    if kind != "hf":                 # megalite's process sets its allocator policy first, as pretrain_gpt.py does
        from megalite.train.allocator import set_allocator_policy
        set_allocator_policy()
    loop = HFLoop(shape, dtype) if kind == "hf" else MegaliteLoop(shape, dtype, compiled=kind == "megalite-compiled")
    conn.send("ready")
    while (n := conn.recv()) > 0:
        conn.send(loop.run(n))


def matmul_peak_flops(dtype: str) -> float:
    """Best FLOP/s of a large square matmul in this dtype: the denominator of the utilisation share."""
    import torch
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    a = torch.randn(2048, 2048, dtype=torch_dtype)
    b = torch.randn(2048, 2048, dtype=torch_dtype)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * 2048 ** 3 / best


def model_flops_per_step(shape: Shape) -> float:
    from megalite.train.command_line import parse_args
    from megalite.train.performance import flops_per_iteration
    config = parse_args(megalite_args(shape), world_size=1)
    return flops_per_iteration(config.model, shape.mbs)


def ratios(times: dict) -> dict:
    """HF median / each megalite contender's median."""
    hf = statistics.median(times["hf"])
    return {k: hf / statistics.median(v) for k, v in times.items() if k != "hf"}


def stable(previous: dict | None, current: dict, tolerance: float) -> bool:
    return previous is not None and all(abs(current[k] / previous[k] - 1) <= tolerance for k in current)


def compare(shape: Shape, dtype: str, kinds: tuple, min_rounds: int, max_rounds: int, steps: int, warmup: int,
            tolerance: float) -> dict:
    ctx = mp.get_context("spawn")
    pipes, procs = {}, []
    for kind in kinds:
        parent, child = ctx.Pipe()
        # not a daemon: megalite's data loader starts worker processes of its own
        proc = ctx.Process(target=worker, args=(kind, shape, dtype, child))
        proc.start()
        pipes[kind] = parent
        procs.append(proc)
    try:
        times, history, peak, load = run_rounds(pipes, kinds, dtype, min_rounds, max_rounds, steps, warmup, tolerance)
        for pipe in pipes.values():
            pipe.send(0)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()
    flops = model_flops_per_step(shape)
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    return {"dtype": dtype, "ms": ms, "ratio": ratios(times), "util": {k: flops / (v / 1000) / peak for k, v in ms.items()},
            "peak_tflops": peak / 1e12, "steps": len(times["hf"]), "rounds": len(history),
            "converged": stable(history[-2] if len(history) > 1 else None, history[-1], tolerance), "load": load}


def run_rounds(pipes: dict, kinds: tuple, dtype: str, min_rounds: int, max_rounds: int, steps: int, warmup: int,
               tolerance: float):
    """Warm every side up, then rounds of ``steps`` steps per side until the ratios are stable.
    Returns the step times per side, the ratios after each round, the best matmul rate and the load
    average at the start and the end of the timed rounds."""
    for kind, pipe in pipes.items():                  # one at a time: start-up (and compiling) never overlaps
        assert pipe.recv() == "ready"
        pipe.send(warmup)
        pipe.recv()
    load_start = os.getloadavg()[0]
    times = {kind: [] for kind in kinds}
    peak, previous, history = matmul_peak_flops(dtype), None, []
    for round_index in range(max_rounds):
        order = kinds[round_index % len(kinds):] + kinds[:round_index % len(kinds)]   # nobody always goes first
        for kind in order:                           # one side at a time: they never share the cores
            pipes[kind].send(steps)
            times[kind] += pipes[kind].recv()
        peak = max(peak, matmul_peak_flops(dtype))
        current = ratios(times)
        history.append(current)
        print(f"  {dtype} round {round_index + 1}: " + ", ".join(f"{k} {v:.3f}x" for k, v in current.items())
              + f" (load {os.getloadavg()[0]:.1f})", flush=True)
        if round_index + 1 >= min_rounds and stable(previous, current, tolerance):
            break
        previous = current
    return times, history, peak, (load_start, os.getloadavg()[0])


def table_rows(r: dict) -> list[str]:
    rows = []
    for kind in r["ms"]:
        ratio = "1.00x (baseline)" if kind == "hf" else f"**{r['ratio'][kind]:.2f}x**"
        rows.append(f"| {r['dtype']} | {kind} | {r['ms'][kind]:.0f} | {ratio} | {100 * r['util'][kind]:.0f}% | "
                    f"{r['peak_tflops']:.2f} | {r['steps']} in {r['rounds']} rounds"
                    f"{'' if r['converged'] else ' (not stable)'} | {r['load'][0]:.1f} -> {r['load'][1]:.1f} |")
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--no-compile", action="store_true", help="leave out compiled megalite")
    parser.add_argument("--rounds", type=int, help="at least this many rounds (default 3; 2 with --quick)")
    parser.add_argument("--max-rounds", type=int, help="at most this many rounds (default 10; 2 with --quick)")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="stop when no ratio moved more than this (relative) in the last round (default 0.02)")
    parser.add_argument("--steps", type=int, help="steps per side per round (default 2; 1 with --quick)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per side (default 3; 2 with --quick)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    min_rounds = args.rounds or (2 if args.quick else 3)
    max_rounds = max(min_rounds, args.max_rounds or (2 if args.quick else 10))
    steps, warmup = args.steps or (1 if args.quick else 2), args.warmup or (2 if args.quick else 3)
    compiled = not args.no_compile and compile_flag_available()
    kinds = CONTENDERS if compiled else tuple(k for k in CONTENDERS if k != "megalite-compiled")
    command = command_line("bench_vs_hf.py", argv)
    results, rows = [], []
    for dtype in args.dtypes.split(","):
        results.append(compare(shape, dtype, kinds, min_rounds, max_rounds, steps, warmup, args.tolerance))
        rows += table_rows(results[-1])
        print("\n".join(table_rows(results[-1])), flush=True)
    headlines = [Headline(f"megalite{' --compile' if kind.endswith('compiled') else ''} vs transformers, "
                          f"single-process training, {r['dtype']}",
                          "transformers LlamaForCausalLM (eager), same model, batch and optimizer",
                          f"{r['ratio'][kind]:.2f}x faster (HF ms / megalite ms); "
                          f"{100 * r['util'][kind]:.0f}% of the measured {r['dtype']} matmul peak", command)
                 for r in results for kind in r["ratio"]]
    body = [f"{shape.describe()}; AdamW + clip 1.0. megalite timed by its own training loop "
            "(megalite.train.loop.train, the figure its log lines print, data loader included); transformers "
            "around its step. Ratio = HF ms / megalite ms, medians of all steps per side after "
            f"{warmup} warm-up steps, {steps} steps per side per round, rounds repeated until no ratio moved "
            f"more than {100 * args.tolerance:g}% in a round (at least {min_rounds}, at most {max_rounds}).",
            "", *([] if compiled else ["Compiled megalite left out (--no-compile, or this checkout has no --compile).", ""]),
            "| dtype | side | ms/iteration | vs transformers | model FLOP/s share of matmul peak | "
            "peak TFLOP/s (same run) | steps | load average start -> end |",
            "|---|---|---|---|---|---|---|---|", *rows]
    publish(args, "bench_vs_hf", "megalite vs transformers, single-process training", command, headlines, body)


if __name__ == "__main__":
    main(sys.argv[1:])
