#!/usr/bin/env python
"""Draw a run's JSON-lines metrics (pretrain_gpt.py --metrics-file, or metrics.jsonl in --save) as PNGs.

    python tools/plot_metrics.py runs/demo/metrics.jsonl --output-dir runs/demo/plots
    python tools/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --labels a b --output-dir cmp

Writes one PNG per panel (loss.png with the validation loss, lr.png, grad_norm.png, throughput.png with
tokens/s and MFU when known, memory.png; for an MoE model moe_loss.png with its auxiliary losses and
moe_load.png with each layer's max/mean tokens per expert) and overview.png with all of them; several files are drawn as
labelled curves on the same axes. A resumed run appends to its metrics file, so an iteration logged
twice (before a crash and after the restart) keeps its last record.
"""
from __future__ import annotations

import fnmatch
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megalite.config.cli import OneLineArgumentParser, one_line_errors  # noqa: E402
from megalite.errors import UserError  # noqa: E402

# panel file name -> (title, y label, [(metric key, curve label)], log scale); a key with "*" draws every
# metric it matches (fnmatch), labelled by its key
PANELS = {
    "loss": ("Loss", "lm loss", [("lm loss", "train"), ("validation lm loss", "validation")], False),
    "lr": ("Learning rate", "learning rate", [("learning rate", "")], False),
    "grad_norm": ("Gradient norm", "grad norm", [("grad norm", "")], True),
    "throughput": ("Throughput", "tokens per second", [("tokens per second", "")], False),
    "mfu": ("Model FLOPs utilisation", "MFU", [("MFU", "")], False),
    "memory": ("Peak memory (largest rank)", "MB", [("memory max allocated (MB)", "CUDA max allocated"),
                                                     ("memory max rss (MB)", "max RSS")], False),
    "moe_loss": ("MoE auxiliary losses", "loss", [("load_balancing_loss", "load balancing"),
                                                  ("seq_load_balancing_loss", "sequence load balancing"),
                                                  ("z_loss", "z-loss")], True),
    "moe_load": ("MoE load: max/mean tokens per expert", "max / mean", [("moe/layer*/load_max_over_mean", "")], False),
}


def read_metrics(path: str) -> dict[str, list[tuple[int, float]]]:
    """metric key -> [(iteration, value)] sorted by iteration, the last record of an iteration winning."""
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such metrics file (pretrain_gpt.py writes it with --metrics-file or --save)")
    by_iteration: dict[str, dict[int, float]] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                iteration = int(record["iteration"])
            except (ValueError, KeyError, TypeError):
                raise UserError(f"{path}: line {number} is not a metrics record "
                                "(a JSON object with an \"iteration\"); is this a metrics.jsonl file?") from None
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    by_iteration.setdefault(key, {})[iteration] = float(value)
    if not by_iteration:
        raise UserError(f"{path}: no metrics yet (the run logs every --log-interval iterations)")
    return {key: sorted(points.items()) for key, points in by_iteration.items()}


def draw_panel(ax, panel: str, runs: list[tuple[str, dict]]) -> bool:
    """Draw one panel's curves for every run; False when no run has any of its metrics."""
    title, ylabel, curves, log_scale = PANELS[panel]
    drawn = False
    for run_label, metrics in runs:
        expanded = [(k, label or (k if "*" in key else "")) for key, label in curves
                    for k in (sorted(fnmatch.filter(metrics, key)) if "*" in key else [key])]
        for key, curve_label in expanded:
            points = metrics.get(key)
            if not points:
                continue
            label = " ".join(x for x in (run_label, curve_label) if x) or None
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if len(xs) < 20 else None, markersize=3, label=label)
            drawn = True
    ax.set_title(title)
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    if log_scale and drawn:
        ax.set_yscale("log")
    if drawn and any(line.get_label() and not line.get_label().startswith("_") for line in ax.get_lines()):
        ax.legend()
    ax.grid(alpha=0.3)
    return drawn


def plot(paths: list[str], labels: list[str] | None, output_dir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")                       # files only, no display needed
    import matplotlib.pyplot as plt

    if labels and len(labels) != len(paths):
        raise UserError(f"--labels: {len(labels)} labels for {len(paths)} metrics files; give one per file")
    runs = [(labels[i] if labels else (os.path.basename(os.path.dirname(os.path.abspath(p))) if len(paths) > 1
                                        else ""), read_metrics(p)) for i, p in enumerate(paths)]
    os.makedirs(output_dir, exist_ok=True)
    written, present = [], []
    for panel in PANELS:
        fig, ax = plt.subplots(figsize=(6, 4))
        if draw_panel(ax, panel, runs):
            written.append(_save(fig, os.path.join(output_dir, f"{panel}.png")))
            present.append(panel)
        plt.close(fig)
    columns = 2
    rows = (len(present) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(12, 4 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, present):
        draw_panel(ax, panel, runs)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    written.append(_save(fig, os.path.join(output_dir, "overview.png")))
    plt.close(fig)
    return written


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=100)
    os.replace(path + ".tmp.png", path)        # a reader never sees half a PNG
    return path


@one_line_errors
def main(argv=None) -> int:
    p = OneLineArgumentParser(prog="tools/plot_metrics.py",
                              description="Plot pretrain_gpt.py's JSON-lines metrics as PNG files.")
    p.add_argument("metrics", nargs="+", help="metrics.jsonl file(s) written by pretrain_gpt.py")
    p.add_argument("--labels", nargs="+", help="a legend label per metrics file (default: its folder's name)")
    p.add_argument("--output-dir", required=True, help="folder for the PNG files (created if needed)")
    args = p.parse_args(argv)
    try:
        written = plot(args.metrics, args.labels, args.output_dir)
    except OSError as e:
        raise UserError(f"--output-dir {args.output_dir}: cannot write ({e.strerror}); choose a writable folder") from None
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
