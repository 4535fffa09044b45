#!/usr/bin/env python
"""Large worlds on one machine, by --fake-process-group: how long one rank takes to build its rank grid
(every process group of the layout, as ParallelState.build creates them) at worlds 8, 1,024 and 16,384,
and a whole dry run of pretrain_gpt.py as one rank of the 16,384-rank layout (a tiny model, so that the
figure is the grid, the schedule and the start-up, not the model).

Layouts: world 8 TP2 x PP2 x DP2; 1,024 TP8 x PP16 x DP8 (GPT-3 175B's published layout); 16,384 TP8 x
PP16 x CP4 x DP32 (Llama-3.1 405B's); and 16,384 with an MoE expert grid (TP8 x PP16 x DP128, EP8 x
ETP1), each in a fresh process on torch's fake backend (its groups need no peers).

The checkpoint index: the bytes ranks send on save for the tensor index (their own pieces' entries, to
their holders; checkpoint/index.py), and what the busiest holder then holds, at worlds 8, 1,024 and
16,384 (the dense layouts, the dry run's model, distributed optimizer), measured over every rank: one
trainer is built per TP x PP coordinate (in one process, on the fake backend), and what each
data-parallel x CP rank of that coordinate sends is computed from the bucket chunks it owns
(sharded.index_payloads with data_rank; CRCs and sizes at their widest). Each holder's bytes are the sum
of what every rank sends it.

    python bench/bench_fake_world.py                # writes bench/RESULTS.md
    python bench/bench_fake_world.py --index-only   # prints the checkpoint index table only
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


INDEX = """
import json, sys
import torch.distributed as dist
from megalite.checkpoint.sharded import index_payloads
from megalite.train.command_line import parse_args
from megalite.train.trainer import build_trainer
argv, world, played, tp, pp = json.loads(sys.argv[1])
held, sent = {}, {}
for coordinate in range(tp * pp):                    # every TP x PP coordinate, at data-parallel x CP rank 0
    t, stage = coordinate % tp, coordinate // tp
    rank = t + tp * (world // (tp * pp)) * stage
    trainer = build_trainer(parse_args(argv + ["--fake-world-size", str(world), "--fake-rank", str(rank)]))
    p = trainer.parallel
    for data_rank in range(p.dp_size * p.cp_size):
        me = p.tp_rank + p.tp_size * (data_rank + p.cp_size * p.dp_size * p.pp_rank)
        payloads = index_payloads(trainer.checkpoint_state, data_rank)
        for holder, payload in payloads.items():
            held[holder] = held.get(holder, 0) + len(payload)
        sent[me] = sum(len(x) for holder, x in payloads.items() if holder != me)
    dist.destroy_process_group()
print(json.dumps({"held": max(held.values()), "held_mean": sum(held.values()) / world, "sent": sent[played],
                  "sent_max": max(sent.values()), "ranks": len(sent), "total": sum(held.values())}))
"""
INDEX_MODEL = DRY_RUN[:DRY_RUN.index("--tensor-model-parallel-size")] + ["--use-distributed-optimizer"]
# world -> (layout flags, the rank played)
INDEX_LAYOUTS = {
    8: (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 5),
    1024: (["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16", "--sequence-parallel"], 517),
    16384: (["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16", "--context-parallel-size",
             "4", "--sequence-parallel"], 1234),
}


def index_bytes(world: int) -> dict:
    """Every rank's index payloads at ``world``: the played rank's and the most any rank sends to other
    ranks, the busiest holder's and the mean holder's bytes, and the whole index (what every rank
    received and held when rank 0 gathered it)."""
    flags, rank = INDEX_LAYOUTS[world]
    sizes = dict(zip(flags[::2], flags[1::2]))          # the bare switch (--sequence-parallel) comes last
    tp, pp = int(sizes["--tensor-model-parallel-size"]), int(sizes["--pipeline-model-parallel-size"])
    argv = INDEX_MODEL + flags + ["--fake-process-group"]
    out = subprocess.run([sys.executable, "-c", INDEX, json.dumps([argv, world, rank, tp, pp])], capture_output=True,
                         text=True, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ranks"] == world, result
    return result


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


def _layout_name(world: int) -> list[str]:
    flags = dict(zip(INDEX_LAYOUTS[world][0][::2], INDEX_LAYOUTS[world][0][1::2]))
    sizes = {"TP": flags.get("--tensor-model-parallel-size", "1"), "PP": flags.get("--pipeline-model-parallel-size"),
             "CP": flags.get("--context-parallel-size", "1")}
    dp = world // (int(sizes["TP"]) * int(sizes["PP"]) * int(sizes["CP"]))
    return [f"{k}{v}" for k, v in sizes.items() if v != "1"] + [f"DP{dp}"]


def index_table(index: dict) -> list[str]:
    return ["Checkpoint index, bytes per rank (the dry run's model with --use-distributed-optimizer; every rank "
            "of each world measured, the played rank in brackets; held: what a holder receives and writes as its "
            "index file; whole index: what every rank received and held when rank 0 gathered it):", "",
            "| world: layout (rank) | sent on save | most any rank sends | held by the busiest holder | "
            "mean holder | whole index |", "|---|---|---|---|---|---|",
            *[f"| {w:,}: {' x '.join(_layout_name(w))} ({INDEX_LAYOUTS[w][1]:,}) | {v['sent']:,} | "
              f"{v['sent_max']:,} | {v['held']:,} | {v['held_mean']:,.0f} | {v['total']:,} |"
              for w, v in index.items()]]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--index-only", action="store_true", help="print the checkpoint index table; write nothing")
    args = parser.parse_args(argv)
    if args.index_only:
        print("\n".join(index_table({world: index_bytes(world) for world in INDEX_LAYOUTS})))
        return
    command = command_line("bench_fake_world.py", argv)
    grids = {name: grid(layout) for name, layout in LAYOUTS.items()}
    run = dry_run()
    index = {world: index_bytes(world) for world in INDEX_LAYOUTS}
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
            f"{run['peak_mb']:.0f} MB; its state: `{run['memory']}`.", "", *index_table(index)]
    headlines.append(Headline("checkpoint index bytes one rank sends on save at world 16,384 (fake backend)",
                              "the whole index to every rank (all_gather_object)", f"{index[16384]['sent']:,} B",
                              command))
    headlines.append(Headline("checkpoint index bytes the busiest holder holds at world 16,384 (fake backend)",
                              "the whole index on every rank", f"{index[16384]['held']:,} B", command))
    publish(args, "bench_fake_world", "Thousands of ranks: grid construction and a dry run", command, headlines, body)


if __name__ == "__main__":
    main(sys.argv[1:])
