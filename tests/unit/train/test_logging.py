"""Megatron's stdout line, the JSONL metrics file, wandb (offline) and tensorboard."""
import glob
import json
import os
import re
import sys

import pytest

from megalite_test_utils import TINY_LLAMA_ARGS, wandb_offline_history, with_flags
from megalite.train.command_line import parse_args
from megalite.train.performance import flops_per_iteration
from megalite.train.metrics import format_training_line
from megalite.train.trainer import pretrain

MEGATRON_LINE = re.compile(
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +(\d+)/ +(\d+) \|"
    r" consumed samples: +(\d+) \| elapsed time per iteration \(ms\): [\d.]+ \|"
    r"( throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \|)?"
    r" learning rate: \d\.\d{6}E[+-]\d\d \| global batch size: +(\d+) \|"
    r" lm loss: \d\.\d{6}E[+-]\d\d \| loss scale: [\d.]+ \|( grad norm: [\d.]+ \|)?"
    r" number of skipped iterations: +\d+ \| number of nan iterations: +\d+ \|"
    r"(?P<extras>( [^|:]+: [^|]+ \|)*)$")


def test_line_matches_megatron_field_for_field():
    line = format_training_line(iteration=10, train_iters=100, consumed_samples=320, elapsed_ms=123.4,
                                learning_rate=3e-4, global_batch_size=32, losses={"lm loss": 7.123456},
                                loss_scale=1.0, grad_norm=1.234, skipped_iterations=0, nan_iterations=0,
                                tflops_per_gpu=1.2)
    expected_tail = (" iteration       10/     100 | consumed samples:          320 |"
                     " elapsed time per iteration (ms): 123.4 | throughput per GPU (TFLOP/s/GPU): 1.2 |"
                     " learning rate: 3.000000E-04 | global batch size:    32 | lm loss: 7.123456E+00 |"
                     " loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |"
                     " number of nan iterations:   0 |")
    assert line.endswith(expected_tail)
    assert MEGATRON_LINE.match(line)


def test_flops_formula_reduces_to_megatrons_for_gpt():
    """72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h)) for a 4h-MLP GPT without GQA."""
    cfg = parse_args(with_flags(TINY_LLAMA_ARGS, group_query_attention=False, num_query_groups=None, swiglu=False,
                                ffn_hidden_size=256), world_size=1).model
    B, s, L, h, V = 8, cfg.seq_length, cfg.num_layers, cfg.hidden_size, cfg.padded_vocab_size
    megatron = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert flops_per_iteration(cfg, B) == pytest.approx(megatron)


def test_run_logs_lines_jsonl_wandb_and_tensorboard(tmp_path, capsys):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    argv = with_flags(TINY_LLAMA_ARGS, train_iters=6, log_interval=2, log_throughput=True,
                      wandb_project="megalite-test", wandb_exp_name="t1", wandb_save_dir=str(run_dir),
                      tensorboard_dir=str(tmp_path / "tb"), timing_log_level=1, peak_flops="2e11")
    os.environ["WANDB_MODE"] = "offline"
    pretrain(parse_args(argv, world_size=1))
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if " iteration " in l and "lm loss" in l]
    assert len(lines) == 3 and all(MEGATRON_LINE.match(l) for l in lines), lines
    assert [int(MEGATRON_LINE.match(l).group(1)) for l in lines] == [2, 4, 6]
    assert "forward-backward" in out                                # --timing-log-level 1

    # metrics.jsonl goes to the first of --save, --tensorboard-dir, --wandb-save-dir
    records = [json.loads(l) for l in open(tmp_path / "tb" / "metrics.jsonl")]
    assert [r["iteration"] for r in records] == [2, 4, 6]
    logged = [float(re.search(r"lm loss: (\S+)", l).group(1)) for l in lines]
    assert [r["lm loss"] for r in records] == pytest.approx(logged, rel=1e-6)
    assert all(r["tokens per second"] > 0 and "throughput (TFLOP/s/GPU)" in r for r in records)
    for record, line in zip(records, lines):
        extras = MEGATRON_LINE.match(line).group("extras")
        assert re.fullmatch(r" tokens per second: [\d.]+ \| MFU: [\d.]+% \| max rss \(MB\): [\d.]+ \|", extras), extras
        # PaLM's 6N + 12Lhs equals Megatron's count when heads * head dim = hidden: one figure, two names
        assert record["model TFLOP/s per device"] == pytest.approx(record["throughput (TFLOP/s/GPU)"], rel=1e-9)
        assert record["MFU"] == pytest.approx(record["model TFLOP/s per device"] * 1e12 / 2e11, rel=1e-9)
        assert 50 < record["memory max rss (MB)"] < 4096 and record["time forward-backward (ms)"] > 0

    # wandb offline: the run's history file holds our metrics
    # each history value is stored as its JSON text (Python's repr of the float) in the run file
    content = wandb_offline_history(str(run_dir / "wandb"))
    for record in records:
        assert repr(record["lm loss"]).encode() in content, record
        assert repr(record["learning rate"]).encode() in content, record

    events = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    assert events, "tensorboard wrote no event file"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    scalars = EventAccumulator(events[0])
    scalars.Reload()
    for key in ("lm loss", "MFU", "tokens per second", "memory max rss (MB)", "time forward-backward (ms)"):
        assert [e.step for e in scalars.Scalars(key)] == [2, 4, 6], key
    assert [e.value for e in scalars.Scalars("MFU")] == pytest.approx([r["MFU"] for r in records], rel=1e-6)


def test_a_missing_tensorboard_package_is_one_warning_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    """--tensorboard-dir without the package (Megatron's scripts pass it): as Megatron, a warning, and the
    metrics still reach the JSONL file."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)         # import fails as if absent
    argv = with_flags(TINY_LLAMA_ARGS, train_iters=2, tensorboard_dir=str(tmp_path / "tb"))
    state = pretrain(parse_args(argv, world_size=1))
    out = capsys.readouterr().out
    assert state.iteration == 2
    assert [l for l in out.splitlines() if "tensorboard package is not installed" in l] == [
        f" > warning: --tensorboard-dir {tmp_path / 'tb'}: the tensorboard package is not installed, so no "
        "tensorboard logs are written (pip install tensorboard); the metrics still go to the JSONL file"]
    assert len(open(tmp_path / "tb" / "metrics.jsonl").read().splitlines()) == 2
    assert not [f for f in os.listdir(tmp_path / "tb") if f.startswith("events.")]
