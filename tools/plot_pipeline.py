#!/usr/bin/env python
"""Record a pipeline schedule as it runs and draw it as a timeline: one row per rank.

Runs one training step of a small Llama-style model through megalite's real schedule executor on
--pp gloo ranks (each holding its stages), records every forward/backward with start and end times,
and writes a PNG. It also prints the measured bubble share (idle time / wall time of the step,
averaged over ranks) next to theory (REFERENCE §6): (p-1)/(m+p-1) for GPipe and 1F1B,
(p-1)/(v*m+p-1) interleaved.

    python tools/plot_pipeline.py --pp 2 --microbatches 8 --output runs/pipeline_1f1b.png
    python tools/plot_pipeline.py --pp 2 --vpp 2 --microbatches 8 --output runs/pipeline_interleaved.png

Ranks share this machine's cores: keep --pp at or below the core count for honest timings.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def theoretical_bubble_share(pp: int, microbatches: int, vpp: int = 1) -> float:
    return (pp - 1) / (vpp * microbatches + pp - 1)


def measured_bubble_share(records: list) -> float:
    """Mean over ranks of 1 - busy/span, span being the step's wall time across all ranks."""
    start = min(e[3] for r in records for e in r.events)
    end = max(e[4] for r in records for e in r.events)
    busy = [sum(e[4] - e[3] for e in r.events) for r in records]
    return sum(1.0 - b / (end - start) for b in busy) / len(records)


def _rank_main(rank: int, world: int, port: int, out_dir: str, opts: dict) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(run_one_step(rank, world, opts), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_one_step(rank: int, world: int, opts: dict):
    """One forward/backward step through the schedule; returns this rank's PipelineRecord."""
    import torch
    import torch.distributed
    from megalite.arguments import parse_args
    from megalite.distributed.grad_buffer import ParamAndGradBuffer
    from megalite.parallel_state import ParallelState
    from megalite.pipeline_parallel.p2p import PipelineComm
    from megalite.pipeline_parallel.schedules import (PipelineRecord, gpipe_order, interleaved_order,
                                                      one_f_one_b_order, run_pipeline_schedule)
    from megalite.pipeline_parallel.stages import build_model_chunks, chunk_forward
    from megalite.tensor_parallel.setup import build_tensor_parallel
    pp, vpp, m = opts["pp"], opts["vpp"], opts["microbatches"]
    layers = opts["layers_per_stage"] * pp * vpp
    argv = ["--num-layers", str(layers), "--hidden-size", str(opts["hidden"]), "--num-attention-heads", "4",
            "--seq-length", str(opts["seq"]), "--position-embedding-type", "rope", "--normalization", "RMSNorm",
            "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--attention-dropout", "0", "--hidden-dropout", "0", "--micro-batch-size", str(opts["mbs"]),
            "--lr", "1e-4", "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "1000"]
    cfg = parse_args(argv, world_size=1).model
    state = ParallelState.build(world, rank, pp=pp)
    device = torch.device("cpu")
    tp = build_tensor_parallel(state, False, 1, device, cfg.num_query_groups)
    chunks = build_model_chunks(cfg, 1, tp, state.pp_rank, pp, vpp)
    ParamAndGradBuffer([(f"{i}.{n}", p) for i, c in enumerate(chunks) for n, p in c.named_parameters()])
    comm = PipelineComm(state.group("pp"), state.pp_rank, pp, (opts["seq"], opts["mbs"], opts["hidden"]),
                        torch.float32, device)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(m):
        x = torch.randint(0, 1000, (opts["mbs"], opts["seq"] + 1), generator=g)
        batches.append({"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(opts["mbs"], opts["seq"]),
                        "position_ids": torch.arange(opts["seq"]).expand(opts["mbs"], opts["seq"])})
    if vpp > 1:
        order = interleaved_order(pp, state.pp_rank, m, vpp)
    else:
        order = (gpipe_order if opts["schedule"] == "gpipe" else one_f_one_b_order)(pp, state.pp_rank, m)
    forward = chunk_forward(chunks, device)
    run_pipeline_schedule(order, forward, batches, comm, vpp)                     # warm-up step
    torch.distributed.barrier()
    record = PipelineRecord(rank)
    run_pipeline_schedule(order, forward, batches, comm, vpp, record=record)
    return record


def record_schedule(pp: int, microbatches: int, vpp: int = 1, schedule: str = "1f1b", layers_per_stage: int = 2,
                    hidden: int = 128, seq: int = 128, mbs: int = 2) -> list:
    """Run the step on ``pp`` spawned ranks and return their PipelineRecords."""
    import torch
    import torch.multiprocessing as mp
    opts = dict(pp=pp, vpp=vpp, microbatches=microbatches, schedule=schedule, layers_per_stage=layers_per_stage,
                hidden=hidden, seq=seq, mbs=mbs)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(pp, port, out_dir, opts), nprocs=pp, join=True)
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(pp)]


def draw(records: list, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    start = min(e[3] for r in records for e in r.events)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(records) + 1.2))
    colours = {"F": "#4c72b0", "B": "#dd8452"}
    for r in records:
        for kind, chunk, mb, t0, t1 in r.events:
            ax.barh(r.rank, (t1 - t0) * 1000, left=(t0 - start) * 1000, color=colours[kind],
                    alpha=1.0 if chunk == 0 else 0.6, edgecolor="black", linewidth=0.4)
            ax.text((t0 - start + (t1 - t0) / 2) * 1000, r.rank, f"{mb}" if chunk == 0 else f"{mb}'",
                    ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks([r.rank for r in records], [f"rank {r.rank}" for r in records])
    ax.invert_yaxis()
    ax.set_xlabel("ms (blue: forward, orange: backward; ' = second model chunk)")
    ax.set_title(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per rank (interleaved when > 1)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--output", default="runs/pipeline_timeline.png")
    args = parser.parse_args()
    if args.vpp > 1 and args.microbatches % args.pp:
        parser.error("--microbatches must be a multiple of --pp for the interleaved schedule")
    records = record_schedule(args.pp, args.microbatches, args.vpp, args.schedule)
    name = "interleaved 1F1B" if args.vpp > 1 else args.schedule.upper()
    measured = measured_bubble_share(records)
    theory = theoretical_bubble_share(args.pp, args.microbatches, args.vpp)
    draw(records, args.output, f"{name}: pp={args.pp}, vpp={args.vpp}, m={args.microbatches}; "
                               f"bubble {100 * measured:.0f}% (theory {100 * theory:.0f}%)")
    print(f"{name} pp={args.pp} vpp={args.vpp} m={args.microbatches}: measured bubble share {100 * measured:.1f}% "
          f"| theory {100 * theory:.1f}% | timeline {args.output}")


if __name__ == "__main__":
    main()
