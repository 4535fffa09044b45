#!/usr/bin/env python
"""The order of ZeRO's bucket collectives in one recorded training step, on NCCL's path and on gloo's.

Two ranks under the NCCL-semantics tier (tests/distributed/nccl_semantics.py: NCCL's stream and ordering
rules imposed on gloo) train a 4-layer tiny Llama with --overlap-grad-reduce --overlap-param-gather, 4
micro-batches per step and 20k-element buckets, as ZeRO-1 and ZeRO-3. The tier's switch
(MEGALITE_FORCE_NCCL_COLLECTIVE_PATH) picks the path: 1 is NCCL's (what ``Comm.holds_temporaries``
answers for an NCCL group), 0 gloo's. Rank 0 records its third step with torch.profiler: every bucket
collective's issue and wait is a range (``bucket_comm.traced``: "param all-gather bucket 3", "wait
reduce-scatter bucket 0"), and this script adds a marker where each unit's forward starts (before the
data-parallel pre-hooks) and ranges around each backward, finish_grad_sync and the optimizer step. It
writes the Chrome traces (chrome://tracing or Perfetto) and prints the step's main-thread order, a line
per forward unit, backward pass, finish_grad_sync and optimizer step:

    .venv/bin/python bench/trace_zero_overlap.py [--out DIR] [--full]

``--full`` prints every micro-batch (default: the first, the last, and the step); the time column is
milliseconds from the step's start on this CPU, for the order only (gloo on CPU is no NCCL timing).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "tests", "distributed"), os.path.join(ROOT, "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

LAYOUTS = {"ZeRO-1": "optim", "ZeRO-3": "optim_grads_params"}
RECORDED_STEP = 2
LABEL = re.compile(r"^(forward \S+|backward|finish_grad_sync|optimizer step|(wait )?(param all-gather|reduce-scatter) bucket \d+)$")


def record(rank: int, world: int, strategy: str, nccl_path: bool, out: str) -> list:
    """Rank function: train RECORDED_STEP + 1 steps, profile the last; rank 0 returns its labelled
    main-thread ranges as (start in ms from the step's start, name) and writes the Chrome trace."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from dp_workloads import batches, layout_flags
    from megalite.train.command_line import parse_args
    from megalite.train.step import train_step
    from megalite.train.trainer import build_trainer

    os.environ["MEGALITE_FORCE_NCCL_COLLECTIVE_PATH"] = "1" if nccl_path else "0"
    trainer = build_trainer(parse_args(layout_flags(strategy, True, num_layers=4), world_size=world))
    for unit in trainer.ddp.units:
        def mark(module, args, name=unit.name):
            with record_function(f"forward {name}"):
                pass
        unit.module.register_forward_pre_hook(mark, prepend=True)
    def ranged(name, fn):
        def call(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)
        return call
    trainer.optimizer.step = ranged("optimizer step", trainer.optimizer.step)
    trainer.ddp.finish_grad_sync = ranged("finish_grad_sync", trainer.ddp.finish_grad_sync)
    torch.Tensor.backward = ranged("backward", torch.Tensor.backward)
    data = batches(trainer, RECORDED_STEP + 1)
    for _ in range(RECORDED_STEP):
        train_step(trainer, data)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("step"):
            train_step(trainer, data)
    trainer.ddp.wait_for_param_gather()
    if rank != 0:
        return []
    path = "nccl" if nccl_path else "gloo"
    prof.export_chrome_trace(os.path.join(out, f"zero_overlap_{strategy}_{path}_rank0.json"))
    events = [e for e in prof.events() if e.name == "step" or LABEL.match(e.name)]
    start = min(e.time_range.start for e in events if e.name == "step")
    return sorted(((e.time_range.start - start) / 1000, e.name) for e in events if e.name != "step")


def lines(events: list, full: bool) -> list[str]:
    """One line per forward unit (its marker, then what the pre-hooks and the forward issued and waited
    until the next unit), per backward pass, for finish_grad_sync and for the optimizer step;
    micro-batches start at the first unit's marker."""
    first_unit = next(name for _, name in events if name.startswith("forward "))
    out, microbatch = [], 0
    for ms, name in events:
        if name == first_unit:
            microbatch += 1
        short = (name.replace("param all-gather bucket ", "AG").replace("reduce-scatter bucket ", "RS")
                 .replace("wait ", "wait-"))
        if name.startswith("forward ") or name in ("backward", "finish_grad_sync", "optimizer step") or not out:
            out.append((microbatch, f"{ms:8.1f}  {short:17}"))
        else:
            out[-1] = (out[-1][0], out[-1][1] + " " + short)
    last = max(m for m, _ in out)
    return [(f"mb{m} {text}" if m else f"    {text}").rstrip() for m, text in out if full or m in (1, last)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "profile"), help="folder for the Chrome traces")
    parser.add_argument("--full", action="store_true", help="print every micro-batch")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from harness import run_ranks
    for title, strategy in LAYOUTS.items():
        for nccl_path in (True, False):
            events = run_ranks(2, record, strategy, nccl_path, args.out, nccl=True)[0]
            print(f"\n{title} ({strategy}), {'NCCL' if nccl_path else 'gloo'} path: step {RECORDED_STEP + 1} on rank 0 "
                  f"(AGi: issue of bucket i's parameter all-gather, RSi: of its reduce-scatter; wait-: its wait)")
            print("\n".join(lines(events, args.full)))
    print(f"\nChrome traces in {args.out}")


if __name__ == "__main__":
    main()
