"""Crash-resume: a multi-rank run SIGKILLed at random moments (start-up, training, mid-save) and simply
restarted with the same command each time ends with exactly the uninterrupted run's losses and weights.

Marked slow (about a minute): `pytest -m "not slow"` skips it for a quick local loop; `make test` runs it.
"""
import os
import random
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch

from harness import ROOT, free_port, logged_losses, run_pretrain
from megalite.checkpoint.files import CheckpointReader
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

RUN = with_flags(TINY_LLAMA_ARGS, train_iters=300, global_batch_size=8, hidden_dropout=0.1) + \
    ["--use-distributed-optimizer", "--save-interval", "7"]
ENV = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
KILLS = 5
PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")


def launch(argv):
    """Both ranks in one new process group, as one node's job step: one killpg takes all of them at once.
    (Not torchrun: it starts each worker in a session of its own, out of reach of the group kill.)"""
    port, ranks = free_port(), []
    for rank in range(2):
        env = f"RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={port}"
        ranks.append(f"env {env} {shlex.quote(sys.executable)} {shlex.quote(PRETRAIN)} {shlex.join(argv)} &")
    return subprocess.Popen(["bash", "-c", " ".join(ranks) + " wait"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=ENV, start_new_session=True)


def wait_for_iteration(proc, target: int) -> str:
    """Read the run's output until it logs iteration ``target`` (or a later one); returns what was read."""
    read = []
    for line in proc.stdout:
        read.append(line)
        if any(f"iteration {k:8d}/" in line for k in range(target, target + 7)):
            return "".join(read)
    raise AssertionError(f"the run ended before iteration {target}:\n{''.join(read)[-2000:]}")


@pytest.mark.slow
def test_sigkill_at_random_moments_then_restart_ends_like_the_uninterrupted_run(tmp_path):
    reference_dir, ckpt = str(tmp_path / "reference"), str(tmp_path / "ck")
    reference = run_pretrain(2, RUN + ["--save", reference_dir])
    assert reference.returncode == 0, reference.stdout[-2000:] + reference.stderr[-2000:]
    expected = logged_losses(reference.stdout)

    argv = RUN + ["--save", ckpt, "--load", ckpt]
    chance, seen = random.Random(20261121), {}
    # where each attempt dies: once during start-up, else just after a random iteration (a few ms later:
    # mid-iteration or mid-save), later each time so the run progresses
    plan = [None] + sorted(chance.sample(range(10, 280), KILLS - 1))
    for target in plan:
        proc = launch(argv)
        output = ""
        if target is None:
            time.sleep(chance.uniform(0.5, 2.0))
        else:
            output = wait_for_iteration(proc, target)
            time.sleep(chance.uniform(0.0, 0.05))
        assert proc.poll() is None, "the run ended before it was killed"
        os.killpg(proc.pid, signal.SIGKILL)
        seen.update(logged_losses(output + proc.communicate()[0]))
    final = run_pretrain(2, argv)
    assert final.returncode == 0, final.stdout[-2000:] + final.stderr[-2000:]
    resumed = logged_losses(final.stdout)
    seen.update(resumed)

    assert "loaded checkpoint" in final.stdout and max(resumed) == 300
    assert set(seen) == set(expected)                                   # every iteration ran at least once
    assert all(seen[i] == expected[i] for i in seen)                    # and gave the same loss every time
    mine = CheckpointReader(os.path.join(ckpt, "iter_0000300"))                 # weights and optimizer state
    theirs = CheckpointReader(os.path.join(reference_dir, "iter_0000300"))
    assert sorted(mine.names()) == sorted(theirs.names())
    assert all(torch.equal(mine.tensor(n), theirs.tensor(n)) for n in mine.names())
    assert not any(name.endswith(".tmp") for name in os.listdir(ckpt))
