#!/usr/bin/env python
"""Large worlds on one machine, by --fake-process-group: how long one rank takes to build its rank grid
(every process group of the layout, as ParallelState.build creates them) at worlds 8, 1,024 and 16,384,
and a whole dry run of pretrain_gpt.py as one rank of the 16,384-rank layout (a tiny model, so that the
figure is the grid, the schedule and the start-up, not the model).

Layouts: world 8 TP2 x PP2 x DP2; 1,024 TP8 x PP16 x DP8 (GPT-3 175B's published layout); 16,384 TP8 x
PP16 x CP4 x DP32 (Llama-3.1 405B's); and 16,384 with an MoE expert grid (TP8 x PP16 x DP128, EP8 x
ETP1), each in a fresh process on torch's fake backend (its groups need no peers).

    python bench/bench_fake_world.py          # writes bench/RESULTS.md
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name -> (world, rank, tp, cp, pp, ep, etp, experts)
LAYOUTS = {
    "8: TP2 x PP2 x DP2": (8, 5, 2, 1, 2, 1, None, False),
    "1,024: TP8 x PP16 x DP8": (1024, 517, 8, 1, 16, 1, None, False),
    "16,384: TP8 x PP16 x CP4 x DP32": (16384, 1234, 8, 4, 16, 1, None, False),
    "16,384 MoE: TP8 x PP16 x DP128, EP8 x ETP1": (16384, 1234, 8, 1, 16, 8, 1, True),
}
GRID = """
import json, sys, time
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from megalite.parallel.mesh import ParallelState
world, rank, tp, cp, pp, ep, etp, experts = json.loads(sys.argv[1])
dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
start = time.perf_counter()
state = ParallelState.build(world, rank, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, experts=experts)
print(json.dumps({"seconds": time.perf_counter() - start, "groups": len(state.groups)}))
"""
DRY_RUN = ["--num-layers", "16", "--hidden-size", "128", "--ffn-hidden-size", "256", "--num-attention-heads", "8",
           "--group-query-attention", "--num-query-groups", "8", "--seq-length", "64", "--max-position-embeddings",
           "64", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
           "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--micro-batch-size", "1",
           "--global-batch-size", "64", "--lr", "1e-3", "--train-iters", "2", "--mock-data", "--tokenizer-type",
           "NullTokenizer", "--vocab-size", "200", "--log-interval", "1", "--eval-iters", "0", "--attention-dropout",
           "0", "--hidden-dropout", "0", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
           "--context-parallel-size", "4", "--sequence-parallel", "--use-distributed-optimizer",
           "--fake-process-group", "--fake-world-size", "16384", "--fake-rank", "1234"]


def grid(layout: tuple) -> dict:
    out = subprocess.run([sys.executable, "-c", GRID, json.dumps(list(layout))], capture_output=True, text=True,
                         check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    return json.loads(out.stdout.strip().splitlines()[-1])


def dry_run() -> dict:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *DRY_RUN], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    rss = [float(x) for x in re.findall(r"max rss \(MB\):\s*([0-9.]+)", proc.stdout)]
    step = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\):\s*([0-9.]+)", proc.stdout)]
    return {"wall": wall, "peak_mb": max(rss), "step_ms": step[-1],
            "memory": re.search(r"^memory rank 1234: .*$", proc.stdout, re.M).group(0)}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    args = parser.parse_args(argv)
    command = command_line("bench_fake_world.py", argv)
    grids = {name: grid(layout) for name, layout in LAYOUTS.items()}
    run = dry_run()
    rows = [f"| {name} | {LAYOUTS[name][1]:,} | {g['groups']} | {g['seconds']:.3f} |" for name, g in grids.items()]
    largest = max(g["seconds"] for name, g in grids.items() if name.startswith("16,384"))
    headlines = [Headline("rank-grid construction at world 16,384 (fake backend), slowest layout",
                          "none (goal: at most 10 s)", f"{largest:.2f} s", command)]
    body = ["Seconds for one rank to create every process group of its layout (every rank creates every group, "
            "as torch requires; the rank keeps its own). Each layout in a fresh process.", "",
            "| world: layout | rank | groups this rank is in | seconds |", "|---|---|---|---|", *rows, "",
            f"Whole dry run, `pretrain_gpt.py --fake-process-group --fake-world-size 16384 --fake-rank 1234` "
            f"(TP8 x PP16 x CP4 x DP32, a 16-layer hidden-128 model, 2 iterations, 2 micro-batches each): "
            f"{run['wall']:.1f} s from start to exit, {run['step_ms']:.1f} ms per iteration, peak RSS "
            f"{run['peak_mb']:.0f} MB; its state: `{run['memory']}`."]
    publish(args, "bench_fake_world", "Thousands of ranks: grid construction and a dry run", command, headlines, body)


if __name__ == "__main__":
    main(sys.argv[1:])
