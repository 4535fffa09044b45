"""Auxiliary-loss-free load balancing (DeepSeek-V3's expert bias) on mock data, through
bench/moe_load_balance.py's runs: a tiny sigmoid-router MoE, 8 experts top-2, no auxiliary loss. With
--moe-router-enable-expert-bias (megalite's default rate, 1e-3) every layer's max/mean tokens per expert,
read from the log's JSONL, settles at or below 1.2; the same run without the bias stays above 1.2.

One thread: the matmuls are tiny, so a second thread only adds synchronisation (and the suite runs two
workers on two cores)."""
import os
import sys

import pytest
import torch

from megalite_test_utils import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import moe_load_balance  # noqa: E402

SMALL = moe_load_balance.Shape(hidden=32, expert_ffn=32)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def check_balance(shape, steps: int) -> None:
    off = moe_load_balance.train(shape, steps, bias=False)
    on = moe_load_balance.train(shape, steps, bias=True)
    assert sorted(on.spread) == sorted(off.spread) == list(range(shape.layers))
    assert all(len(values) == steps for values in (*on.spread.values(), *off.spread.values()))
    balanced = shape.seq * shape.batch * shape.topk / shape.experts
    for layer, loads in on.loads.items():       # the JSONL's figure is the routers' tokens per expert
        assert [max(step) / balanced for step in loads] == pytest.approx(on.spread[layer], rel=1e-6)
        assert all(sum(step) == shape.seq * shape.batch * shape.topk for step in loads)
    assert on.worst_settled() <= moe_load_balance.BAR < off.worst_settled(), (on.spread, off.spread)
    for layer in on.spread:
        assert on.first_balanced_step(layer) is not None and off.first_balanced_step(layer) is None


def test_expert_bias_balances_the_tokens_within_60_steps(one_thread):
    check_balance(SMALL, 60)


@pytest.mark.slow
def test_expert_bias_balances_the_benchmark_model_within_100_steps(one_thread):
    check_balance(moe_load_balance.Shape(), 100)
