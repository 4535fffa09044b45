"""bench/bench_moe.py's equivalence check: megalite's MoE layer and transformers' Mixtral and Qwen3-MoE
sparse MoE blocks (every experts implementation) agree on shared weights, and the check catches a
layer that does not."""
import os
import sys

import pytest
import torch

from megalite_test_utils import ROOT

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_moe  # noqa: E402

TINY = bench_moe.Shape(hidden=32, ffn=48, experts=4, topk=2, tokens=24)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_transformers_blocks_match_megalite_on_shared_weights(dtype):
    ours, theirs, skipped, errors = bench_moe.contenders(TINY, dtype, batched_mm_gb=1.0, quiet=lambda *a, **k: None)
    assert set(ours) == set(bench_moe.FAMILIES) and not skipped
    assert {c.name for c in theirs} == {f"{f} {i}" for f in bench_moe.FAMILIES for i in bench_moe.IMPLEMENTATIONS}
    assert all(max(e.values()) <= bench_moe.TOLERANCE[dtype][1] for e in errors.values())


def test_equivalence_check_fails_on_a_different_layer():
    ours, theirs, _, _ = bench_moe.contenders(TINY, "fp32", batched_mm_gb=0.0, quiet=lambda *a, **k: None)
    with torch.no_grad():
        ours["mixtral"].module.experts.linear_fc2.weight[1] *= 1.01       # one expert's down projection
    with pytest.raises(AssertionError, match="mixtral eager"):
        bench_moe.check_equivalence(ours["mixtral"], theirs[0], "fp32")


def test_batched_mm_is_left_out_where_its_weight_copies_exceed_the_budget():
    _, theirs, skipped, _ = bench_moe.contenders(TINY, "fp32", batched_mm_gb=0.0, quiet=lambda *a, **k: None)
    assert len(skipped) == 2 and all("batched_mm: not run" in line for line in skipped)
    assert "batched_mm" not in " ".join(c.name for c in theirs)
