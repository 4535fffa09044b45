#!/usr/bin/env python
"""Every benchmark in one command; writes bench/RESULTS.md: a header (machine, date, command, how long
each benchmark took), a summary table of headline ratios, and one section per benchmark.

    python bench/run_all.py            # the real run (what `make bench` runs)
    python bench/run_all.py --quick    # smoke test of every benchmark: writes bench/quick/RESULTS.md

Each benchmark runs as its own process (``python bench/SCRIPT [--quick]``, also runnable alone), writes
its own section and hands its headline figures back for the summary. A benchmark that fails gets a
failure note (exit code, last lines of its output) at the top of its section -- figures from its last
good run, if any, stay below the note -- and a FAILED row in the summary; the others still run, and
run_all exits 1 at the end.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import (BENCH, QUICK_NOTE, QUICK_RESULTS, RESULTS, Headline, machine_description,  # noqa: E402
                     read_headlines, read_section, replace_section)

FAILURE_MARK = "> **FAILED**"
TAIL_LINES = 30


@dataclass(frozen=True)
class Bench:
    script: str
    sections: tuple[str, ...]      # the keys of the sections it writes
    title: str                     # its section's title, for a failure note where it has none yet


BENCHES = (
    Bench("bench_vs_hf.py", ("bench_vs_hf",), "megalite vs transformers, single-process training"),
    Bench("bench_parallel.py", ("bench_parallel_dp", "bench_parallel_fsdp2", "bench_parallel_tp"),
          "Parallel overheads on the same cores (DP, ZeRO-1, ZeRO-3 vs FSDP2, TP, SP)"),
    Bench("bench_pipeline.py", ("bench_pipeline", "bench_pipeline_vs_torch"),
          "Pipeline bubble vs theory; schedules vs torch.distributed.pipelining"),
    Bench("bench_context_parallel.py", ("bench_context_parallel",),
          "Context parallelism: activation memory per rank vs sequence length"),
    Bench("bench_masked_attention.py", ("bench_masked_attention",),
          "Masked attention: documents, windows and sinks vs flash"),
    Bench("bench_mla.py", ("bench_mla",), "Multi-latent attention vs GQA and transformers"),
    Bench("bench_data.py", ("bench_data",), "Data pipeline: preprocessing, indices, blending, reads"),
    Bench("bench_memory.py", ("bench_memory_zero", "bench_memory_fsdp2", "bench_memory_checkpoint",
                              "bench_memory_activations", "bench_memory_cross_entropy"),
          "Memory per rank: ZeRO stages vs theory, ZeRO-3 vs FSDP2, checkpoints, activations"),
    Bench("gpu_mfu.py", ("gpu_mfu",), "GPU MFU: ~1B Llama, bf16, one GPU, megalite vs transformers"),
    Bench("bench_moe.py", ("bench_moe",), "MoE layer vs transformers"),
    Bench("bench_moe_dispatch.py", ("bench_moe_dispatch",), "MoE dispatch overhead"),
    Bench("moe_load_balance.py", ("moe_load_balance",), "MoE load balance"),
    Bench("bench_fake_world.py", ("bench_fake_world",), "Thousands of ranks: grid construction and a dry run"),
    Bench("bench_layouts.py", ("bench_layouts",), "Layouts at scale: dry runs beside the planner"),
    Bench("bench_async_save.py", ("bench_async_save",), "Asynchronous checkpoint saves: training stall"),
    Bench("bench_init.py", ("bench_init",), "Initial weights of a 1B-parameter shard"),
    Bench("bench_muon.py", ("bench_muon",), "Muon vs AdamW: optimizer step time and state per rank, per layout"),
    Bench("muon_vs_adamw.py", ("muon_vs_adamw",), "Muon vs AdamW: loss on the demo corpus at equal tokens"),
)


@dataclass
class Outcome:
    bench: Bench
    command: str
    returncode: int
    seconds: float
    tail: list[str]


def run_bench(bench: Bench, quick: bool, results: str, headlines: str) -> Outcome:
    """Run one benchmark script, streaming its output, keeping the last lines for a failure note."""
    flags = ["--quick"] if quick else []
    command = " ".join(["python", f"bench/{bench.script}", *flags])
    print(f"\n=== {command}", flush=True)
    argv = [sys.executable, os.path.join(BENCH, bench.script), *flags, "--results", results, "--headlines", headlines]
    start = time.perf_counter()
    tail = collections.deque(maxlen=TAIL_LINES)
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))
    seconds = time.perf_counter() - start
    print(f"=== {command}: {'ok' if proc.returncode == 0 else f'FAILED (exit {proc.returncode})'} "
          f"in {duration(seconds)}", flush=True)
    return Outcome(bench, command, proc.returncode, seconds, list(tail))


def record_failure(outcome: Outcome, results: str, date: str) -> None:
    """A failure note at the top of each of the benchmark's sections, above its last good figures."""
    note = [f"{FAILURE_MARK} in the run of {date}: `{outcome.command}` exited with code {outcome.returncode}. "
            "Figures below this note, if any, are from an earlier run. Last lines of its output:", "> ```",
            *(f"> {line}" for line in outcome.tail), "> ```", ""]
    for key in outcome.bench.sections:
        lines = read_section(key, results) or [f"## {outcome.bench.title}"]
        title, rest = lines[0], without_failure_note(lines[1:])
        replace_section(key, [title, *note, *rest], results)


