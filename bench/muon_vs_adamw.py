#!/usr/bin/env python
"""Muon against AdamW on the demo corpus at equal tokens: the demo's model, data, batches and schedule
(examples/demo.sh: a 4-layer Llama, hidden 128, on the stdlib corpus, global batch 16 x 128 tokens,
300 iterations, cosine from the peak lr to a tenth of it after 20 warm-up iterations, weight decay 0.1,
clipping 1.0), trained serially once per optimizer setting, with the same seed, so every run sees the
same batches in the same order. Writes bench/muon_vs_adamw.png (training loss and validation loss by
iteration), bench/muon_vs_adamw.json (the curves the plot is drawn from) and a section of bench/RESULTS.md.

The default compares AdamW at the demo's settings with Muon at the README's recommended settings. --sweep
tunes both alike: AdamW over three peak learning rates around the demo's, Muon over three
--muon-extra-scale-factor values at the demo's learning rate (its AdamW part, the embedding, output layer
and norms, then steps exactly as the AdamW baseline does); the figures compare the best of each.

    python bench/muon_vs_adamw.py                 # the two headline runs (about 5 minutes on 2 cores)
    python bench/muon_vs_adamw.py --sweep         # three settings each
    python bench/muon_vs_adamw.py --plot-only     # redraw the PNG and section from bench/muon_vs_adamw.json
    python bench/muon_vs_adamw.py --quick         # smoke test: 20 iterations
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import BENCH, Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)

CURVES = os.path.join(BENCH, "muon_vs_adamw.json")
PLOT = os.path.join(BENCH, "muon_vs_adamw.png")

# examples/demo.sh's model, batches and schedule (its parallel layout aside: every run here is serial)
DEMO = [
    "--num-layers", "4", "--hidden-size", "128", "--ffn-hidden-size", "352", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "128", "--max-position-embeddings", "128",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--micro-batch-size", "4", "--global-batch-size", "16", "--lr-decay-style", "cosine", "--lr-warmup-iters", "20",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--split", "98,2,0",
    "--tokenizer-type", "SentencePieceTokenizer", "--log-interval", "10", "--eval-iters", "5", "--seed", "1234",
]
MUON = ["--optimizer", "muon", "--muon-momentum", "0.95", "--muon-nesterov"]


def adamw(lr: float) -> list[str]:
    return ["--lr", str(lr), "--min-lr", str(lr / 10)]


def muon(scale: float, lr: float = 2e-3) -> list[str]:
    return adamw(lr) + MUON + ["--muon-extra-scale-factor", str(scale)]


# label -> flags; the first two are the headline pair (the demo's AdamW, Muon at the recommended settings)
HEADLINE_RUNS = {"AdamW lr 2e-3 (demo)": adamw(2e-3), "Muon scale 0.5 (recommended)": muon(0.5)}
SWEEP_RUNS = {"AdamW lr 1e-3": adamw(1e-3), "AdamW lr 4e-3": adamw(4e-3),
              "Muon scale 0.2 (match_rms_adamw)": muon(0.2), "Muon scale 1.0": muon(1.0)}


def train(label: str, flags: list[str], args) -> dict:
    """One serial pretrain_gpt.py run on the demo corpus; its training and validation loss by iteration."""
    from tools.plot_metrics import read_metrics
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        argv = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *DEMO, *flags,
                "--train-iters", str(args.iters), "--eval-interval", str(max(args.iters // 3, 1)),
                "--data-path", os.path.join(args.data, "stdlib_text_document"),
                "--tokenizer-model", os.path.join(args.data, "stdlib_sp.model"), "--metrics-file", metrics]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), WANDB_MODE="offline",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{label}: pretrain_gpt.py exited {done.returncode}:\n{done.stdout[-3000:]}"
                               f"{done.stderr[-3000:]}")
        m = read_metrics(metrics)
    print(f"{label}: lm loss {m['lm loss'][-1][1]:.4f}, validation {m['validation lm loss'][-1][1]:.4f}", flush=True)
    return {"flags": flags, "train": m["lm loss"], "valid": m["validation lm loss"]}


def final(run: dict, key: str) -> float:
    return run[key][-1][1]


def best(curves: dict, prefix: str) -> str:
    """The label of the run of that optimizer with the lowest final validation loss."""
    return min((label for label in curves if label.startswith(prefix)), key=lambda k: final(curves[k], "valid"))


def draw(curves: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_train, ax_valid) = plt.subplots(1, 2, figsize=(10, 3.8))
    others = iter(["C1", "C2", "C4", "C5", "C6", "C7", "C8", "C9"])    # C0 and C3 are the headline pair's
    for label, run in curves.items():
        headline = label in HEADLINE_RUNS
        style = dict(linestyle="-" if headline else ":", linewidth=2 if headline else 1,
                     color=("C0" if label.startswith("AdamW") else "C3") if headline else next(others))
        ax_train.plot(*zip(*run["train"]), label=label, **style)
        ax_valid.plot(*zip(*run["valid"]), marker="o", markersize=3, label=label, **style)
    for ax, title in ((ax_train, "training loss (mean of each 10 iterations)"), (ax_valid, "validation loss")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("iteration (16 x 128 tokens each)")
        ax.set_ylabel("lm loss")
        ax.grid(alpha=0.3)
    low = min(min(v for _, v in run["train"][len(run["train"]) // 3:]) for run in curves.values())
    ax_train.set_ylim(low - 0.2, low + 2.5)
    ax_valid.legend(fontsize=8)
    fig.suptitle("Muon vs AdamW: demo Llama on the stdlib corpus, same batches and schedule", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def report(curves: dict, args, command: str, trained: str) -> None:
    """The section of bench/RESULTS.md; ``command``: the one that trained the runs, at ``trained``."""
    adam, mu = best(curves, "AdamW"), best(curves, "Muon")
    rows = ["| run | flags beyond the demo's | training loss at the last iteration | validation loss |",
            "|---|---|---|---|"]
    for label, run in curves.items():
        rows.append(f"| {label} | `{' '.join(run['flags'])}` | {final(run, 'train'):.4f} | {final(run, 'valid'):.4f} |")
    iters = curves[adam]["train"][-1][0]
    body = [f"Trained {trained} (the machine line above is when this section was written). The demo's model and data (4 layers, hidden 128, SentencePiece vocab 4096, {iters} iterations of "
            "16 x 128 tokens, cosine lr to a tenth after 20 warm-up iterations, weight decay 0.1, clip 1.0), "
            f"serial, seed 1234: every run sees the same batches. Muon runs use momentum 0.95 with Nesterov "
            "(torch.optim.Muon's defaults) and the spectral scale times --muon-extra-scale-factor; their "
            "embedding, output layer and norms step with AdamW at the AdamW baseline's settings. Training loss is "
            "the mean over the last 10 iterations; validation loss is 5 batches of the held-out 2%. "
            f"Plot: bench/muon_vs_adamw.png (redraw: `python bench/muon_vs_adamw.py --plot-only`).", "", *rows]
    ratio = (f"{final(curves[mu], 'train'):.3f} vs {final(curves[adam], 'train'):.3f} training, "
             f"{final(curves[mu], 'valid'):.3f} vs {final(curves[adam], 'valid'):.3f} validation ({mu}; {adam})")
    headlines = [Headline(f"Muon loss at {iters} iterations, demo corpus, equal tokens", "AdamW, same batches",
                          ratio, command)]
    publish(args, "muon_vs_adamw", "Muon vs AdamW: loss on the demo corpus at equal tokens", command, headlines, body)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="three settings per optimizer (module docstring)")
    parser.add_argument("--plot-only", action="store_true", help="redraw from bench/muon_vs_adamw.json")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one process each)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per run")
    parser.add_argument("--data", default=os.path.join(ROOT, "data"), help="folder with the demo's corpus")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.iters = 20
    curves_path, plot_path = (CURVES, PLOT) if not args.quick else (
        os.path.join(BENCH, "quick", "muon_vs_adamw.json"), os.path.join(BENCH, "quick", "muon_vs_adamw.png"))
    if args.plot_only:
        with open(curves_path) as f:
            saved = json.load(f)
        curves, command, trained = saved["runs"], saved["command"], saved["trained"]
    else:
        runs = HEADLINE_RUNS | (SWEEP_RUNS if args.sweep else {})
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda item: train(*item, args), runs.items()))
        curves, command = dict(zip(runs, results)), command_line("muon_vs_adamw.py", argv)
        trained = time.strftime("%Y-%m-%d %H:%M")
        os.makedirs(os.path.dirname(curves_path), exist_ok=True)
        with open(curves_path, "w") as f:
            json.dump({"command": command, "trained": trained, "runs": curves}, f)
    draw(curves, plot_path)
    report(curves, args, command, trained)


if __name__ == "__main__":
    main(sys.argv[1:])
