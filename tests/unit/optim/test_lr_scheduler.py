"""LR schedule values at chosen steps, worked out by hand from Megatron's formulas."""
import math

import pytest

from megalite.config.schema import OptimizerConfig
from megalite.optim.lr_scheduler import LRScheduler


def sched(style, warmup=10, decay=110, **kw):
    return LRScheduler(OptimizerConfig(lr=1.0, min_lr=0.1, lr_decay_style=style, lr_decay_iters=decay,
                                       lr_warmup_iters=warmup, **kw), train_iters=decay)


def test_linear_warmup_from_zero():
    s = sched("cosine")
    assert s.lr_at(0) == 0.0
    assert s.lr_at(5) == pytest.approx(0.5)
    assert s.lr_at(10) == pytest.approx(1.0)


def test_warmup_init():
    s = sched("constant", lr_warmup_init=0.2)
    assert s.lr_at(0) == pytest.approx(0.2) and s.lr_at(5) == pytest.approx(0.6)


@pytest.mark.parametrize("style, step, expected", [
    ("constant", 60, 1.0),
    ("constant", 500, 1.0),
    ("linear", 60, 0.1 + 0.9 * 0.5),
    ("linear", 110, 0.1),
    ("cosine", 60, 0.1 + 0.9 * 0.5),                         # cos(pi/2) = 0 -> halfway
    ("cosine", 35, 0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.25) + 1)),
    ("cosine", 110, 0.1),
    ("cosine", 111, 0.1),                                    # past decay: min_lr
    ("inverse-square-root", 40, math.sqrt(10) / math.sqrt(40)),
    ("inverse-square-root", 10000, 0.1),                     # floored at min_lr (past decay)
])
def test_decay_styles(style, step, expected):
    assert sched(style).lr_at(step) == pytest.approx(expected)


@pytest.mark.parametrize("wsd_style, expected_at_half", [
    ("linear", 0.1 + 0.9 * 0.5),
    ("cosine", 0.1 + 0.9 * 0.5),
    ("exponential", 0.1 + 0.9 * (2 * 0.5 ** 0.5 - 1)),
    ("minus_sqrt", 0.1 + 0.9 * (1 - 0.5 ** 0.5)),
])
def test_wsd_stable_then_anneal(wsd_style, expected_at_half):
    s = sched("WSD", lr_wsd_decay_style=wsd_style, lr_wsd_decay_iters=20)
    assert s.lr_at(50) == pytest.approx(1.0)                 # stable phase
    assert s.lr_at(90) == pytest.approx(1.0)                 # anneal starts at 110 - 20
    assert s.lr_at(100) == pytest.approx(expected_at_half)
    assert s.lr_at(110) == pytest.approx(0.1)


def test_step_counter_and_state_round_trip():
    s = sched("linear")
    for _ in range(7):
        s.step()
    assert s.lr == pytest.approx(0.7)
    t = sched("linear")
    t.load_state_dict(s.state_dict())
    assert t.lr == s.lr
