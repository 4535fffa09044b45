#!/usr/bin/env python
"""Record a pipeline schedule as it runs and draw it as a timeline: one row per rank.

Runs one training step of a small Llama-style model through megalite's real schedule executor on
--pp gloo ranks (each holding its stages), records every forward/backward with start and end times,
and writes a PNG. It also prints the measured bubble share (idle time / wall time of the step,
averaged over ranks) next to theory (Narayanan et al. 2021): (p-1)/(m+p-1) for GPipe and 1F1B,
(p-1)/(v*m+p-1) interleaved, (p-1)/(3m+p-1) for ZB-H1 (Qi et al. 2024, equal F/B/W times); ZB-V's is
about zero under the same assumption (its warm-up only). The asynchronous schedules (pipedream,
pipedream-2bw) never flush: their step is drawn in the steady state (after a first step has filled the
pipeline, before a last one drains it), where theory has no bubble; micro-batches are numbered from the step's first.
With --steps N it records N steps and draws the one whose bubble is the median.

    python tools/plot_pipeline.py --pp 2 --microbatches 8 --output runs/pipeline_1f1b.png
    python tools/plot_pipeline.py --pp 2 --vpp 2 --microbatches 8 --output runs/pipeline_interleaved.png
    python tools/plot_pipeline.py --schedule zb-h1 --output runs/pipeline_zb_h1.png
    python tools/plot_pipeline.py --schedule zbv --output runs/pipeline_zbv.png      # two chunks per rank
    python tools/plot_pipeline.py --schedule pipedream --output runs/pipeline_pipedream.png
    python tools/plot_pipeline.py --schedule pipedream-2bw --output runs/pipeline_pipedream_2bw.png

Ranks share this machine's cores: keep --pp at or below the core count for honest timings.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megalite.config.cli import OneLineArgumentParser, one_line_errors, positive_int  # noqa: E402
from megalite.config.schema import ASYNC_SCHEDULES, PIPELINE_SCHEDULES  # noqa: E402
from megalite.errors import UserError  # noqa: E402
from megalite.parallel.pipeline.pipedream import AsyncPipeline  # noqa: E402
from megalite.parallel.pipeline.executor import PipelineRecord  # noqa: E402
from megalite.parallel.pipeline.simulate import replay_schedule  # noqa: E402

ASYNC_STEPS = 2                 # the asynchronous schedules' run: fill the pipeline, then the recorded steps, drain


def theoretical_bubble_share(pp: int, microbatches: int, vpp: int = 1, schedule: str = "1f1b") -> float:
    if schedule in ASYNC_SCHEDULES:          # no flush: the steady state keeps every stage busy
        return 0.0
    if schedule == "zb-h1":
        return (pp - 1) / (3 * microbatches + pp - 1)
    if schedule == "zbv":
        return 0.0
    return (pp - 1) / (vpp * microbatches + pp - 1)


def measured_bubble_share(records: list) -> float:
    """Mean over ranks of 1 - busy/span, span being the step's wall time across all ranks."""
    start = min(e[3] for r in records for e in r.events)
    end = max(e[4] for r in records for e in r.events)
    busy = [sum(e[4] - e[3] for e in r.events) for r in records]
    return sum(1.0 - b / (end - start) for b in busy) / len(records)


def replayed_bubble_share(records: list, schedule: str, vpp: int = 1) -> float | None:
    """The bubble of the schedule's own orders when each action takes its rank's median measured time for
    its kind and chunk, with no transfer time and no spread (megalite/parallel/pipeline/simulate.py): what
    the order can do on this model's real, unequal stages. None for the asynchronous schedules (no order
    to replay: they never flush)."""
    if schedule in ASYNC_SCHEDULES:
        return None
    durations: dict = {}
    for r in records:
        for kind, chunk, _, start, end in r.events:
            durations.setdefault((r.rank, kind, chunk), []).append(end - start)
    cost = {key: statistics.median(times) for key, times in durations.items()}
    microbatches = 1 + max(e[2] for e in records[0].events)
    return replay_schedule(schedule, len(records), microbatches, vpp,
                           lambda rank, action: cost[(rank, action.kind, action.chunk)]).bubble


