"""The FP8 benchmarks' command lines: bench/gpu_mfu.py --fp8 RECIPE trains megalite with that recipe and
format (and its bf16 side without FP8), bench/fp8_convergence.py emulates exactly the recipes without a CPU
kernel, and bench/bench_fp8.py times every recipe's paths."""
import os
import sys

import pytest
import torch

from megalite.precision.fp8 import FP8_RECIPE_CLASSES, PAIRS, has_kernel
from megalite.train.command_line import parse_args
from megalite_test_utils import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_fp8  # noqa: E402
import fp8_convergence  # noqa: E402
import gpu_mfu  # noqa: E402


@pytest.mark.parametrize("recipe, fp8_format", [("tensorwise", "hybrid"), ("blockwise", "e4m3")])
def test_gpu_mfu_fp8_side_runs_the_recipe(recipe, fp8_format):
    run = gpu_mfu.Run("megalite", gpu_mfu.QUICK, 1, 2, False, 1, 1, fp8=recipe, fp8_format=fp8_format)
    model = parse_args(gpu_mfu.megalite_argv(run), world_size=1).model
    assert (model.fp8_recipe, model.fp8_format, model.fp8_emulate) == (recipe, fp8_format, False)
    bf16 = parse_args(gpu_mfu.megalite_argv(gpu_mfu.Run("megalite", gpu_mfu.QUICK, 1, 2, False, 1, 1)), world_size=1)
    assert bf16.model.fp8_format is None
    assert run.label == f"megalite fp8 {recipe}"


def test_convergence_emulates_only_recipes_without_a_cpu_kernel():
    for recipe in FP8_RECIPE_CLASSES:
        kernel = all(has_kernel(recipe, "hybrid", torch.device("cpu"), a, b, torch.bfloat16) for a, b in PAIRS)
        assert ("--fp8-emulate" in fp8_convergence.recipe_flags(recipe, "hybrid")) == (not kernel)
    assert fp8_convergence.recipe_flags("bf16", "hybrid") == []


def test_bench_fp8_times_every_recipe():
    timings = bench_fp8.recipe_timings((32, 64, 32), repeats=1)
    assert {"fp32 torch.mm", "bf16 torch.mm"} | {f"{r} emulated" for r in FP8_RECIPE_CLASSES} <= set(timings)
    assert all(t > 0 for t in timings.values())
