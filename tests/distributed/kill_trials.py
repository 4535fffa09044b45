"""SIGKILL a pretrain_gpt.py launch at chosen moments and check what it leaves behind.

- ``Launch``: pretrain_gpt.py under ``torchrun --nproc_per_node 2`` (extra torchrun flags, e.g.
  ``--max-restarts 3``), its output in a file that the test reads as it grows (``wait_for``), and the
  worker ranks of each start (``ranks``: torchrun's children, by RANK and TORCHELASTIC_RESTART_COUNT).
- ``kill_trials``: torchrun itself SIGKILLed at random moments (mid-iteration, just after a save line,
  while an ``iter_N.tmp`` exists), ``trials`` times; each trial checks that every rank exits within
  EXIT_LIMIT seconds, that nothing under --save changes once they are gone, and that the newest
  published checkpoint (the tracker's) resumes exactly: a relaunch with ``--load D --save D2`` logs the
  uninterrupted run's losses. ``extra_flags`` go to every run (e.g. ``--async-save``).

torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torch 2.13's default shares one TCPStore across
the restarts of a job, and a restarted rank then reads its dead predecessor's gloo/NCCL address from it
(README, "In-job restarts").
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from dataclasses import dataclass

from harness import ROOT, logged_losses, pretrain_command, run_pretrain
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from process_memory import children, descendants

PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")
TRACKER = "latest_checkpointed_iteration.txt"
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
EXIT_LIMIT = 30.0                # seconds a rank may outlive its launcher
POLL = 0.005
SAVE_LINE = r" > sav(?:ing|ed) checkpoint at iteration +(\d+)"


def file_text(path) -> str:
    with open(path) as f:
        return f.read()


def tree(root: str) -> dict:
    """Every file under ``root`` with its size and modification time."""
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            try:
                stat = os.stat(path)
            except FileNotFoundError:          # removed between the listing and the stat: a change too
                found[path] = None
                continue
            found[path] = (stat.st_size, stat.st_mtime_ns)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, limit: float = EXIT_LIMIT) -> float | None:
    """Seconds until none of ``pids`` is alive (None: some still were after ``limit``)."""
    start = time.monotonic()
    while any(alive(p) for p in pids):
        if time.monotonic() - start > limit:
            return None
        time.sleep(0.01)
    return time.monotonic() - start


def environ(pid: int) -> dict:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v]
        return {k.decode(): v.decode(errors="replace") for k, v in pairs}
    except OSError:
        return {}


def tracker_iteration(save: str) -> int | None:
    path = os.path.join(save, TRACKER)
    return int(file_text(path)) if os.path.isfile(path) else None


def published(save: str) -> list[int]:
    """Iterations of the complete iter_N directories under ``save`` (their metadata written), ascending."""
    names = os.listdir(save) if os.path.isdir(save) else []
    return sorted(int(n[5:]) for n in names if n.startswith("iter_") and n[5:].isdigit()
                  and os.path.isfile(os.path.join(save, n, "metadata.json")))


def saving(save: str, after: int = 0) -> bool:
    """A save of an iteration past ``after`` is under way: its iter_N.tmp directory exists, or the
    tracker's temporary file (a leftover iter_N.tmp of a killed run is no sign of one)."""
    try:
        names = os.listdir(save)
    except OSError:
        return False
    return TRACKER + ".tmp" in names or any(n.startswith("iter_") and n.endswith(".tmp") and n[5:-4].isdigit()
                                            and int(n[5:-4]) > after for n in names)


def complete_lines(text: str) -> str:
    """``text`` without a last line cut short by a kill."""
    return text if text.endswith("\n") else text[:text.rfind("\n") + 1]


def loss_mismatches(got: dict, expected: dict) -> dict:
    """iteration -> (got, expected) where they differ, or where ``expected`` has no such iteration."""
    return {i: (v, expected.get(i)) for i, v in got.items() if expected.get(i) != v}


def reference_losses(argv: list[str]) -> dict:
    """The uninterrupted run's logged loss per iteration (no --save: saving changes no loss)."""
    run = run_pretrain(2, with_flags(argv, save=None, load=None, save_interval=None))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return logged_losses(run.stdout)


