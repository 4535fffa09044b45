#!/usr/bin/env python
"""FP8 convergence on the demo corpus: the loss curves of bf16 and of each FP8 recipe over the same
iterations, the same data order and the same initial weights, trained serially by pretrain_gpt.py.

The model is the demo's small Llama (examples/demo.sh) with two widths changed so that every recipe's
scaling block divides every GEMM dimension (blockwise scales in blocks of 128 along each GEMM's
contraction dimension): the SwiGLU width is 384 (the demo's 352 is not a multiple of 128) and attention
has 4 key/value heads of 32 (the demo's 2 query groups give a key/value width of 64). The sequences (64
tokens) and the global batch (one sequence) are smaller than the demo's so that the runs fit a shared CPU. Recipes whose GEMMs have no CPU kernel
(torch._scaled_mm on a CPU takes tensorwise and rowwise scales) run emulated (--fp8-emulate: the same
quantised values and scales, multiplied in fp32).

    python bench/fp8_convergence.py                      # bf16 and every recipe, 300 iterations (CPU: long)
    python bench/fp8_convergence.py --plot-only          # redraw the PNG and table from earlier runs
    python bench/fp8_convergence.py --runs bf16 tensorwise --iters 20

Writes runs/fp8_convergence/<run>/metrics.jsonl, bench/fp8_convergence.png, and (printed and as a section of
bench/RESULTS.md) a Markdown table
of each run's loss at the last iteration against bf16's: the training loss (the mean over the last log
interval, one sequence per iteration) and the validation loss (32 held-out sequences, the same for every
run).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from results import RESULTS, replace_section, section_lines  # noqa: E402

from megalite.config.fp8_fields import FP8_RECIPES  # noqa: E402
from megalite.precision.fp8 import FP8_RECIPE_CLASSES, PAIRS, has_kernel  # noqa: E402

import torch  # noqa: E402

BASELINE = "bf16"
TITLE = "FP8 convergence: bf16 and each FP8 recipe on the demo corpus, 300 iterations"
MODEL = ("--num-layers 4 --hidden-size 128 --ffn-hidden-size 384 --num-attention-heads 4 "
         "--seq-length 64 --max-position-embeddings 64 --position-embedding-type rope --normalization RMSNorm "
         "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights --attention-dropout 0.0 "
         "--hidden-dropout 0.0 --bf16").split()
TRAINING = ("--micro-batch-size 1 --global-batch-size 1 --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine "
            "--lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --log-interval 10 "
            "--eval-interval 100 --eval-iters 32 --num-workers 0").split()
DATA = ("--data-path data/stdlib_text_document --split 98,2,0 --tokenizer-type SentencePieceTokenizer "
        "--tokenizer-model data/stdlib_sp.model").split()


def recipe_flags(recipe: str, fp8_format: str) -> list[str]:
    """pretrain_gpt.py's FP8 flags for ``recipe``, emulated where this machine has no kernel for it."""
    if recipe == BASELINE:
        return []
    flags = ["--fp8-format", fp8_format, "--fp8-recipe", recipe]
    cpu = torch.device("cpu")
    if not all(has_kernel(recipe, fp8_format, cpu, a, b, torch.bfloat16) for a, b in PAIRS):
        flags.append("--fp8-emulate")
    return flags


def train(recipe: str, args) -> str:
    """Train one run; returns its metrics file."""
    out = os.path.join(args.out_dir, recipe)
    os.makedirs(out, exist_ok=True)
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    command = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *MODEL, *TRAINING, *DATA,
               "--train-iters", str(args.iters), "--metrics-file", metrics, *recipe_flags(recipe, args.fp8_format)]
    print(" ".join(command[1:]), flush=True)
    with open(os.path.join(out, "train.log"), "w") as log:
        subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    return metrics


def losses(metrics: str) -> dict[str, dict[int, float]]:
    """{"train": iteration -> the mean lm loss of the log interval ending there, "validation": iteration ->
    the validation lm loss} of one run."""
    with open(metrics) as f:
        rows = [json.loads(line) for line in f]
    return {kind: {row["iteration"]: row[key] for row in rows if key in row}
            for kind, key in (("train", "lm loss"), ("validation", "validation lm loss"))}


def plot(curves: dict[str, dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=80)
    for name, curve in curves.items():
        style = dict(label=name, lw=1.2, ls="-" if name == BASELINE else "--")
        axes[0].plot(list(curve["train"]), list(curve["train"].values()), **style)
        axes[1].plot(list(curve["validation"]), list(curve["validation"].values()), marker="o", ms=3, **style)
    for ax, title in zip(axes, ("training lm loss (mean over 10 iterations)", "validation lm loss (32 sequences)")):
        ax.set_xlabel("iteration")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle("FP8 recipes vs bf16 on the demo corpus: same data, same initial weights", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)


def table(curves: dict[str, dict]) -> str:
    base = curves[BASELINE]
    last = max(base["train"])
    lines = [f"| run | training loss, iterations {last - 9}-{last} | vs bf16 | validation loss at {last} | vs bf16 | "
             "both within 1.5% |", "|---|---|---|---|---|---|"]
    for name, curve in curves.items():
        train_loss, valid_loss = curve["train"].get(last), curve["validation"].get(last)
        if train_loss is None or valid_loss is None:
            continue
        gaps = (train_loss / base["train"][last] - 1, valid_loss / base["validation"][last] - 1)
        lines.append(f"| {name} | {train_loss:.4f} | {100 * gaps[0]:+.2f}% | {valid_loss:.4f} | {100 * gaps[1]:+.2f}% | "
                     f"{'yes' if max(map(abs, gaps)) <= 0.015 else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    available = [r for r in FP8_RECIPES if r in FP8_RECIPE_CLASSES]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=[BASELINE, *available], choices=[BASELINE, *available],
                        help="which runs to train (all of them are drawn)")
    parser.add_argument("--fp8-format", default="hybrid", choices=("e4m3", "hybrid"))
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "fp8_convergence"))
    parser.add_argument("--png", default=os.path.join(ROOT, "bench", "fp8_convergence.png"))
    parser.add_argument("--plot-only", action="store_true", help="draw from the runs already in --out-dir")
    parser.add_argument("--results", default=RESULTS, help="the results file whose FP8 convergence section to write")
    args = parser.parse_args()
    for run in args.runs if not args.plot_only else []:
        train(run, args)
    runs = [BASELINE, *available]
    curves = {run: losses(os.path.join(args.out_dir, run, "metrics.jsonl")) for run in runs
              if os.path.exists(os.path.join(args.out_dir, run, "metrics.jsonl"))}
    plot(curves, args.png)
    rows = table(curves)
    print(rows)
    print(f"plot: {os.path.relpath(args.png, ROOT)}")
    body = [f"pretrain_gpt.py, serial, on data/stdlib_text_document: `{' '.join(MODEL + TRAINING)}`", "", f"Runs: {', '.join(curves)}; emulated (--fp8-emulate, no CPU kernel): "
            f"{', '.join(r for r in curves if '--fp8-emulate' in recipe_flags(r, args.fp8_format)) or 'none'}. "
            f"Plot: bench/{os.path.basename(args.png)}.", "", rows]
    replace_section("fp8_convergence", section_lines(TITLE, "python bench/fp8_convergence.py", [], body, False),
                    args.results)


if __name__ == "__main__":
    main()