def forward_spread(records: list) -> float:
    """The spread of identical work on this machine, measured in the same step: the coefficient of
    variation (stdev / mean) of the forward times of each rank's chunk, averaged over them."""
    times: dict = {}
    for r in records:
        for kind, chunk, _, start, end in r.events:
            if kind == "F":
                times.setdefault((r.rank, chunk), []).append(end - start)
    spreads = [statistics.pstdev(t) / statistics.mean(t) for t in times.values() if len(t) > 1]
    return statistics.mean(spreads) if spreads else 0.0


def median_step(steps: list[list]) -> list:
    """Of several recorded steps (each a list of per-rank records), the one whose bubble is the median: one
    step on shared cores can be slowed by anything else running, so a single step is a noisy figure."""
    ranked = sorted(steps, key=measured_bubble_share)
    return ranked[len(ranked) // 2]


def _rank_main(rank: int, world: int, port: int, out_dir: str, opts: dict) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(run_steps(rank, world, opts), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_steps(rank: int, world: int, opts: dict) -> list:
    """opts["steps"] forward/backward steps through the schedule after one warm-up step; returns this
    rank's PipelineRecord of each."""
    import torch
    import torch.distributed
    from megalite.train.command_line import parse_args
    from megalite.parallel.data.grad_buffer import ParamAndGradBuffer
    from megalite.parallel.mesh import ParallelState
    from megalite.parallel.pipeline.executor import PipelineRecord, run_pipeline_schedule
    from megalite.parallel.pipeline.p2p import PipelineComm
    from megalite.parallel.pipeline.plan import rank_plan
    from megalite.parallel.pipeline.orders import stage_placement
    from megalite.model.chunks import build_model_chunks
    from megalite.parallel.pipeline.stages import chunk_forward
    from megalite.parallel.tensor.setup import build_tensor_parallel
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
    placement = stage_placement(opts["schedule"])
    chunks = build_model_chunks(cfg, 1, tp, state.pp_rank, pp, vpp, placement=placement)
    buffer = ParamAndGradBuffer([(f"{i}.{n}", p) for i, c in enumerate(chunks) for n, p in c.named_parameters()])
    comm = PipelineComm(state.group("pp"), state.pp_rank, pp, (opts["seq"], opts["mbs"], opts["hidden"]),
                        torch.float32, device)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(m):
        x = torch.randint(0, 1000, (opts["mbs"], opts["seq"] + 1), generator=g)
        batches.append({"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(opts["mbs"], opts["seq"]),
                        "position_ids": torch.arange(opts["seq"]).expand(opts["mbs"], opts["seq"])})
    forward = chunk_forward(chunks, device)
    if opts["schedule"] in ASYNC_SCHEDULES:
        return run_async_steps(opts["schedule"], buffer, comm, state, m, batches, forward, opts["steps"])
    plan = rank_plan(opts["schedule"], pp, state.pp_rank, m, vpp)
    run_pipeline_schedule(plan, forward, batches, comm)      # warm-up step
    records = []
    for _ in range(opts["steps"]):
        torch.distributed.barrier()
        records.append(PipelineRecord(rank))
        run_pipeline_schedule(plan, forward, batches, comm, record=records[-1])
    return records


def run_async_steps(schedule: str, buffer, comm, state, m: int, batches: list, forward, steps: int) -> list:
    """ASYNC_STEPS + ``steps`` training steps (plain SGD on the flat buffer) under pipedream / pipedream-2bw;
    returns the PipelineRecords of the ``steps`` after the first, which are in the steady state (the last
    one drains the pipeline and is not recorded)."""
    import torch
    import torch.distributed
    total = ASYNC_STEPS + steps
    runner = AsyncPipeline(schedule, buffer.param_data, comm, state.pp_size, state.pp_rank, m, total, forward)
    records = [PipelineRecord(state.pp_rank) for _ in range(steps)]
    for step in range(total):
        torch.distributed.barrier()
        runner.record = records[step - 1] if 1 <= step <= steps else None
        runner.forward_backward(step, lambda: batches)
        runner.optimizer_step(step, lambda: sgd(buffer))
        buffer.zero_grad()
    return records


def sgd(buffer) -> None:
    """Plain SGD on the flat buffer: the update between the asynchronous schedules' steps."""
    import torch
    with torch.no_grad():
        buffer.param_data.add_(buffer.grad_data, alpha=-1e-4)


def record_schedule(pp: int, microbatches: int, vpp: int = 1, schedule: str = "1f1b", layers_per_stage: int = 2,
                    hidden: int = 128, seq: int = 128, mbs: int = 2, steps: int = 1) -> list:
    """Run ``steps`` steps on ``pp`` spawned ranks; returns the ranks' PipelineRecords of the median step
    (by bubble share)."""
    import torch
    import torch.multiprocessing as mp
    opts = dict(pp=pp, vpp=vpp, microbatches=microbatches, schedule=schedule, layers_per_stage=layers_per_stage,
                hidden=hidden, seq=seq, mbs=mbs, steps=steps)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(pp, port, out_dir, opts), nprocs=pp, join=True)
        per_rank = [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(pp)]
    return median_step([list(step) for step in zip(*per_rank)])


def draw(records: list, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    start = min(e[3] for r in records for e in r.events)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(records) + 1.2))
    colours = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
    for r in records:
        for kind, chunk, mb, t0, t1 in r.events:
            ax.barh(r.rank, (t1 - t0) * 1000, left=(t0 - start) * 1000, color=colours[kind],
                    alpha=1.0 if chunk == 0 else 0.6, edgecolor="black", linewidth=0.4)
            ax.text((t0 - start + (t1 - t0) / 2) * 1000, r.rank, f"{mb}" if chunk == 0 else f"{mb}'",
                    ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks([r.rank for r in records], [f"rank {r.rank}" for r in records])
    ax.invert_yaxis()
    ax.set_xlabel("ms (blue: forward, orange: backward (input gradient with W), green: weight gradient W; "
                  "' = second model chunk)")
    ax.set_title(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


@one_line_errors
def main(argv=None) -> int:
    parser = OneLineArgumentParser(prog="tools/plot_pipeline.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=positive_int, default=2)
    parser.add_argument("--vpp", type=positive_int, default=1, help="model chunks per rank (interleaved when > 1)")
    parser.add_argument("--microbatches", type=positive_int, default=8)
    parser.add_argument("--schedule", choices=PIPELINE_SCHEDULES, default="1f1b",
                        help="zbv always runs two chunks per rank")
    parser.add_argument("--output", default="runs/pipeline_timeline.png")
    parser.add_argument("--steps", type=positive_int, default=1,
                        help="steps recorded; the median one (by bubble) is drawn")
    args = parser.parse_args(argv)
    if args.schedule == "zbv":
        args.vpp = 2
    elif args.schedule != "1f1b" and args.vpp > 1:
        raise UserError(f"--vpp > 1 is the interleaved 1F1B schedule; drop it for --schedule {args.schedule}")
    if args.schedule == "pipedream-2bw" and args.microbatches < args.pp - 1:
        raise UserError(f"--schedule pipedream-2bw needs --microbatches >= --pp - 1 = {args.pp - 1}")
    if args.vpp > 1 and args.microbatches % args.pp:
        raise UserError("--microbatches must be a multiple of --pp for the interleaved schedule")
    records = record_schedule(args.pp, args.microbatches, args.vpp, args.schedule, steps=args.steps)
    name = "interleaved 1F1B" if args.vpp > 1 and args.schedule == "1f1b" else args.schedule.upper()
    measured = measured_bubble_share(records)
    theory = theoretical_bubble_share(args.pp, args.microbatches, args.vpp, args.schedule)
    draw(records, args.output, f"{name}: pp={args.pp}, vpp={args.vpp}, m={args.microbatches}; "
                               f"bubble {100 * measured:.0f}% (theory {100 * theory:.0f}%)")
    replayed = replayed_bubble_share(records, args.schedule, args.vpp)
    print(f"{name} pp={args.pp} vpp={args.vpp} m={args.microbatches}: measured bubble share {100 * measured:.1f}% "
          f"| theory {100 * theory:.1f}%"
          + ("" if replayed is None else f" | the order with the measured action times {100 * replayed:.1f}%")
          + f" | forward time spread {100 * forward_spread(records):.0f}% | timeline {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
