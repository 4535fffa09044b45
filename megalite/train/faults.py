"""How a long run stops: early-exit conditions (signals, time, iteration count), numerical faults and
dead or stuck ranks. Each ends with a checkpoint where that is safe, and always with one line saying why.

- ExitConditions: --exit-signal-handler (SIGTERM/SIGINT, as SLURM sends before its time limit),
  --exit-duration-in-mins and --exit-interval. The ranks agree on a signal or the time (one small
  all-reduce, read on the host) every N = min(--log-interval, EXIT_AGREEMENT_INTERVAL) iterations, so
  all of them save the same checkpoint and leave together even when the signal reached only some of
  them; a signal is acted on at most N - 1 iterations late. Those are log iterations (which read the
  loss anyway) whenever --log-interval <= 10, and no other step waits for the device.
- a NaN/Inf loss or gradient norm in bf16/fp32 (ranks_with_nonfinite_loss, nonfinite_message; the loop
  raises a TrainingFault). The optimizer has already refused the update (the weights are untouched), so
  stopping here keeps the weights and checkpoints clean.
- collective_phase: a collective that times out (--distributed-timeout-minutes) or whose peer died
  becomes a CollectiveFailure naming what the run was doing, instead of hanging or a long traceback.
- report_sigterm_in_one_line: without --exit-signal-handler, a rank stopped from outside (torchrun stops
  the survivors when one rank exits; a scheduler cancels the job) says so in one line naming what it
  was doing (Activity), instead of vanishing silently.
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megalite.errors import UserError

SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}
EXIT_AGREEMENT_INTERVAL = 10      # at most this many iterations between the ranks' exit agreements


class TrainingFault(UserError):
    """The run cannot go on (not a mistake in the command line); one line, exit code 1."""


class CollectiveFailure(TrainingFault):
    """A collective timed out or lost its peer. Only this rank knows its own view, so every rank
    that hits one reports it (``local``)."""

    def __init__(self, message: str = ""):
        super().__init__(message, local=True)


class Activity:
    """What this rank is doing now: the iteration, and the phase that collective_phase names."""
    iteration: int | None = None
    phase: str = "start-up"

    @classmethod
    def describe(cls) -> str:
        return cls.phase if cls.iteration is None else f"iteration {cls.iteration}: {cls.phase}"


def report_sigterm_in_one_line(report: Callable[[UserError], None]) -> None:
    """Python's default for SIGTERM ends the process without a word. When torchrun sees one rank exit it
    SIGTERMs the others 0.1 s later; a rank still computing (not yet in the collective that would tell it
    a peer died) would leave no line at all. This handler reports one (``report``: the entry point's,
    stderr and torchrun's error file) and exits at once with 128+15: no teardown, since the process group
    may be broken. --exit-signal-handler replaces this for the length of training (save, then exit 0)."""
    def on_sigterm(signum, _frame) -> None:
        stopped = TrainingFault(f"stopped by SIGTERM during {Activity.describe()} (torchrun sends it when "
                                "another rank has exited, a scheduler when the job ends; that rank's line, or "
                                "torchrun's Root Cause, says why)", local=True)   # this rank's own view
        report(stopped)
        os._exit(128 + signum)
    signal.signal(signal.SIGTERM, on_sigterm)


class ExitConditions:
    """When to stop early; ``agree_every``: the iterations between the ranks' agreements on a signal or
    the run's duration (each reads one all-reduced value on the host)."""

    def __init__(self, exit_signal_handler: bool, exit_duration_in_mins: float | None, exit_interval: int | None,
                 device: torch.device, agree_every: int = 1):
        self.duration = exit_duration_in_mins
        self.interval = exit_interval
        self.agree_every = agree_every
        self.device = device
        self.received: int | None = None
        self.start = time.monotonic()
        self._previous = {}
        if exit_signal_handler:
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.received = signum        # acted on at the end of the current iteration

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def check(self, iteration: int) -> str | None:
        """Why to stop after ``iteration`` (None: go on); the same answer on every rank."""
        if self.interval is not None and iteration % self.interval == 0:
            return f"--exit-interval {self.interval} reached"
        if (not self._previous and self.duration is None) or iteration % self.agree_every:
            return None              # nothing that differs between ranks, or not an agreement iteration
        minutes = (time.monotonic() - self.start) / 60.0
        flags = torch.tensor([self.received or 0, minutes], dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] > 0:
            return f"received {SIGNALS.get(int(flags[0]), int(flags[0]))}"
        if self.duration is not None and flags[1] >= self.duration:
            return f"--exit-duration-in-mins {self.duration:g} reached"
        return None


def ranks_with_nonfinite_loss(local_loss: torch.Tensor, device: torch.device) -> list[int]:
    """Collective: the ranks whose own loss (a 0-dim tensor) is NaN/Inf (only the last pipeline stage
    has one)."""
    bad = (~torch.isfinite(local_loss.to(device, torch.float64))).to(torch.float64)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [0] if bad.item() else []
    flags = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    flags[dist.get_rank()] = bad
    dist.all_reduce(flags)
    return [r for r, flag in enumerate(flags.tolist()) if flag]


def nonfinite_message(iteration: int, loss: float, grad_norm, bad_ranks: list[int], last_checkpoint: str | None,
                      skipping: bool) -> str:
    where = f"loss {loss} on rank(s) {', '.join(map(str, bad_ranks))}" if bad_ranks else f"loss {loss}"
    what = f"iteration {iteration}: {where}, gradient norm {grad_norm}; the update was not applied"
    if skipping:
        return what + " (--skip-nan-iterations: going on)"
    saved = f"the latest checkpoint ({last_checkpoint}) is intact" if last_checkpoint else "nothing was saved"
    return f"{what} and {saved}; lower --lr, or pass --skip-nan-iterations to skip such steps"


COMMUNICATION_FAILURES = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe",
                          "connection refused", "nccl", "gloo")


@contextmanager
def collective_phase(what: str, timeout_minutes: float):
    """Turn a failed collective inside the block into a one-line CollectiveFailure naming ``what``."""
    outer, Activity.phase = Activity.phase, what
    try:
        yield
    except RuntimeError as error:     # torch.distributed.DistBackendError is a RuntimeError
        text = str(error)
        if isinstance(error, UserError) or not any(k in text.lower() for k in COMMUNICATION_FAILURES):
            raise
        first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
        first = first.split("] ", 1)[-1][:160]          # drop gloo's source-file prefix
        cause = (f"no answer within --distributed-timeout-minutes {timeout_minutes:g}" if "time" in text.lower()
                 else "a peer rank died")
        raise CollectiveFailure(f"{cause} during {what} ({first}); another rank died or hung, see its log") from None
    finally:
        Activity.phase = outer