class Launch:
    """pretrain_gpt.py under ``torchrun --standalone --nproc_per_node 2 [torchrun_flags]``, its stdout and
    stderr in the file ``log`` (a pipe left unread would stall the run)."""

    def __init__(self, argv: list[str], log, torchrun_flags=()):
        cmd, env = pretrain_command(2, argv)
        at = cmd.index(PRETRAIN)
        cmd[at:at] = list(torchrun_flags)
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**env, **RESTARTABLE})
        self._reader = open(log)
        self._text = ""

    def text(self) -> str:
        """Everything logged so far (after ``close``: everything logged)."""
        if not self._reader.closed:
            self._text += self._reader.read()
        return self._text

    def close(self) -> None:
        """SIGKILL whatever is left (a failed test), torchrun last so no rank is restarted meanwhile."""
        if self.proc.poll() is None:
            for pid in reversed(descendants(self.proc.pid)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.kill()
            self.proc.wait()
        self.text()
        self._reader.close()

    def alive_or_fail(self, what: str, deadline: float) -> None:
        rc = self.proc.poll()
        assert rc is None, f"the run ended (exit {rc}) before {what}:\n{self.text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} in time:\n{self.text()[-3000:]}"

    def wait_for(self, pattern: str, start: int = 0, timeout: float = 300) -> re.Match:
        """The first match of ``pattern`` in the output from offset ``start`` on, once it is logged."""
        regex, deadline = re.compile(pattern), time.monotonic() + timeout
        while not (match := regex.search(self.text(), start)):
            self.alive_or_fail(repr(pattern), deadline)
            time.sleep(POLL)
        return match

    def wait_until(self, condition, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            self.alive_or_fail(what, deadline)
            time.sleep(POLL / 5)

    def ranks(self, restart: int = 0, timeout: float = 300) -> dict[int, int]:
        """rank -> pid of the 2 workers of torchrun's ``restart``-th start (TORCHELASTIC_RESTART_COUNT)."""
        deadline, found = time.monotonic() + timeout, {}
        while len(found) < 2:
            self.alive_or_fail(f"start {restart}'s ranks", deadline)
            for pid in children(self.proc.pid):
                env = environ(pid)
                if env.get("TORCHELASTIC_RESTART_COUNT") == str(restart) and "RANK" in env:
                    found[int(env["RANK"])] = pid
            time.sleep(POLL)
        return found


@dataclass
class Trial:
    number: int
    moment: str                  # where the kill landed: "iteration", "save line" or "during save"
    save_interval: int
    last_logged: int | None      # the last iteration the killed run logged
    resumed_from: int            # the tracker's iteration after the kill
    rank_exit_s: float           # SIGKILL of torchrun -> its last rank gone
    all_exit_s: float            # ... -> every process below torchrun gone (loader workers too)
    cut_short: list              # the .tmp entries the kill left (a save it interrupted)

    def row(self) -> str:
        return (f"trial {self.number:2d}: --save-interval {self.save_interval}, killed {self.moment:<11} "
                f"after iteration {self.last_logged}, resumed from {self.resumed_from}: ranks gone in "
                f"{self.rank_exit_s:.2f} s, every process below torchrun in {self.all_exit_s:.2f} s"
                + (f"; left {', '.join(self.cut_short)}" if self.cut_short else ""))


MOMENTS = ("iteration", "save line", "during save")


def first_checkpoint(launch: Launch, save: str) -> tuple[int, int]:
    """Wait until a checkpoint is published (so there is one to resume); (its iteration, the offset in
    the output after its save line)."""
    line = launch.wait_for(SAVE_LINE)
    launch.wait_until(lambda: tracker_iteration(save) is not None, "a published checkpoint")
    return int(line.group(1)), line.end()


def wait_for_moment(launch: Launch, save: str, moment: str, target: int, start: int, chance: random.Random) -> None:
    """Return at the moment to kill: a few ms after iteration ``target``'s line, at once after the first
    save line that follows it (the next step or save is under way), or while a save that follows it has
    its iter_N.tmp (or the tracker's .tmp) on disk."""
    after = launch.wait_for(rf"iteration +{target}/", start).end()
    if moment == "iteration":
        time.sleep(chance.uniform(0.0, 0.03))
    elif moment == "save line":
        launch.wait_for(SAVE_LINE, after)
    else:
        launch.wait_until(lambda: saving(save, target - 1), "a save under way")


def run_trial(tmp_path, number: int, argv: list[str], chance: random.Random, expected: dict) -> Trial:
    folder = tmp_path / f"trial{number}"
    folder.mkdir()
    save, resumed_save = str(folder / "ck"), str(folder / "ck2")
    interval, moment = chance.choice((1, 1, 2, 5)), MOMENTS[number % len(MOMENTS)]
    train_iters = int(argv[argv.index("--train-iters") + 1])
    launch, relaunch = Launch(with_flags(argv, save=save, save_interval=interval), folder / "log"), None
    try:
        first, start = first_checkpoint(launch, save)
        ranks, below = launch.ranks(), descendants(launch.proc.pid)
        wait_for_moment(launch, save, moment, chance.randint(first + 1, train_iters // 2), start, chance)
        launch.alive_or_fail("the kill", time.monotonic() + 1)
        killed = time.monotonic()
        launch.proc.send_signal(signal.SIGKILL)
        launch.proc.wait()
        rank_exit = wait_gone(ranks.values())
        assert rank_exit is not None, f"trial {number}: a rank outlived its launcher by {EXIT_LIMIT} s"
        assert wait_gone(below) is not None, f"trial {number}: a process below torchrun outlived it by {EXIT_LIMIT} s"
        all_exit = time.monotonic() - killed
        written = tree(save)
        # the relaunch starts now (it only reads ``save``: a write there would be a bug too) and takes
        # seconds to reach the checkpoint, in which nothing under --save may change
        cmd, env = resume_command(argv, save, resumed_save)
        relaunch = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(2)
        assert tree(save) == written, f"trial {number}: files under --save changed after every rank was gone"
        output = relaunch.communicate(timeout=300)[0]
    finally:
        launch.close()
        if relaunch is not None and relaunch.poll() is None:
            relaunch.kill()          # its ranks follow their launcher
    killed_run = logged_losses(complete_lines(launch.text()))
    assert not loss_mismatches(killed_run, expected), (number, loss_mismatches(killed_run, expected))
    latest = check_resumed(number, save, resumed_save, relaunch.returncode, output, expected, train_iters)
    cut_short = sorted(n for n in os.listdir(save) if n.endswith(".tmp"))
    return Trial(number, moment, interval, max(killed_run, default=None), latest, rank_exit, all_exit, cut_short)


def resume_command(argv: list[str], load: str, save: str) -> tuple[list[str], dict]:
    cmd, env = pretrain_command(2, with_flags(argv, load=load, save=save, save_interval=None))
    return cmd, {**env, **RESTARTABLE}


def check_resumed(number: int, save: str, resumed_save: str, returncode: int, output: str, expected: dict,
                  train_iters: int) -> int:
    """The tracker names the newest published checkpoint, and the relaunch from it logged the
    uninterrupted run's losses for every later iteration and saved the last one."""
    latest = tracker_iteration(save)
    assert latest is not None and published(save) and max(published(save)) == latest, \
        (number, latest, published(save), sorted(os.listdir(save)))
    assert returncode == 0, f"trial {number}: the relaunch from iteration {latest} failed:\n{output[-3000:]}"
    assert re.search(rf"loaded checkpoint \S+iter_{latest:07d} at iteration {latest}\b", output), output[-3000:]
    resumed = logged_losses(output)
    assert sorted(resumed) == list(range(latest + 1, train_iters + 1)), (number, latest, sorted(resumed))
    assert not loss_mismatches(resumed, expected), (number, loss_mismatches(resumed, expected))
    assert tracker_iteration(resumed_save) == train_iters
    return latest


TRIAL_ARGS = with_flags(TINY_LLAMA_ARGS, train_iters=160)


def kill_trials(tmp_path, extra_flags=(), trials: int = 10, seed: int = 0) -> list[Trial]:
    """``trials`` runs of TRIAL_ARGS + ``extra_flags`` with their torchrun SIGKILLed at a random moment
    (seeded), each checked as the module docstring says; one row per trial is printed and returned."""
    argv = TRIAL_ARGS + list(extra_flags)
    expected = reference_losses(argv)
    chance, done = random.Random(seed), []
    for number in range(trials):
        done.append(run_trial(tmp_path, number, argv, chance, expected))
        print(done[-1].row(), flush=True)
    return done
