"""Ranks never outlive their launcher: torchrun SIGKILLed mid-run (as the OOM killer or a lost node agent
does) takes its ranks with it within seconds, each with one line (its launcher is gone, or the peer that
noticed first has died); nothing more is written under --save, and the newest published checkpoint loads
and trains on."""
import os
import signal
import subprocess
import sys
import time

import pytest

from harness import ROOT, pretrain_command
from kill_trials import Launch, file_text, kill_trials, tree, wait_gone
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags


def test_killing_torchrun_stops_its_ranks_and_their_writes(tmp_path):
    save = str(tmp_path / "ck")
    argv = with_flags(TINY_LLAMA_ARGS, train_iters=100000, save_interval=3, save=save)
    log = tmp_path / "log"
    launch = Launch(argv, log)
    try:
        launch.wait_for("saved checkpoint at iteration 6")
        ranks = launch.ranks()
        launch.proc.send_signal(signal.SIGKILL)
        launch.proc.wait()
        assert wait_gone(ranks.values()) is not None, "a rank outlived its launcher by 30 s"
    finally:
        launch.close()
    time.sleep(1)
    text = file_text(log)
    assert "its launcher (pid " in text, text[-3000:]
    for rank in (0, 1):          # each says why it stopped: its launcher is gone, or a peer that saw it first
        assert f"rank {rank}: its launcher (pid " in text or f"error: rank {rank}: a peer rank died" in text, text[-3000:]
    written = tree(save)
    time.sleep(2)
    assert tree(save) == written                                     # nothing more is written
    latest = int(file_text(os.path.join(save, "latest_checkpointed_iteration.txt")))
    resumed = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"),
                              *with_flags(argv, train_iters=latest + 1, save=None, save_interval=None), "--load", save],
                             capture_output=True, text=True, timeout=300,
                             env=pretrain_command(2, argv)[1])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"iteration {latest + 1:8d}/" in resumed.stdout, resumed.stdout[-2000:]


@pytest.mark.slow
def test_torchrun_killed_at_ten_random_moments_leaves_a_checkpoint_that_resumes_exactly(tmp_path):
    """10 trials (kill_trials.py): torchrun SIGKILLed mid-iteration, just after a save line, or while an
    iter_N.tmp is on disk, at --save-interval 1, 2 or 5; every rank exits within 30 s, nothing under
    --save changes afterwards, and the tracker's checkpoint resumes with the uninterrupted run's losses."""
    trials = kill_trials(tmp_path, trials=10, seed=20261126)
    assert {t.moment for t in trials} == {"iteration", "save line", "during save"}
    assert 1 in {t.save_interval for t in trials}
    print(f"ranks gone after torchrun's SIGKILL: max {max(t.rank_exit_s for t in trials):.2f} s, "
          f"every process below it: max {max(t.all_exit_s for t in trials):.2f} s")
