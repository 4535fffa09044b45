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

    python bench/bench_parallel.py                    # every section, writes bench/RESULTS.md sections
    python bench/bench_parallel.py --sections dp --steps 4
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import replace_section  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, SEQ, MBS, GBS = 4, 512, 1408, 8, 2, 8192, 256, 4, 16

MODEL_ARGS = [
    "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--ffn-hidden-size", str(FFN),
    "--num-attention-heads", str(HEADS), "--group-query-attention", "--num-query-groups", str(KV_HEADS),
    "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--position-embedding-type", "rope",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--micro-batch-size", str(MBS),
    "--global-batch-size", str(GBS), "--lr", "1e-4", "--weight-decay", "0.1", "--clip-grad", "1.0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1), "--train-iters", "1000",
    "--eval-iters", "0"]


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
def _time_dp_steps(rank, world, flags, steps, warmup):
    """Median wall time per training step and per gradient sync (the exposed part after backward)."""
    import torch
    from megalite.arguments import parse_args
    from megalite.training import build_trainer, train_step
    trainer = build_trainer(parse_args(MODEL_ARGS + flags, world_size=world))
    g = torch.Generator().manual_seed(rank)

    def batches():
        while True:
            x = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
            yield {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(MBS, SEQ),
                   "position_ids": torch.arange(SEQ).expand(MBS, SEQ)}

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
            results = spawn(world, max(1, cores // world), _time_dp_steps, flags, args.steps, args.warmup)
            # a step ends when the slowest rank ends: per step, the max over ranks
            runs[name]["step"] += [max(r["step"][i] for r in results) for i in range(args.steps)]
            runs[name]["sync"] += [max(r["sync"][i] for r in results) for i in range(args.steps)]
            meta[name] = results[0]
    return runs, meta


def bench_data_parallel(args) -> tuple[list[str], str]:
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()[0]
    runs, meta = measure_layouts(DP_LAYOUTS, args)
    base = statistics.median(runs["DP=1"]["step"])
    tokens = GBS * SEQ
    rows = ["| layout | processes x threads | buckets | ms / iteration | tokens/s | vs DP=1 | exposed grad sync ms |",
            "|---|---|---|---|---|---|---|"]
    for name, world, _ in DP_LAYOUTS:
        ms = statistics.median(runs[name]["step"]) * 1000
        sync = statistics.median(runs[name]["sync"]) * 1000
        rows.append(f"| {name} | {world} x {max(1, cores // world)} | {meta[name]['buckets']} | {ms:.0f} | "
                    f"{tokens / ms * 1000:.0f} | {base * 1000 / ms:.2f}x | {sync:.1f} |")

    def med(n):
        return statistics.median(runs[n]["step"])
    overlap = med(DP_LAYOUTS[1][0]) / med(DP_LAYOUTS[2][0])
    zero_overlap = med(DP_LAYOUTS[3][0]) / med(DP_LAYOUTS[4][0])
    params = meta["DP=1"]["params"]
    header = (f"Llama {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads / {KV_HEADS} KV heads, SwiGLU {FFN}, vocab "
              f"{VOCAB}, seq {SEQ}; {params / 1e6:.1f}M parameters; global batch {GBS} = micro-batches of {MBS}; "
              f"fp32, gloo on localhost. Median of {args.rounds * args.steps} steps after {args.warmup} warm-up "
              f"(per step, the slowest rank). Overlap gain (no-overlap ms / overlap ms): DDP {overlap:.2f}x, "
              f"ZeRO-1 {zero_overlap:.2f}x. DP=2 / DP=1 throughput: {base / med(DP_LAYOUTS[1][0]):.2f}x. "
              f"Load average before/after: {load_before:.1f}/{os.getloadavg()[0]:.1f} (other work on the "
              f"machine makes every figure noisy).")
    return rows, header


TP_LAYOUTS = [
    ("TP=1", 1, []),
    ("TP=2", 2, ["--tensor-model-parallel-size", "2"]),
    ("TP=2 + sequence parallelism", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
]


def bench_tensor_parallel(args) -> tuple[list[str], str]:
    """The same model and global batch: one process on every core vs two TP ranks sharing them."""
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()[0]
    runs, _ = measure_layouts(TP_LAYOUTS, args)
    base = statistics.median(runs["TP=1"]["step"])
    rows = ["| layout | processes x threads | ms / iteration | tokens/s | vs TP=1 |", "|---|---|---|---|---|"]
    for name, world, _ in TP_LAYOUTS:
        ms = statistics.median(runs[name]["step"]) * 1000
        rows.append(f"| {name} | {world} x {max(1, cores // world)} | {ms:.0f} | {GBS * SEQ / ms * 1000:.0f} | "
                    f"{base * 1000 / ms:.2f}x |")
    header = (f"Same model and batch as the DP section; fp32, gloo on localhost. TP splits every matmul across "
              f"ranks and adds 2 all-reduces (or all-gather + reduce-scatter with SP) per layer in forward and "
              f"in backward; on one CPU socket it cannot beat one process using every core, so the figure is "
              f"the cost of the communication. Median of {args.rounds * args.steps} steps after {args.warmup} "
              f"warm-up. Load average before/after: {load_before:.1f}/{os.getloadavg()[0]:.1f}.")
    return rows, header


SECTIONS = {"dp": ("bench_parallel_dp", "Data parallelism on the same cores", bench_data_parallel),
            "tp": ("bench_parallel_tp", "Tensor parallelism on the same cores", bench_tensor_parallel)}


def write_section(key: str, title: str, header: str, rows: list[str], command: str) -> None:
    machine = f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.system()}; {time.strftime('%Y-%m-%d')}."
    replace_section(key, [f"## {title}", f"{machine} Command: `{command}`.", header, "", *rows])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {list(SECTIONS)}")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = p.parse_args(argv)
    command = "python bench/bench_parallel.py" + (f" {' '.join(argv)}" if argv else "")
    for name in args.sections.split(","):
        key, title, fn = SECTIONS[name]
        rows, header = fn(args)
        print(f"## {title}\n{header}\n" + "\n".join(rows))
        if not args.no_write:
            write_section(key, title, header, rows, command)


if __name__ == "__main__":
    main(sys.argv[1:])
