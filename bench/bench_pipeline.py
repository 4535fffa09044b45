#!/usr/bin/env python
"""Pipeline bubble: measured share of idle time vs theory, for 1F1B and interleaved 1F1B.

Each row runs one step of a small model through megalite's real schedule executor on 2 gloo ranks
(one per core here) and measures 1 - busy/wall per rank (tools/plot_pipeline.py). Theory (REFERENCE §6):
(p-1)/(m+p-1) for 1F1B and (p-1)/(v*m+p-1) interleaved. Writes a section of the results file and a
timeline PNG per schedule next to it (bench/ for the full run).

    python bench/bench_pipeline.py
    python bench/bench_pipeline.py --quick       # smoke test: micro-batches 2 and 8 only
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Headline, add_common_args, command_line, publish, results_path  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)

from plot_pipeline import draw, measured_bubble_share, record_schedule, theoretical_bubble_share  # noqa: E402

PP = 2
HEADLINE_MICROBATCHES = 8       # the summary's figure, and the timelines drawn


def schedule_name(vpp: int) -> str:
    return "1F1B" if vpp == 1 else f"interleaved (v={vpp})"


def measure(microbatches: tuple[int, ...], picture_dir: str) -> tuple[list[str], list[Headline]]:
    rows, figures = [], []
    for vpp in (1, 2):
        for m in microbatches:
            records = record_schedule(PP, m, vpp)
            measured, theory = measured_bubble_share(records), theoretical_bubble_share(PP, m, vpp)
            rows.append(f"| {schedule_name(vpp)} | {m} | {100 * measured:.1f}% | {100 * theory:.1f}% |")
            print(rows[-1], flush=True)
            if m == HEADLINE_MICROBATCHES:
                path = os.path.join(picture_dir, f"pipeline_{'1f1b' if vpp == 1 else 'interleaved'}_m{m}.png")
                draw(records, path, f"{schedule_name(vpp)}, pp={PP}, m={m}")
                figures.append((f"pipeline bubble, {schedule_name(vpp)}, pp={PP}, m={m}",
                                f"theory {100 * theory:.1f}%",
                                f"measured {100 * measured:.1f}% = {measured / theory:.2f}x theory"))
    return rows, figures


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    args = parser.parse_args(argv)
    microbatches = (2, HEADLINE_MICROBATCHES) if args.quick else (2, 4, 8, 16)
    picture_dir = os.path.dirname(os.path.abspath(results_path(args)))
    os.makedirs(picture_dir, exist_ok=True)
    rows, figures = measure(microbatches, picture_dir)
    command = command_line("bench_pipeline.py", argv)
    body = [f"pp={PP} gloo ranks, 2 layers per model chunk, hidden 128, seq 128, micro-batch 2. Bubble share = "
            "1 - busy/wall of one step (after one warm-up step), averaged over ranks. Theory (REFERENCE §6): "
            "(p-1)/(m+p-1) for 1F1B, (p-1)/(v*m+p-1) interleaved. The model is tiny, so point-to-point latency "
            "and Python overhead weigh more than on a GPU; the timelines for m=8 are in "
            f"pipeline_1f1b_m{HEADLINE_MICROBATCHES}.png and pipeline_interleaved_m{HEADLINE_MICROBATCHES}.png "
            "next to this file.",
            "", "| schedule | micro-batches | measured | theory |", "|---|---|---|---|", *rows]
    publish(args, "bench_pipeline", "Pipeline bubble, measured vs theory", command,
            [Headline(*f, command) for f in figures], body)


if __name__ == "__main__":
    main(sys.argv[1:])
