"""GPU-path settings checkable without a GPU: timers synchronise the device only at the timing level asked
for, TF32 is a GPU-only setting that --no-tf32 turns off, the flags parse. (The GPU itself: tests/cuda.)"""
import torch

from megalite_test_utils import TINY_LLAMA_ARGS
from megalite.train.command_line import parse_args
from megalite.parallel.initialize import set_matmul_precision
from megalite.observe.clocks import Timers


def test_timers_synchronise_the_gpu_only_when_timing_is_asked_for(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(a))
    quiet = Timers(0, torch.device("cuda"))
    quiet.start("forward-backward", level=1)
    quiet.stop("forward-backward")
    assert calls == [] and quiet.report(1) == {}
    timed = Timers(1, torch.device("cuda"))
    timed.start("forward-backward", level=1)
    timed.start("optimizer", level=2)            # above the level: neither timed nor synchronised
    timed.stop("optimizer")
    timed.stop("forward-backward")
    assert len(calls) == 2 and list(timed.report(1)) == ["forward-backward"]
    on_cpu = Timers(2, torch.device("cpu"))
    on_cpu.start("optimizer", level=2)
    on_cpu.stop("optimizer")
    assert len(calls) == 2


def test_tf32_flag_and_cpu_matmuls_stay_full_fp32():
    assert parse_args(TINY_LLAMA_ARGS, world_size=1).training.tf32 is True
    assert parse_args(TINY_LLAMA_ARGS + ["--no-tf32"], world_size=1).training.tf32 is False
    before = torch.get_float32_matmul_precision()
    set_matmul_precision(True, torch.device("cpu"))
    assert torch.get_float32_matmul_precision() == before == "highest"
