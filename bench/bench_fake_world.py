#!/usr/bin/env python
"""Large worlds on one machine, by --fake-process-group: how long one rank takes to build its rank grid
(every process group of the layout, as ParallelState.build creates them) at worlds 8, 1,024 and 16,384,
and a whole dry run of pretrain_gpt.py as one rank of the 16,384-rank layout (a tiny model, so that the
figure is the grid, the schedule and the start-up, not the model).

Layouts: world 8 TP2 x PP2 x DP2; 1,024 TP8 x PP16 x DP8 (GPT-3 175B's published layout); 16,384 TP8 x
PP16 x CP4 x DP32 (Llama-3.1 405B's); and 16,384 with an MoE expert grid (TP8 x PP16 x DP128, EP8 x
ETP1), each in a fresh process on torch's fake backend (its groups need no peers).

The checkpoint index: the bytes one rank sends on save for the tensor index (its own pieces' entries,
to their holders; checkpoint/index.py), and what the busiest holder then holds, at worlds 8, 1,024 and
16,384 (the dense layouts, the dry run's model, distributed optimizer). What a rank sends is exact
(sharded.index_payloads on the played rank, CRCs and sizes at their widest); what a holder holds is
the sum over the writers of its keys, estimated from the played rank's entries times the number of
ranks that write the same tensor alike (TP x data-parallel shards), and measured exactly at world 8 by
playing all 8 ranks. Before, every rank received and held the whole index: the world's entries.

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


INDEX = """
import json, sys
from megalite.checkpoint.pieces import param_entries
from megalite.checkpoint.sharded import index_payloads
from megalite.config.megatron_cli import parse_args
from megalite.parallel.param_meta import param_meta
from megalite.train.trainer import build_trainer
trainer = build_trainer(parse_args(json.loads(sys.argv[1])))
p = trainer.parallel
payloads = index_payloads(trainer)
tp_sharded = {e.global_name: param_meta(e.param).tensor_model_parallel for e in param_entries(trainer.chunks)}
shards = p.dp_size * p.cp_size if trainer.optimizer.grads_sharded else 1
keys = {}
for holder, part in enumerate(payloads):
    for key, entry in (json.loads(part)["tensors"].items() if part else ()):
        name = entry["name"].split(".", 2)[-1] if entry["name"].startswith("optimizer.") else entry["name"]
        writers = shards * (p.tp_size if tp_sharded[name] else 1)
        keys[key] = [holder, len(json.dumps(entry, separators=(",", ":"))), writers]
print(json.dumps({"sent": sum(len(x) for r, x in enumerate(payloads) if r != p.rank), "keys": keys,
                  "parts": [len(x) for x in payloads], "pp": p.pp_size}))
"""
INDEX_MODEL = DRY_RUN[:DRY_RUN.index("--tensor-model-parallel-size")] + ["--use-distributed-optimizer"]
# world -> (layout flags, the rank played)
INDEX_LAYOUTS = {
    8: (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 5),
    1024: (["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16", "--sequence-parallel"], 517),
    16384: (["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16", "--context-parallel-size",
             "4", "--sequence-parallel"], 1234),
}


def index_probe(world: int, rank: int) -> dict:
    flags, _ = INDEX_LAYOUTS[world]
    argv = INDEX_MODEL + flags + ["--fake-process-group", "--fake-world-size", str(world), "--fake-rank", str(rank)]
    out = subprocess.run([sys.executable, "-c", INDEX, json.dumps(argv)], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def index_bytes(world: int) -> dict:
    """sent: the played rank's index bytes to other ranks; held: the busiest holder's (estimate; exact at
    world 8, all ranks played); before: the whole index, which every rank received and held."""
    probe = index_probe(world, INDEX_LAYOUTS[world][1])
    per_holder: dict[int, int] = {}
    for holder, size, writers in probe["keys"].values():
        per_holder[holder] = per_holder.get(holder, 0) + size * writers
    stage_total = sum(size * writers for _, size, writers in probe["keys"].values())
    out = {"sent": probe["sent"], "held": max(per_holder.values()), "before": stage_total * probe["pp"]}
    if world == 8:
        parts = [index_probe(world, r)["parts"] for r in range(world)]
        received = [sum(parts[s][r] for s in range(world)) for r in range(world)]
        out.update(held_exact=max(received), before=sum(received), sent_max=max(sum(p) for p in parts))
    return out


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


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    args = parser.parse_args(argv)
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
            f"{run['peak_mb']:.0f} MB; its state: `{run['memory']}`."]
    exact = index[8]
    body += ["", "Checkpoint index, bytes per rank (the dry run's model with --use-distributed-optimizer; the "
             "played rank in brackets; held: the busiest index holder; before: the whole index, which every rank "
             "received and held):", "", "| world: layout (rank) | sent on save | held by the busiest holder | "
             "before: received and held by every rank |", "|---|---|---|---|",
             *[f"| {w:,}: {' x '.join(_layout_name(w))} ({INDEX_LAYOUTS[w][1]:,}) | {v['sent']:,} | "
               f"{v.get('held_exact', v['held']):,}{'' if w == 8 else ' (estimate)'} | {v['before']:,}"
               f"{'' if w == 8 else ' (estimate)'} |" for w, v in index.items()], "",
             f"At world 8 every rank was played: the most any rank sent was {exact['sent_max']:,} bytes; the "
             f"per-key estimate of the busiest holder there was {exact['held']:,} bytes (measured "
             f"{exact['held_exact']:,})."]
    headlines.append(Headline("checkpoint index bytes one rank sends on save at world 16,384 (fake backend)",
                              "the whole index to every rank (all_gather_object)", f"{index[16384]['sent']:,} B",
                              command))
    publish(args, "bench_fake_world", "Thousands of ranks: grid construction and a dry run", command, headlines, body)


if __name__ == "__main__":
    main(sys.argv[1:])
