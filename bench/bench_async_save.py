#!/usr/bin/env python
"""--async-save: how long training stalls per save, beside a synchronous save of the same state, in one
run of this script.

The model is make test-slow's: a ~0.7B bf16 Llama (12 layers, hidden 2048, GQA, vocab 32000) with
ZeRO-3 at DP=4 (every rank writes its shard: bf16 weights, fp32 master weights and Adam moments, about
2.4 GB a rank). Both runs train the same iterations and save at the same ones, through pretrain_gpt.py
under torchrun. The synchronous stall is the time of the save (the rank's log line); the asynchronous
one is the time the training thread spent in it (snapshot, and waiting for a previous save still in
flight). Also reported: the mean step time of each run, whose difference is what writing in the
background costs the steps it overlaps, and the losses (identical, or the comparison is void).

    python bench/bench_async_save.py             # writes bench/RESULTS.md
    python bench/bench_async_save.py --quick     # a ~78M-parameter model
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIG = ["--num-layers", "12", "--hidden-size", "2048", "--ffn-hidden-size", "5632", "--num-attention-heads", "16",
       "--num-query-groups", "4", "--vocab-size", "31999", "--seq-length", "32", "--max-position-embeddings", "32"]
SMALL = ["--num-layers", "4", "--hidden-size", "1024", "--ffn-hidden-size", "2816", "--num-attention-heads", "8",
         "--num-query-groups", "2", "--vocab-size", "16383", "--seq-length", "32", "--max-position-embeddings", "32"]
COMMON = ["--group-query-attention", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
          "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--attention-dropout", "0",
          "--hidden-dropout", "0", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4", "--bf16",
          "--mock-data", "--tokenizer-type", "NullTokenizer", "--log-interval", "1", "--eval-iters", "0",
          "--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce", "--overlap-param-gather",
          "--ddp-bucket-size", "10000000"]
RANKS = 4


def run(model: list[str], iters: int, interval: int, save: str, extra: list[str]) -> str:
    argv = [*model, *COMMON, "--train-iters", str(iters), "--save-interval", str(interval), "--save", save, *extra]
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
           os.path.join(ROOT, "pretrain_gpt.py"), *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def figures(out: str) -> dict:
    step_ms = [float(m) for m in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out)]
    return {
        "sync": [float(s) for s in re.findall(r"saved checkpoint at iteration \d+ to \S+ \(([0-9.]+) s\)\n", out)],
        "stall": [float(s) for s in re.findall(r"training stalled ([0-9.]+) s", out)],
        "background": [float(s) for s in re.findall(r"\(([0-9.]+) s, in the background\)", out)],
        "losses": re.findall(r"lm loss: ([0-9.E+-]+)", out),
        "step_ms": statistics.mean(step_ms[1:]) if len(step_ms) > 1 else float("nan"),   # the first: warm-up
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    args = parser.parse_args(argv)
    model, name = (SMALL, "~78M Llama") if args.quick else (BIG, "~0.7B Llama")
    iters, interval = 6, 2
    with tempfile.TemporaryDirectory() as tmp:
        sync = figures(run(model, iters, interval, os.path.join(tmp, "sync"), []))
        background = figures(run(model, iters, interval, os.path.join(tmp, "async"), ["--async-save"]))
    if sync["losses"] != background["losses"]:
        raise SystemExit(f"the losses differ: {sync['losses']} vs {background['losses']}")
    sync_s, stall_s = statistics.mean(sync["sync"]), statistics.mean(background["stall"])
    command = command_line("bench_async_save.py", argv)
    headlines = [Headline(f"--async-save: training stall per save, {name} ZeRO-3 at DP={RANKS}",
                          "a synchronous save of the same state, same run", f"{stall_s / sync_s:.1%}", command)]
    body = ["| | synchronous | --async-save |", "|---|---|---|",
            f"| stall per save (s), saves at iterations {interval}, {2 * interval}, ... {iters} | "
            f"{', '.join(f'{s:.2f}' for s in sync['sync'])} | {', '.join(f'{s:.3f}' for s in background['stall'])} |",
            f"| save to published (s) | same | {', '.join(f'{s:.2f}' for s in background['background'])} |",
            f"| mean step time after the first (ms) | {sync['step_ms']:.0f} | {background['step_ms']:.0f} |",
            f"| losses | {len(sync['losses'])} logged | identical |", "",
            f"The stall is the training thread's time in the save: the plan, the agreement that iter_N.tmp exists, "
            f"and the fork (copy-on-write) or, on GPU, the copy to pinned memory. The background writers share the "
            f"machine's {os.cpu_count()} cores with the {RANKS} ranks here, which is what the longer steps and the time "
            "to publish show; the files and losses are those of the synchronous run."]
    publish(args, "bench_async_save", "Asynchronous checkpoint saves: training stall", command, headlines, body)
    print("\n".join(body))


if __name__ == "__main__":
    main(sys.argv[1:])
