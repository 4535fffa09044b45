"""--log-straggler names the rank that makes the others wait. A thread of the test slows one rank on purpose
(SIGSTOP for 150 ms every 200 ms: its stops count as its compute, and as its peers' waiting); the log names
that rank first within two log intervals of the slowing starting.

Before it, the unslowed run must give QUIET reports in a row that name no rank. Not every report: on a
shared machine the OS may starve one rank for a while, and that rank is then a straggler the log rightly
names (the first interval's start-up work too); a naming that is wrong whatever the machine (always some
rank, or by noise) never gives a quiet spell. A slowing whose stops land where the slowed rank waits for a
starved peer can hide it for a while, so the slowing is tried ATTEMPTS times, each after a quiet spell.
The runs end through --exit-signal-handler (a SIGTERM to one rank: all finish the iteration and exit 0)."""
import os
import re
import signal
import subprocess
import tempfile
import threading
import time

import pytest

from harness import _check_collective_logs, pretrain_command
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from process_memory import children

INTERVAL = 8           # --log-interval
QUIET = 3              # reports in a row that name no rank, before each slowing
ATTEMPTS = 2


class Run:
    """pretrain_gpt.py under torchrun, its log read as it grows; ``nccl`` runs it under the NCCL-semantics tier."""

    def __init__(self, tmp_path, nproc: int, argv: list[str], nccl: bool = False):
        cmd, env = pretrain_command(nproc, argv)
        self.nproc, self.nccl_logs = nproc, None
        if nccl:
            self.nccl_logs = tempfile.mkdtemp(dir=tmp_path)
            site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nccl_site")
            env.update(MEGALITE_NCCL_SEMANTICS=self.nccl_logs, MEGALITE_FORCE_NCCL_COLLECTIVE_PATH="1",
                       PYTHONPATH=os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")])))
        self.log = tmp_path / "log"
        with open(self.log, "w") as out:
            self.launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                             env={**env, "PYTHONUNBUFFERED": "1"})

    def text(self) -> str:
        with open(self.log) as f:
            return f.read()

    def wait_for(self, done, deadline: float = 240) -> list:
        """The reports so far, once ``done(reports)``."""
        stop = time.monotonic() + deadline
        while not done(found := reports(self.text())):
            assert self.launcher.poll() is None and time.monotonic() < stop, self.text()[-3000:]
            time.sleep(0.05)
        return found

    def pid_of(self, rank: int) -> int:
        for pid in children(self.launcher.pid):
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"\0RANK={rank}\0".encode() in b"\0" + f.read():
                    return pid
        raise AssertionError(f"no rank {rank} among torchrun's children")

    def finish(self) -> str:
        """SIGTERM to rank 0: with --exit-signal-handler every rank finishes the iteration and exits 0."""
        os.kill(self.pid_of(0), signal.SIGTERM)
        assert self.launcher.wait(timeout=120) == 0, self.text()[-3000:]
        if self.nccl_logs is not None:
            assert len([f for f in os.listdir(self.nccl_logs) if f.startswith("rank")]) == self.nproc
            _check_collective_logs(self.nccl_logs)
        return self.text()

    def kill(self) -> None:
        if self.launcher.poll() is None:
            self.launcher.kill()
            self.launcher.wait()


class Slowing:
    """A thread that stops ``pid`` for ``stop`` seconds every ``period`` seconds until ``end()``."""

    def __init__(self, pid: int, stop: float = 0.15, period: float = 0.2):
        self.pid, self.stop, self.period = pid, stop, period
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(self.stop)
                os.kill(self.pid, signal.SIGCONT)
                self.done.wait(self.period - self.stop)
        finally:
            os.kill(self.pid, signal.SIGCONT)

    def end(self) -> None:
        self.done.set()
        self.thread.join()


def reports(text: str) -> list[tuple[int, list[int]]]:
    """(iteration, the ranks named, slowest first) of each straggler report in the log, in order."""
    found, iteration = [], None
    for line in text.splitlines():
        if (match := re.search(r"iteration\s+(\d+)\s*/", line)) and "lm loss" in line:
            iteration = int(match.group(1))
        elif line.startswith(" stragglers ("):
            found.append((iteration, [int(r) for r in re.findall(r"rank (\d+): compute", line)]))
        elif line.startswith(" no stragglers"):
            found.append((iteration, []))
    return found


def quiet(found: list) -> bool:
    """The last QUIET reports, after the first (start-up), name no rank."""
    return len(found) > QUIET and all(named == [] for _, named in found[-QUIET:])


def slowed_run(tmp_path, nproc: int, slow_rank: int, argv: list[str], nccl: bool = False) -> None:
    """A run whose ``slow_rank`` is slowed after a quiet spell, until two more reports are in; it must be named
    first in one of them (at the first of ATTEMPTS tries that names it)."""
    run = Run(tmp_path, nproc, argv, nccl)
    try:
        for _ in range(ATTEMPTS):
            started = run.wait_for(quiet)[-1][0]
            slowing = Slowing(run.pid_of(slow_rank))
            try:
                found = run.wait_for(lambda found: found[-1][0] >= started + 2 * INTERVAL)    # past the quiet ones
            finally:
                slowing.end()
            if any(named[:1] == [slow_rank] for it, named in found if started < it <= started + 2 * INTERVAL):
                break
        else:
            raise AssertionError(f"rank {slow_rank} not named within two reports of its slowing:\n"
                                 + "\n".join(line for line in run.text().splitlines() if "stragglers" in line))
        run.finish()
    finally:
        run.kill()


# 8 micro-batches per step: compute, not the collectives' latency, fills the step (a stop lands in a collective
# less often), and 8 iterations per report average out the noise of a shared machine. Beyond 2x the median:
# the slowing makes ~4x, a busy neighbour on these 2 cores up to ~1.8x, a pipeline's last stage ~1.5x.
ARGV = with_flags(TINY_LLAMA_ARGS, global_batch_size=32, train_iters=100000, log_interval=INTERVAL,
                  log_straggler=True, straggler_factor="2", straggler_ctrlr_port="0", exit_signal_handler=True)


def test_the_slowed_rank_is_named_after_a_quiet_spell(tmp_path):
    slowed_run(tmp_path, 2, 0, ARGV, nccl=True)


@pytest.mark.slow
def test_pipeline_and_data_parallel_ranks_name_the_slowed_one(tmp_path):
    """4 ranks, PP=2 x DP=2: the slowed rank's pipeline peer waits in its receives, its DP peer in the gradient
    reduction; --straggler-minmax-count 2 lists up to two."""
    argv = with_flags(ARGV, pipeline_model_parallel_size=2, straggler_minmax_count=2)
    slowed_run(tmp_path, 4, 2, argv, nccl=True)
