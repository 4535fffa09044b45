"""In-job restart: under ``torchrun --max-restarts N``, a rank SIGKILLed mid-run (a segfault, the OOM
killer, a GPU fault) takes its peers down and torchrun starts all of them again; with ``--save D --load D``
they resume from the newest published checkpoint. torchrun then exits 0 on its own, and every loss logged
after a restart, the last one included, is the uninterrupted run's.

torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (kill_trials.RESTARTABLE): by default torch 2.13
keeps one TCPStore for all the starts of a job, the restarted ranks read the addresses their dead
predecessors published in it, and the restart fails to connect (README, "In-job restarts").
"""
import os
import re
import signal
from dataclasses import dataclass

import pytest

from harness import logged_losses
from kill_trials import Launch, complete_lines, loss_mismatches, reference_losses, saving, tracker_iteration, wait_gone
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from process_memory import descendants

LOADED = r"loaded checkpoint \S+ at iteration (\d+)"


@dataclass
class Kill:
    rank: int                    # the rank SIGKILLed
    iterations: int              # once the start has logged this many iterations past its resume point
    during_save: bool = False    # then as soon as a later save's iter_N.tmp is on disk


def restarted_run(tmp_path, argv: list[str], kills: list[Kill], max_restarts: int = 3) -> dict:
    """Run ``argv`` with --save D --load D under torchrun --max-restarts, killing one rank per entry of
    ``kills``, each in the next start; returns the log, torchrun's exit status, the iteration the tracker
    named as each restart began, and the processes that were below the killed ranks."""
    save = str(tmp_path / "ck")
    launch = Launch(with_flags(argv, save=save, load=save), tmp_path / "log", ["--max-restarts", str(max_restarts)])
    start, resumed_from, orphans = 0, [0], []
    try:
        for restart, kill in enumerate(kills):
            ranks = launch.ranks(restart)
            if restart:
                resumed_from.append(tracker_iteration(save))      # what the new start finds, before it loads
                start = launch.wait_for(LOADED, start).end()
            trigger = resumed_from[-1] + kill.iterations
            launch.wait_for(rf"iteration +{trigger}/", start)
            if kill.during_save:
                launch.wait_until(lambda: saving(save, trigger), "a save under way")
            orphans += descendants(ranks[kill.rank])                 # its data-loader workers, if any
            os.kill(ranks[kill.rank], signal.SIGKILL)
            start = len(launch.text())
        launch.ranks(len(kills))
        resumed_from.append(tracker_iteration(save))
        returncode = launch.proc.wait(timeout=300)
    finally:
        launch.close()
    return dict(save=save, log=launch.text(), returncode=returncode, resumed_from=resumed_from, orphans=orphans)


def check_restarted_run(run: dict, expected: dict, kills: int, train_iters: int) -> None:
    log = run["log"]
    assert run["returncode"] == 0, log[-4000:]
    loads = list(re.finditer(LOADED, log))
    assert "starting from scratch" in log[:loads[0].start()] and len(loads) == kills, log[-4000:]   # restarted
    first = logged_losses(complete_lines(log[:loads[0].start()]))
    assert first and not loss_mismatches(first, expected), loss_mismatches(first, expected)
    for restart, load in enumerate(loads, start=1):
        resumed = int(load.group(1))
        assert resumed == run["resumed_from"][restart] > 0, (restart, resumed, run["resumed_from"])
        end = loads[restart].start() if restart < kills else len(log)
        losses = logged_losses(complete_lines(log[load.end():end]))
        assert min(losses) == resumed + 1, (restart, resumed, sorted(losses)[:3])
        assert not loss_mismatches(losses, expected), (restart, loss_mismatches(losses, expected))
    assert sorted(losses) == list(range(resumed + 1, train_iters + 1))          # the last start ran to the end
    assert tracker_iteration(run["save"]) == train_iters
    assert not [n for n in os.listdir(run["save"]) if n.endswith(".tmp")], os.listdir(run["save"])
    assert wait_gone(run["orphans"]) is not None, "a killed rank's worker processes outlived it by 30 s"


RUN = with_flags(TINY_LLAMA_ARGS, train_iters=100, save_interval=20)


def test_a_killed_rank_is_restarted_by_torchrun_and_the_run_ends_as_if_uninterrupted(tmp_path):
    """Rank 0 (it hosts the ranks' TCPStore) SIGKILLed at iteration 30; the restart resumes at 20."""
    expected = reference_losses(RUN)
    run = restarted_run(tmp_path, RUN, [Kill(rank=0, iterations=30)])
    check_restarted_run(run, expected, kills=1, train_iters=100)
    assert run["resumed_from"] == [0, 20]


@pytest.mark.slow
def test_three_kills_one_during_a_save_use_three_restarts_and_end_as_if_uninterrupted(tmp_path):
    """Three starts lose a rank each (the second while a checkpoint is being written, leaving its
    iter_N.tmp behind), with a data-loader worker per rank; the fourth start finishes, with no restart
    left over."""
    argv = with_flags(RUN, train_iters=300, save_interval=10, num_workers=1)
    expected = reference_losses(argv)
    kills = [Kill(rank=1, iterations=25), Kill(rank=0, iterations=12, during_save=True), Kill(rank=1, iterations=37)]
    run = restarted_run(tmp_path, argv, kills, max_restarts=3)
    check_restarted_run(run, expected, kills=3, train_iters=300)
