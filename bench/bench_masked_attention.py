#!/usr/bin/env python
"""Masked attention vs the unmasked flash kernel: forward + backward time and activation memory of
core_attention at s = 8K with packed documents of mean length 1K (megalite/model/attention/masked.py).

The baseline is plain causal attention over the whole sample (SDPA's flash kernel). The masked rows run
the same q, k, v with the documents' boundaries (each token sees only its own document), with a sliding
window, and with learnable sinks; on CPU they take the blockwise path (fused block kernels per tile,
merged by log-sum-exp). Memory is what a training step holds between forward and backward -- the bytes
of the tensors autograd saves (distinct storages, torch.autograd.graph.saved_tensors_hooks) -- and the
forward's peak of live tensors created by its ops (LiveBytes). Time is the fastest of the repeats, after
one warm-up (the least disturbed by other work on a shared machine). Writes a section of bench/RESULTS.md.

    python bench/bench_masked_attention.py
    python bench/bench_masked_attention.py --quick      # smoke test: s = 2048, documents of mean 256
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from activation_memory import count_saved  # noqa: E402
from cross_entropy_memory import LiveBytes  # noqa: E402
from megalite.model.attention.core import core_attention  # noqa: E402
from megalite.model.attention.mask import MaskSpec  # noqa: E402

HEADS, GROUPS, HEAD_DIM, BATCH = 8, 2, 64, 1
WINDOW = 128


def document_rows(seq: int, mean: int, seed: int = 0) -> torch.Tensor:
    """int32 [1, n + 1] boundaries of documents of lengths uniform in [mean / 4, 7 mean / 4), the last cut
    to end at ``seq`` (a packed sample)."""
    g = torch.Generator().manual_seed(seed)
    bounds = [0]
    while bounds[-1] < seq:
        length = int(torch.randint(mean // 4, 7 * mean // 4, (), generator=g))
        bounds.append(min(seq, bounds[-1] + length))
    return torch.tensor([bounds], dtype=torch.int32)


def measure(mask: MaskSpec, sinks, q, k, v, grad, repeats: int) -> dict:
    with count_saved() as saved, LiveBytes() as live:
        out = core_attention(q, k, v, mask, sinks=sinks)
    del out
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        core_attention(q, k, v, mask, sinks=sinks).backward(grad)
        times.append(time.perf_counter() - start)
    return {"saved": saved.bytes(), "peak": live.peak, "time": min(times[1:])}


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    add_common_args(parser)
    args = parser.parse_args(argv)
    seq, mean = (2048, 256) if args.quick else (8192, 1024)
    cu = document_rows(seq, mean)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(seq, BATCH, HEADS, HEAD_DIM, generator=g).requires_grad_()
    k, v = (torch.randn(seq, BATCH, GROUPS, HEAD_DIM, generator=g).requires_grad_() for _ in range(2))
    grad = torch.randn(seq, BATCH, HEADS * HEAD_DIM, generator=g)
    sinks = torch.zeros(HEADS, requires_grad=True)
    rows = {"flash, causal (baseline)": (MaskSpec(), None),
            "documents": (MaskSpec(cu_seqlens=cu), None),
            "documents + sinks": (MaskSpec(cu_seqlens=cu), sinks),
            f"window ({WINDOW}, 0)": (MaskSpec(window=(WINDOW, 0)), None),
            f"documents + window ({WINDOW}, 0)": (MaskSpec(window=(WINDOW, 0), cu_seqlens=cu), None)}
    results = {name: measure(mask, s, q, k, v, grad, 1 if args.quick else args.repeats)
               for name, (mask, s) in rows.items()}
    base = results["flash, causal (baseline)"]
    lengths = cu[0].diff().tolist()
    pairs = sum(n * (n + 1) for n in lengths) / (seq * (seq + 1))
    body = [f"s = {seq}, batch {BATCH}, {HEADS} heads on {GROUPS} KV groups, head dim {HEAD_DIM}, fp32, "
            f"{len(lengths)} documents (mean {seq / len(lengths):.0f} tokens), which keep {pairs:.0%} of the "
            "causal query-key pairs.", "",
            "| attention | fwd+bwd | vs flash | saved for backward | vs flash | forward peak | vs flash |",
            "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        body.append(f"| {name} | {r['time'] * 1e3:.0f} ms | {r['time'] / base['time']:.2f}x | "
                    f"{r['saved'] / 2**20:.1f} MiB | {r['saved'] / base['saved']:.2f}x | "
                    f"{r['peak'] / 2**20:.1f} MiB | {r['peak'] / base['peak']:.2f}x |")
        print(body[-1])
    docs = results["documents"]
    command = command_line("bench_masked_attention.py", argv)
    headlines = [Headline("masked attention, documents: fwd+bwd time", "unmasked flash",
                          f"{docs['time'] / base['time']:.2f}x", command),
                 Headline("masked attention, documents: activation memory", "unmasked flash",
                          f"{docs['saved'] / base['saved']:.2f}x saved, {docs['peak'] / base['peak']:.2f}x peak",
                          command)]
    publish(args, "bench_masked_attention", "Masked attention: documents, windows and sinks vs flash",
            command, headlines, body)


if __name__ == "__main__":
    main(sys.argv[1:])
