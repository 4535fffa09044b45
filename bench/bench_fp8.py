#!/usr/bin/env python
"""FP8 GEMMs on the CPU: what one forward GEMM of a linear (y = x W^T, quantising both operands, then the
product) costs per recipe, on its real path (torch._scaled_mm, where the CPU has the kernel for the
recipe's scale layout) and its emulated one (quantise, dequantise, fp32 matmul), against the same GEMM in
fp32 and in bf16 (torch.mm), side by side in one run. Information only: a CPU has no FP8 tensor cores, so
the FP8 paths cost more here, and quantisation (several element-wise passes) weighs more than on a GPU; the
speed-up is a GPU figure (bench/gpu_mfu.py --fp8 RECIPE).

    python bench/bench_fp8.py            # three shapes, every recipe
    python bench/bench_fp8.py --quick    # one small shape (smoke test)

Each figure is the median of --repeats timed calls after one warm-up call, the ratio the recipe's time over
fp32's on the same shape.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megalite.precision.fp8 import FP8_RECIPE_CLASSES, INPUT, WEIGHT, Fp8Recipe, has_kernel  # noqa: E402

KEY, TITLE = "fp8", "FP8: one GEMM per recipe on the CPU, real and emulated paths vs fp32 and bf16"
SHAPES = [(1024, 1024, 1024), (2048, 1024, 4096), (2048, 4096, 1024)]      # (tokens M, in K, out N)
QUICK_SHAPES = [(256, 256, 256)]


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def recipe_timings(shape: tuple[int, int, int], repeats: int) -> dict[str, float]:
    """Seconds of one forward GEMM of ``shape``: fp32, bf16, then each recipe's real and emulated paths."""
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.02
    out = {"fp32 torch.mm": median_seconds(lambda: x @ w.t(), repeats)}
    xb, wb = x.bfloat16(), w.bfloat16()
    out["bf16 torch.mm"] = median_seconds(lambda: xb @ wb.t(), repeats)
    for name in FP8_RECIPE_CLASSES:
        paths = [("emulated", True)]
        if has_kernel(name, "hybrid", x.device, INPUT, WEIGHT, torch.bfloat16):
            paths.insert(0, ("real", False))
        for path, emulate in paths:
            gemm = Fp8Recipe(name, emulate=emulate).build()
            out[f"{name} {path}"] = median_seconds(lambda gemm=gemm: gemm.mm(xb, INPUT, wb, WEIGHT, torch.bfloat16),
                                                   repeats)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    rows = {shape: recipe_timings(shape, args.repeats) for shape in shapes}
    names = list(next(iter(rows.values())))
    header = " | ".join(f"M={m} K={k} N={n}: ms (x fp32)" for m, k, n in shapes)
    body = [f"torch {torch.__version__}, {torch.get_num_threads()} threads; operands bf16 for bf16 and FP8 "
            "(format hybrid: E4M3 inputs and weights). On a CPU shared with other work the figures vary by up to 2x "
            "between runs: read them as orders of magnitude.", "", f"| GEMM | {header} |",
            "|---|" + "---|" * len(shapes)]
    for name in names:
        cells = [f"{1e3 * rows[s][name]:.2f} ({rows[s][name] / rows[s]['fp32 torch.mm']:.1f}x)" for s in shapes]
        body.append(f"| {name} | {' | '.join(cells)} |")
        print(body[-1])
    biggest = shapes[-1]
    headlines = [Headline("FP8 GEMM on CPU (tensorwise, real path)", "fp32 torch.mm, same shape",
                          f"{rows[biggest]['tensorwise real'] / rows[biggest]['fp32 torch.mm']:.1f}x the time "
                          f"(M={biggest[0]} K={biggest[1]} N={biggest[2]}; information only)",
                          command_line("bench_fp8.py", sys.argv[1:] if argv is None else argv))]
    publish(args, KEY, TITLE, headlines[0].command, headlines, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