def without_failure_note(lines: list[str]) -> list[str]:
    """The section's lines less a failure note of an earlier run (quoted lines and the blank after them)."""
    if lines and lines[0].startswith(FAILURE_MARK):
        while lines and lines[0].startswith(">"):
            lines = lines[1:]
        if lines and not lines[0].strip():
            lines = lines[1:]
    return lines


def duration(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def summary_rows(outcomes: list[Outcome], headlines: list[Headline]) -> list[str]:
    rows = ["| benchmark | baseline (same run) | ratio | command |", "|---|---|---|---|"]
    by_command = collections.defaultdict(list)
    for h in headlines:
        by_command[h.command].append(h)
    for outcome in outcomes:
        if outcome.returncode != 0:
            rows.append(f"| {outcome.bench.title} | - | **FAILED** (exit {outcome.returncode}; see its section) | "
                        f"`{outcome.command}` |")
        for h in by_command.get(outcome.command, []):
            rows.append(f"| {h.benchmark} | {h.baseline} | {h.ratio} | `{h.command}` |")
    return rows


def header_lines(argv: list[str], quick: bool, started: str, outcomes: list[Outcome],
                 headlines: list[Headline]) -> list[str]:
    total = sum(o.seconds for o in outcomes)
    times = ", ".join(f"{o.bench.script} {duration(o.seconds)}" for o in outcomes)
    mode = f"**{QUICK_NOTE}**" if quick else "full measurement (the default mode)"
    failed = [o.command for o in outcomes if o.returncode != 0]
    return [
        f"Machine: {machine_description()}.",
        f"Run: {started}, {duration(total)} in all ({times}). Mode: {mode}.",
        "Command: `" + " ".join(["python", "bench/run_all.py", *argv]) + "` (`make bench` runs it).",
        "Every ratio is measured side by side with its baseline in the same run, on the same machine. "
        "Sections re-run alone later carry their own date line; this summary is from the run above."
        + (f" **Failed: {', '.join(failed)}.**" if failed else ""),
        "", "## Summary", "", *summary_rows(outcomes, headlines)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test: fewer steps and sizes, marked as such")
    parser.add_argument("--results", help="default bench/RESULTS.md, or bench/quick/RESULTS.md with --quick")
    args = parser.parse_args(argv)
    results = os.path.abspath(args.results or (QUICK_RESULTS if args.quick else RESULTS))
    started = time.strftime("%Y-%m-%d %H:%M")
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        headlines_file = os.path.join(tmp, "headlines.jsonl")
        for bench in BENCHES:
            outcome = run_bench(bench, args.quick, results, headlines_file)
            if outcome.returncode != 0:
                record_failure(outcome, results, started)
            outcomes.append(outcome)
        headlines = read_headlines(headlines_file)
    replace_section("run_all", header_lines(argv, args.quick, started, outcomes, headlines), results, top=True)
    failed = [o.command for o in outcomes if o.returncode != 0]
    print(f"\nwrote {results}" + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
