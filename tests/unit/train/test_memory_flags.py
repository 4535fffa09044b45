"""--manual-gc(-interval), --no-manual-gc-eval and --empty-unused-memory-level: when the collector and
the CUDA cache release run."""

import pytest
import torch

from megalite.train.command_line import parse_args
from megalite.errors import UserError
from megalite_test_utils import TINY_LLAMA_ARGS, run_pretrain, with_flags


class RecordingGC:
    def __init__(self):
        self.calls = []
        self.iteration = lambda: None

    def disable(self):
        self.calls.append("disable")

    def enable(self):
        self.calls.append("enable")

    def collect(self):
        self.calls.append(f"collect@{self.iteration()}")


def test_manual_gc_collects_only_at_the_interval_and_around_evaluation(monkeypatch):
    import megalite.train.loop as loop
    recorder = RecordingGC()
    monkeypatch.setattr(loop, "gc", recorder)
    seen = []
    original = loop.train_step

    def step(trainer, data):
        recorder.iteration = lambda: trainer.state.iteration
        seen.append(trainer.state.iteration)
        return original(trainer, data)
    monkeypatch.setattr(loop, "train_step", step)
    run_pretrain(with_flags(TINY_LLAMA_ARGS, train_iters=4, manual_gc=True, manual_gc_interval=2, eval_interval=3,
                   eval_iters=1))
    # start: disable + collect; iterations 2 and 4; evaluation at 3 and at the end: before and after
    assert recorder.calls == ["disable", "collect@None", "collect@2", "collect@3", "collect@3", "collect@4",
                              "enable", "collect@4", "collect@4", "collect@4", "collect@4"]
    recorder.calls.clear()
    recorder.iteration = lambda: None
    run_pretrain(with_flags(TINY_LLAMA_ARGS, train_iters=2, manual_gc=True, no_manual_gc_eval=True, eval_iters=1))
    assert recorder.calls == ["disable", "collect@None", "enable"]
    with pytest.raises(UserError, match="--manual-gc-interval needs --manual-gc"):
        parse_args(with_flags(TINY_LLAMA_ARGS, manual_gc_interval=2), world_size=1)


def test_empty_unused_memory_level(monkeypatch):
    import megalite.train.step as step
    calls = []
    monkeypatch.setattr(step, "release_cached_memory", lambda device: calls.append(device.type))
    for level, expected in ((0, 0), (1, 2), (2, 4)):
        calls.clear()
        run_pretrain(with_flags(TINY_LLAMA_ARGS, train_iters=2, empty_unused_memory_level=level))
        assert len(calls) == expected, level               # after forward-backward (1), and after the step (2)
    monkeypatch.undo()

    def no_cuda():
        raise AssertionError("CUDA touched on a CPU run")
    monkeypatch.setattr(torch.cuda, "empty_cache", no_cuda)
    step.release_cached_memory(torch.device("cpu"))      # CPUs: nothing to release, CUDA untouched
