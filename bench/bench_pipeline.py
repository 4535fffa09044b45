#!/usr/bin/env python
"""Pipeline bubble: measured share of idle time vs theory, for 1F1B and interleaved 1F1B.

Each row runs one step of a small model through megalite's real schedule executor on 2 gloo ranks
(one per core here) and measures 1 - busy/wall per rank (tools/plot_pipeline.py). Theory (REFERENCE §6):
(p-1)/(m+p-1) for 1F1B and (p-1)/(v*m+p-1) interleaved. Writes a section of bench/RESULTS.md and a
timeline PNG per schedule in bench/.

    python bench/bench_pipeline.py
"""
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import replace_section  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)

from plot_pipeline import draw, measured_bubble_share, record_schedule, theoretical_bubble_share  # noqa: E402

PP = 2


def main() -> None:
    rows = []
    for vpp in (1, 2):
        for m in (2, 4, 8, 16):
            records = record_schedule(PP, m, vpp)
            measured, theory = measured_bubble_share(records), theoretical_bubble_share(PP, m, vpp)
            name = "1F1B" if vpp == 1 else f"interleaved (v={vpp})"
            row = f"| {name} | {m} | {100 * measured:.1f}% | {100 * theory:.1f}% |"
            print(row, flush=True)
            rows.append(row)
            if m == 8:
                path = os.path.join(ROOT, "bench", f"pipeline_{'1f1b' if vpp == 1 else 'interleaved'}_m8.png")
                draw(records, path, f"{name}, pp={PP}, m={m}")
    write_results(rows)


def write_results(rows) -> None:
    replace_section("bench_pipeline", [
        "## Pipeline bubble, measured vs theory",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}. "
        "Command: `python bench/bench_pipeline.py`. pp=2 gloo ranks, 2 layers per model chunk, hidden 128, seq 128, "
        "micro-batch 2. Bubble share = 1 - busy/wall of one step, averaged over ranks.",
        "", "| schedule | micro-batches | measured | theory |", "|---|---|---|---|", *rows])


if __name__ == "__main__":
    main()
