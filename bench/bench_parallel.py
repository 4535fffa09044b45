#!/usr/bin/env python
"""Parallel training speed on this machine's cores, measured side by side in one run.

Sections (each a function returning table rows; add one to SECTIONS to extend):
- dp: data parallelism. The same global batch on the same cores: DP=1 (one process using every core)
  vs DP=2 (two gloo ranks, one core's worth of threads each), without and with --overlap-grad-reduce,
  and the distributed optimizer (ZeRO-1) with both overlaps. Reported per layout: median ms per
  iteration, tokens/s, and the gradient-sync time left exposed after backward (the part of
  communication that overlap hides). Figures: DP=2 / DP=1 throughput, and the overlap gain
  (no-overlap ms / overlap ms).
- tp: tensor parallelism. TP=1 (one process using every core) vs TP=2 (two gloo ranks), with and
  without sequence parallelism, same global batch. Figure: TP=2 / TP=1 throughput.
- fsdp2: megalite's own ZeRO-3 against the PyTorch FSDP2 backend (--use-torch-fsdp2) at DP=2 and DP=4,
  same model, batch and cores. Figure: ZeRO-3 ms / FSDP2 ms per iteration.

    python bench/bench_parallel.py                    # every section, writes bench/RESULTS.md sections
    python bench/bench_parallel.py --sections dp --steps 4
    python bench/bench_parallel.py --quick            # smoke test: 2 layers, seq 128, one timed step each
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_flags import llama_argv  # noqa: E402
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@dataclass(frozen=True)
class Shape:
    layers: int = 4
    hidden: int = 512
    ffn: int = 1408
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 8192
    seq: int = 256
    mbs: int = 4
    gbs: int = 16

    @property
    def tokens(self) -> int:
        """Tokens per iteration (global batch)."""
        return self.gbs * self.seq

    def describe(self) -> str:
        return (f"Llama {self.layers} layers, hidden {self.hidden}, {self.heads} heads / {self.kv_heads} KV heads, "
                f"SwiGLU {self.ffn}, vocab {self.vocab}, seq {self.seq}")


FULL = Shape()
QUICK = replace(FULL, layers=2, seq=128, gbs=8)


def model_args(shape: Shape) -> list[str]:
    return llama_argv(shape, shape.mbs, shape.gbs)


# ---- running N gloo ranks -------------------------------------------------------------------------------
def _rank_main(rank, world, port, threads, out_dir, fn, args):
    import torch
    import torch.distributed as dist
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    result = fn(rank, world, *args)
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def spawn(world: int, threads: int, fn, *args) -> list:
    """fn(rank, world, *args) on ``world`` processes with ``threads`` intra-op threads each."""
    import socket
    import torch
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(world, port, threads, out_dir, fn, args), nprocs=world, join=True)
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world)]


# ---- data parallelism -------------------------------------------------------------------------------------
def _time_dp_steps(rank, world, shape, flags, steps, warmup):
    """Median wall time per training step and per gradient sync (the exposed part after backward)."""
    import torch
    from megalite.train.command_line import parse_args
    from megalite.train.trainer import build_trainer
    from megalite.train.step import train_step
    trainer = build_trainer(parse_args(model_args(shape) + flags, world_size=world))
    g = torch.Generator().manual_seed(rank)

    def batches():
        while True:
            x = torch.randint(0, shape.vocab, (shape.mbs, shape.seq + 1), generator=g)
            yield {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(shape.mbs, shape.seq),
                   "position_ids": torch.arange(shape.seq).expand(shape.mbs, shape.seq)}

    ddp, sync_times = trainer.ddp, []
    finish = ddp.finish_grad_sync

    def timed_finish():
        t = time.perf_counter()
        finish()
        sync_times.append(time.perf_counter() - t)

    ddp.finish_grad_sync = timed_finish
    data, step_times = batches(), []
    for i in range(warmup + steps):
        if world > 1:
            torch.distributed.barrier()
        t = time.perf_counter()
        train_step(trainer, data)
        step_times.append(time.perf_counter() - t)
    ddp.wait_for_param_gather()
    return {"step": step_times[warmup:], "sync": sync_times[warmup:],
            "params": trainer.buffer.numel_unpadded, "buckets": len(trainer.buffer.buckets)}


DP_LAYOUTS = [
    # name, processes, flags
    ("DP=1", 1, []),
    ("DP=2", 2, []),
    ("DP=2 overlap-grad-reduce, 1M-element buckets", 2, ["--overlap-grad-reduce", "--ddp-bucket-size", "1000000"]),
    ("DP=2 ZeRO-1 (distributed optimizer), no overlap", 2, ["--use-distributed-optimizer"]),
    ("DP=2 ZeRO-1 + overlap-grad-reduce + overlap-param-gather, 1M buckets", 2,
     ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "1000000"]),
]


def measure_layouts(layouts, args) -> tuple[dict, dict]:
    """Step and gradient-sync times per layout, on all cores split evenly over each layout's processes."""
    cores = os.cpu_count() or 1
    runs = {name: {"step": [], "sync": []} for name, _, _ in layouts}
    meta = {}
    for _ in range(args.rounds):                  # rounds interleave layouts so machine noise hits all alike
        for name, world, flags in layouts:
            results = spawn(world, max(1, cores // world), _time_dp_steps, args.shape, flags, args.steps,
                            args.warmup)
            # a step ends when the slowest rank ends: per step, the max over ranks
            runs[name]["step"] += [max(r["step"][i] for r in results) for i in range(args.steps)]
            runs[name]["sync"] += [max(r["sync"][i] for r in results) for i in range(args.steps)]
            meta[name] = results[0]
    return runs, meta


def bench_data_parallel(args) -> tuple[list[str], str, list[tuple[str, str, str]]]:
    cores, shape = os.cpu_count() or 1, args.shape
    runs, meta = measure_layouts(DP_LAYOUTS, args)

    def med(name):
        return statistics.median(runs[name]["step"])
    base = med("DP=1")
    rows = ["| layout | processes x threads | buckets | ms / iteration | tokens/s | vs DP=1 | exposed grad sync ms |",
            "|---|---|---|---|---|---|---|"]
    for name, world, _ in DP_LAYOUTS:
        ms = med(name) * 1000
        sync = statistics.median(runs[name]["sync"]) * 1000
        rows.append(f"| {name} | {world} x {max(1, cores // world)} | {meta[name]['buckets']} | {ms:.0f} | "
                    f"{shape.tokens / ms * 1000:.0f} | {base * 1000 / ms:.2f}x | {sync:.1f} |")
    names = [name for name, _, _ in DP_LAYOUTS]
    overlap = med(names[1]) / med(names[2])
    zero_overlap = med(names[3]) / med(names[4])
    params = meta["DP=1"]["params"]
    header = (f"{shape.describe()}; {params / 1e6:.1f}M parameters; global batch {shape.gbs} = micro-batches of "
              f"{shape.mbs}; fp32, gloo on localhost. Median of {args.rounds * args.steps} steps after "
              f"{args.warmup} warm-up (per step, the slowest rank). Overlap gain (no-overlap ms / overlap ms): "
              f"DDP {overlap:.2f}x, ZeRO-1 {zero_overlap:.2f}x. DP=2 / DP=1 throughput: {base / med(names[1]):.2f}x.")
    one_process = f"DP=1: one process on the same {cores} cores, same global batch"
    headlines = [("DP=2 throughput", one_process, f"{base / med(names[1]):.2f}x"),
                 ("DP=2 ZeRO-1 + overlapped grad reduce / param gather throughput", one_process,
                  f"{base / med(names[4]):.2f}x"),
                 ("--overlap-grad-reduce gain at DP=2", "DP=2 without overlap",
                  f"{overlap:.2f}x (no-overlap ms / overlap ms)")]
    return rows, header, headlines


TP_LAYOUTS = [
    ("TP=1", 1, []),
    ("TP=2", 2, ["--tensor-model-parallel-size", "2"]),
    ("TP=2 + sequence parallelism", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
]


def bench_tensor_parallel(args) -> tuple[list[str], str, list[tuple[str, str, str]]]:
    """The same model and global batch: one process on every core vs two TP ranks sharing them."""
    cores = os.cpu_count() or 1
    runs, _ = measure_layouts(TP_LAYOUTS, args)
    base = statistics.median(runs["TP=1"]["step"])
    rows = ["| layout | processes x threads | ms / iteration | tokens/s | vs TP=1 |", "|---|---|---|---|---|"]
    speed = {}
    for name, world, _ in TP_LAYOUTS:
        ms = statistics.median(runs[name]["step"]) * 1000
        speed[name] = base * 1000 / ms
        rows.append(f"| {name} | {world} x {max(1, cores // world)} | {ms:.0f} | {args.shape.tokens / ms * 1000:.0f} | "
                    f"{speed[name]:.2f}x |")
    header = (f"Same model and batch as the DP section; fp32, gloo on localhost. TP splits every matmul across "
              f"ranks and adds 2 all-reduces (or all-gather + reduce-scatter with SP) per layer in forward and "
              f"in backward; on one CPU socket it cannot beat one process using every core, so the figure is "
              f"the cost of the communication. Median of {args.rounds * args.steps} steps after {args.warmup} "
              f"warm-up.")
    one_process = f"TP=1: one process on the same {cores} cores, same global batch"
    headlines = [(f"{name} throughput", one_process, f"{speed[name]:.2f}x") for name, _, _ in TP_LAYOUTS[1:]]
    return rows, header, headlines


FSDP2_LAYOUTS = [(f"DP={d} {name}", d, flags)
                 for d in (2, 4)
                 for name, flags in (("megalite ZeRO-3", ["--data-parallel-sharding-strategy", "optim_grads_params",
                                                          "--ddp-bucket-size", "1000000"]),
                                     ("PyTorch FSDP2 (--use-torch-fsdp2)", ["--use-torch-fsdp2"]))]
FSDP2_OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]


def bench_fsdp2(args) -> tuple[list[str], str, list[tuple[str, str, str]]]:
    """megalite's own ZeRO-3 and the PyTorch FSDP2 backend, same model, batch and cores, at DP=2 and DP=4."""
    cores, shape = os.cpu_count() or 1, args.shape
    layouts = [(name, world, flags + FSDP2_OVERLAP) for name, world, flags in FSDP2_LAYOUTS]
    runs, _ = measure_layouts(layouts, args)
    ms = {name: statistics.median(runs[name]["step"]) * 1000 for name, _, _ in layouts}
    rows = ["| layout | processes x threads | ms / iteration | tokens/s | ZeRO-3 ms / FSDP2 ms |",
            "|---|---|---|---|---|"]
    headlines = []
    for name, world, _ in layouts:
        ratio = ""
        if "FSDP2" in name:
            ours = ms[name.replace("PyTorch FSDP2 (--use-torch-fsdp2)", "megalite ZeRO-3")]
            ratio = f"{ours / ms[name]:.2f}x"
            headlines.append((f"megalite ZeRO-3 step time, DP={world}", "PyTorch FSDP2 backend, same model",
                              f"{ours / ms[name]:.2f}x (ZeRO-3 ms / FSDP2 ms)"))
        rows.append(f"| {name} | {world} x {max(1, cores // world)} | {ms[name]:.0f} | "
                    f"{shape.tokens / ms[name] * 1000:.0f} | {ratio} |")
    header = (f"{shape.describe()}; fp32, gloo on localhost, global batch {shape.gbs} in micro-batches of "
              f"{shape.mbs}; both with --overlap-grad-reduce --overlap-param-gather (ZeRO-3 with 1M-element "
              f"buckets). Median of {args.rounds * args.steps} steps after {args.warmup} warm-up (per step, the "
              f"slowest rank), layouts interleaved over rounds.")
    return rows, header, headlines


SECTIONS = {"dp": ("bench_parallel_dp", "Data parallelism on the same cores", bench_data_parallel),
            "fsdp2": ("bench_parallel_fsdp2", "megalite ZeRO-3 against PyTorch FSDP2: step time", bench_fsdp2),
            "tp": ("bench_parallel_tp", "Tensor parallelism on the same cores", bench_tensor_parallel)}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {list(SECTIONS)}")
    p.add_argument("--steps", type=int, help="timed steps per layout and round (default 5; 1 with --quick)")
    p.add_argument("--warmup", type=int, help="warm-up steps per layout and round (default 2; 1 with --quick)")
    p.add_argument("--rounds", type=int, help="rounds over the layouts (default 2; 1 with --quick)")
    p.add_argument("--no-write", action="store_true", help="print only; leave the results file alone")
    add_common_args(p)
    args = p.parse_args(argv)
    args.shape = QUICK if args.quick else FULL
    args.steps = args.steps or (1 if args.quick else 5)
    args.warmup = args.warmup or (1 if args.quick else 2)
    args.rounds = args.rounds or (1 if args.quick else 2)
    command = command_line("bench_parallel.py", argv)
    for name in args.sections.split(","):
        key, title, fn = SECTIONS[name]
        rows, header, figures = fn(args)
        print(f"## {title}\n{header}\n" + "\n".join(rows), flush=True)
        publish(args, key, title, command, [Headline(*f, command) for f in figures], [header, "", *rows])


if __name__ == "__main__":
    main(sys.argv[1:])
