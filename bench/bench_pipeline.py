#!/usr/bin/env python
"""Pipeline bubble: measured share of idle time vs theory, for every schedule (GPipe, 1F1B, interleaved
1F1B, ZB-H1, ZB-V; PipeDream and PipeDream-2BW in their steady state).

Each row runs one step of a small model through megalite's real schedule executor on 2 gloo ranks
(one per core here) and measures 1 - busy/wall per rank (tools/plot_pipeline.py). Theory (Narayanan et al. 2021):
(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1 (Qi et al. 2024,
equal F/B/W times; ZB-V about 0), 0 for the asynchronous schedules (no flush). Writes a section of the
results file and a timeline PNG per schedule next to it (bench/ for the full run).

A second section runs the same model (8 layers, hidden 512, fp32, pp=2) side by side with
torch.distributed.pipelining's schedules (bench/pipeline_vs_torch.py): megalite's 1F1B vs Schedule1F1B,
interleaved vs ScheduleInterleaved1F1B, GPipe vs ScheduleGPipe, ZB-H1 vs ScheduleInterleavedZeroBubble
(one stage per rank: ZB1P, which is ZB-H1) and ZB-V vs ScheduleZBVZeroBubble, alternating step by step, and
reports megalite / torch step-time ratios, with one process running the whole model as the reference.

    python bench/bench_pipeline.py
    python bench/bench_pipeline.py --quick       # smoke test: micro-batches 4 and 8 only, a smaller model
    python bench/bench_pipeline.py --only torch  # just the side-by-side with torch.distributed.pipelining
    python bench/bench_pipeline.py --only torch --microbatches 8    # the side-by-side at m=8 alone
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Headline, add_common_args, command_line, publish, results_path  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)

from plot_pipeline import (draw, forward_spread, measured_bubble_share, record_schedule,  # noqa: E402
                           replayed_bubble_share, theoretical_bubble_share)
from pipeline_vs_torch import PAIRS, run_comparison, summarize  # noqa: E402

PP = 2
HEADLINE_MICROBATCHES = 8       # the summary's figure, and the timelines drawn
BUBBLE_STEPS = 5                # steps recorded per row; the median one (by bubble share) is reported and drawn


SCHEDULES = [("1f1b", 1), ("1f1b", 2), ("gpipe", 1), ("zb-h1", 1), ("zbv", 2),      # (schedule, chunks per rank)
             ("pipedream", 1), ("pipedream-2bw", 1)]


def schedule_name(schedule: str, vpp: int) -> str:
    if schedule == "1f1b":
        return "1F1B" if vpp == 1 else f"interleaved (v={vpp})"
    return {"gpipe": "GPipe", "zb-h1": "ZB-H1", "zbv": "ZB-V", "pipedream": "PipeDream",
            "pipedream-2bw": "PipeDream-2BW"}[schedule]


def picture_name(schedule: str, vpp: int, m: int) -> str:
    tag = "interleaved" if schedule == "1f1b" and vpp > 1 else schedule.replace("-", "_")
    return f"pipeline_{tag}_m{m}.png"


BUBBLE_MODEL = dict(layers=8, hidden=512)       # the side-by-side's model: real work per action
BUBBLE_MODEL_QUICK = dict(layers=4, hidden=128)


def measure(microbatches: tuple[int, ...], picture_dir: str, model: dict,
            steps: int) -> tuple[list[str], list[Headline]]:
    rows, figures, bubbles = [], [], {}
    for schedule, vpp in SCHEDULES:
        name = schedule_name(schedule, vpp)
        for m in microbatches:
            records = record_schedule(PP, m, vpp, schedule, layers_per_stage=model["layers"] // (PP * vpp),
                                      hidden=model["hidden"], steps=steps)
            measured = measured_bubble_share(records)
            theory = theoretical_bubble_share(PP, m, vpp, schedule)
            ratio = f"{measured / theory:.2f}x" if theory else "-"
            replayed = replayed_bubble_share(records, schedule, vpp)
            bubbles[(schedule, vpp, m)] = (measured, replayed)
            rows.append(f"| {name} | {m} | {100 * measured:.1f}% | {100 * theory:.1f}% | {ratio} | "
                        + ("-" if replayed is None else f"{100 * replayed:.1f}%")
                        + f" | {100 * forward_spread(records):.0f}% |")
            print(rows[-1], flush=True)
            if m == HEADLINE_MICROBATCHES:
                draw(records, os.path.join(picture_dir, picture_name(schedule, vpp, m)), f"{name}, pp={PP}, m={m}")
                figures.append((f"pipeline bubble, {name}, pp={PP}, m={m}", f"theory {100 * theory:.1f}%",
                                f"measured {100 * measured:.1f}%" + (f" = {ratio} theory" if theory else "")))
    if HEADLINE_MICROBATCHES not in microbatches:
        return rows, figures
    (zb, zb_replayed), (ofob, ofob_replayed) = (bubbles[("zb-h1", 1, HEADLINE_MICROBATCHES)],
                                                bubbles[("1f1b", 1, HEADLINE_MICROBATCHES)])
    figures.append((f"pipeline bubble, ZB-H1 / 1F1B, pp={PP}, m={HEADLINE_MICROBATCHES}",
                    f"goal <= 0.50; the orders replayed with the measured action times: {zb_replayed / ofob_replayed:.2f}",
                    f"measured {zb / ofob:.2f}"))
    return rows, figures


# the side-by-side with torch.distributed.pipelining: the model, fp32, pp=2
VS_TORCH = dict(layers=8, hidden=512, heads=8, seq=128, mbs=2, vocab=1000, repeats=5)
VS_TORCH_QUICK = dict(layers=8, hidden=128, heads=4, seq=64, mbs=2, vocab=1000, repeats=1)
LOSS_TOLERANCE = 1e-4           # relative, fp32: the three runs sum the same terms in different orders


def versus_torch(args, argv: list[str], microbatches: tuple[int, ...]) -> None:
    opts = {**(VS_TORCH_QUICK if args.quick else VS_TORCH), "microbatches": microbatches}
    per_rank = run_comparison(PP, opts)
    rows, figures = [], []
    for m in microbatches:
        pairs, ref_losses, ref_ms = summarize(per_rank, m)
        for row, torch_cls in ((row, cls) for row, _, _, cls in PAIRS):
            mine, theirs, ratio, diff = pairs[row]
            if diff > LOSS_TOLERANCE:      # not the same computation: the timings would compare nothing
                raise SystemExit(f"bench_pipeline: {row} at m={m}: megalite's or torch's losses differ from one "
                                 f"process's by {diff:.1e} (relative), more than {LOSS_TOLERANCE}")
            rows.append(f"| {row} | `{torch_cls}` | {m} | {mine:.0f} | {theirs:.0f} | {ratio:.2f}x | "
                        f"{mine / ref_ms:.2f}x | {diff:.1e} |")
            print(rows[-1], flush=True)
            if m == HEADLINE_MICROBATCHES:
                figures.append((f"pipeline step time, megalite {row} vs torch {torch_cls}, pp={PP}, m={m}",
                                f"torch.distributed.pipelining {theirs:.0f} ms", f"{ratio:.2f}x ({mine:.0f} ms)"))
        rows.append(f"| one process, whole model | - | {m} | {ref_ms:.0f} | - | - | 1.00x | - |")
        print(rows[-1], flush=True)
    command = command_line("bench_pipeline.py", argv)
    o = opts
    body = [f"Model: {o['layers']} layers, hidden {o['hidden']}, {o['heads']} heads, seq {o['seq']}, micro-batch "
            f"{o['mbs']}, vocabulary {o['vocab']}, fp32 (Llama-style: RoPE, RMSNorm, SwiGLU, untied output). pp={PP} "
            "gloo ranks, one thread each. Both sides run the same chunks (same seed, so the same weights), the same "
            "stage placement and micro-batches; one step = forward and backward of every micro-batch, no optimizer. "
            "Steps alternate megalite / torch within each round; times are medians of "
            f"{o['repeats']} rounds after one warm-up round, and megalite / torch is the median of each round's "
            "ratio (paired, so a round's machine load cancels). Step time = barrier to barrier, slowest rank. "
            "torch has no ZB-H1 class: its ScheduleInterleavedZeroBubble (ZB1P) with one stage per rank is the "
            "ZB-H1 order. The last column is the largest relative difference of each micro-batch's loss, "
            "megalite's and torch's, from the one-process run's.",
            "", "| megalite schedule | torch.distributed.pipelining | micro-batches | megalite ms | torch ms | "
            "megalite / torch | megalite / one process | loss rel. diff |", "|---|---|---|---|---|---|---|---|", *rows]
    publish(args, "bench_pipeline_vs_torch", "Pipeline schedules: megalite vs torch.distributed.pipelining",
            command, [Headline(*f, command) for f in figures], body)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--only", choices=("bubble", "torch"), help="run one of the two parts")
    parser.add_argument("--microbatches", help="comma-separated micro-batch counts (default 4,8,16; 4,8 with --quick)")
    args = parser.parse_args(argv)
    microbatches = (4, HEADLINE_MICROBATCHES) if args.quick else (4, 8, 16)
    if args.microbatches:
        try:
            microbatches = tuple(int(m) for m in args.microbatches.split(","))
        except ValueError:
            parser.error(f"--microbatches takes comma-separated counts such as 4,8,16, not {args.microbatches!r}")
        if any(m < PP or m % PP for m in microbatches):
            parser.error(f"--microbatches: each count must be a multiple of the pipeline size {PP} (the interleaved "
                         f"schedule needs it), got {args.microbatches}")
    if args.only != "bubble":
        versus_torch(args, argv, microbatches)
    if args.only == "torch":
        return
    picture_dir = os.path.dirname(os.path.abspath(results_path(args)))
    os.makedirs(picture_dir, exist_ok=True)
    model = BUBBLE_MODEL_QUICK if args.quick else BUBBLE_MODEL
    steps = 2 if args.quick else BUBBLE_STEPS
    rows, figures = measure(microbatches, picture_dir, model, steps)
    command = command_line("bench_pipeline.py", argv)
    body = [f"pp={PP} gloo ranks, {model['layers']} layers split evenly over the model chunks, hidden {model['hidden']}, "
            "4 heads, vocabulary 1000, seq 128, micro-batch 2, fp32. Bubble share = "
            "1 - busy/wall of one step, averaged over ranks; each row records "
            f"{steps} steps after one warm-up step and reports (and draws) the median. Theory (Narayanan et al. 2021): "
            "(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1, about 0 for ZB-V "
            "(equal F/B/W times), 0 for PipeDream and PipeDream-2BW (no flush; their steps are recorded in the "
            "steady state, after one step has filled the pipeline). The last stage also runs the output layer and the loss, so stages are not "
            "quite equal (theory assumes they are); the timelines for m=8 are "
            + ", ".join(picture_name(s, v, HEADLINE_MICROBATCHES) for s, v in SCHEDULES) + " next to this file.",
            "",
            "Two columns say how much of the gap to theory is the machine's. *Order replayed* is the bubble the "
            "schedule's own orders leave when every action takes its rank's median measured time for its kind "
            "(megalite/parallel/pipeline/simulate.py): the unequal stages' share, with no transfer time and no "
            "spread. *Forward spread* is the coefficient of variation of the identical forwards of a rank's chunk "
            "in the same step: the machine's jitter, which a synchronous pipeline turns into waits (each "
            "exchange waits for the slower side).",
            "", "| schedule | micro-batches | measured | theory | ratio | order replayed (measured action times) "
            "| forward spread |", "|---|---|---|---|---|---|---|", *rows]
    publish(args, "bench_pipeline", "Pipeline bubble, measured vs theory", command,
            [Headline(*f, command) for f in figures], body)


if __name__ == "__main__":
    main(sys.argv[1:])
