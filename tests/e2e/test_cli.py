"""pretrain_gpt.py as a user runs it: a short run works; mistakes give exit 1 and one line on stderr."""
import os
import subprocess
import sys

import pytest

from megalite_test_utils import ROOT, TINY_LLAMA_ARGS, with_flags


def run(argv, **env):
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "WANDB_MODE": "offline", **env})


def test_short_run_prints_megatron_lines():
    proc = run(with_flags(TINY_LLAMA_ARGS, train_iters=3) + ["--use-flash-attn"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("lm loss:") == 3
    assert "accepted with no effect" in proc.stdout and "--use-flash-attn" in proc.stdout


@pytest.mark.parametrize("overrides, env, fragment", [
    ({"global_batch_size": 30, "micro_batch_size": 4}, {}, "--global-batch-size 30 must be divisible"),
    ({"save": "/proc/megalite-ckpt"}, {}, "--save /proc/megalite-ckpt: cannot write there"),
    ({"load": "/nonexistent/ckpt"}, {}, "--load /nonexistent/ckpt: no such directory"),
    ({"tensor_model_parallel_size": 2}, {}, "world size 1 is not divisible by --tensor-model-parallel-size 2"),
    ({"mock_data": False, "data_path": "/nonexistent/prefix"}, {}, "/nonexistent/prefix"),
    ({"normalization": "Nope"}, {}, "--normalization"),
])
def test_user_mistakes_exit_1_with_one_line(overrides, env, fragment):
    proc = run(with_flags(TINY_LLAMA_ARGS, **overrides), **env)
    assert proc.returncode == 1
    err = proc.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ") and fragment in err
