"""tools/plot_metrics.py: a real run's metrics.jsonl -> PNG panels."""
import json
import os
import subprocess
import sys

import pytest

from megalite_test_utils import ROOT, TINY_LLAMA_ARGS, with_flags

TOOL = os.path.join(ROOT, "tools", "plot_metrics.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tool(*args):
    return subprocess.run([sys.executable, TOOL, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def run_metrics(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    argv = with_flags(TINY_LLAMA_ARGS, train_iters=6, log_interval=2, eval_interval=3, eval_iters=1,
                      metrics_file=run / "metrics.jsonl", peak_flops="1e11")
    subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv], check=True,
                   capture_output=True, timeout=120)
    return run / "metrics.jsonl"


def test_panels_from_a_real_run(run_metrics, tmp_path):
    result = _tool(run_metrics, "--output-dir", tmp_path / "plots")
    assert result.returncode == 0, result.stderr
    names = sorted(os.listdir(tmp_path / "plots"))
    assert names == sorted(["loss.png", "lr.png", "grad_norm.png", "throughput.png", "mfu.png", "memory.png",
                            "overview.png"])
    for name in names:
        assert open(tmp_path / "plots" / name, "rb").read(8) == PNG_MAGIC, name
    assert all(f"wrote {tmp_path / 'plots' / n}" in result.stdout for n in names)


def test_resumed_run_keeps_the_last_record_per_iteration(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from plot_metrics import read_metrics
    path = tmp_path / "metrics.jsonl"
    records = [{"iteration": 2, "lm loss": 5.0}, {"iteration": 4, "lm loss": 4.0},   # crashed after 4
               {"iteration": 4, "lm loss": 3.9}, {"iteration": 6, "lm loss": 3.5, "validation lm loss": 3.6}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    metrics = read_metrics(str(path))
    assert metrics["lm loss"] == [(2, 5.0), (4, 3.9), (6, 3.5)]
    assert metrics["validation lm loss"] == [(6, 3.6)]


def test_two_runs_on_one_plot_and_bad_input(run_metrics, tmp_path):
    assert _tool(run_metrics, run_metrics, "--labels", "a", "b", "--output-dir", tmp_path / "cmp").returncode == 0
    for args, fragment in [([tmp_path / "missing.jsonl"], "no such metrics file"),
                           ([run_metrics, run_metrics, "--labels", "only-one"], "--labels"),
                           ([ROOT + "/README.md"], "line 1 is not a metrics record")]:
        result = _tool(*args, "--output-dir", tmp_path / "x")
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1 and fragment in lines[0], result.stderr
