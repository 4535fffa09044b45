"""Clocks that any floor may run: named wall-clock ``Timers`` (--timing-log-level) and the straggler
report's waiting clock (``waiting()`` blocks, counted by a running ``WaitClock``).

``waiting()`` marks where a rank blocks on communication (a data-parallel reduction, a pipeline receive,
an optimizer all-reduce); its time counts as the rank's waiting while a training step runs a WaitClock
(train/straggler.py's StragglerDetector), and it only runs the block otherwise. Blocks inside another one
count once, in the outer one.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch


_RUNNING: list = []            # the WaitClock of the training step now running (StragglerDetector.step)
_NOT_RUNNING = nullcontext()


def waiting():
    """A block where this rank is blocked on communication: its time counts as the rank's waiting while a
    StragglerDetector's step runs (--log-straggler), and it only runs the block otherwise. Blocks inside
    another one count once, in the outer one."""
    return _RUNNING[-1].waiting() if _RUNNING else _NOT_RUNNING


class WaitClock:
    """Seconds this rank spent in ``waiting()`` blocks while running.

    On CPUs the host blocks in the collective or receive, and perf_counter times it. On GPUs a collective
    is queued and the host runs ahead, so the clock records a pair of CUDA events on the current stream
    around the block instead: the stream's time between them is how long the device stood waiting (the
    transfer itself included). Pairs are read once complete, without synchronising the device."""

    def __init__(self, device: torch.device | None = None):
        self._cuda = device is not None and device.type == "cuda"
        self._inside = False
        self._seconds = 0.0
        self._pending: list = []          # CUDA event pairs not read yet

    @contextmanager
    def waiting(self):
        if self._inside:                  # counted by the outer block
            yield
            return
        self._inside = True
        start = self._mark()
        try:
            yield
        finally:
            self._inside = False
        end = self._mark()
        if self._cuda:
            self._pending.append((start, end))
        else:
            self._seconds += end - start

    def _mark(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def running(self):
        """Count the ``waiting()`` blocks run inside (the training step's, on the main thread)."""
        _RUNNING.append(self)
        try:
            yield
        finally:
            _RUNNING.pop()

    def take(self, complete: bool = False) -> float:
        """Seconds waited since the last take: the event pairs done by now, or with ``complete`` all of them
        (waiting for the last ones: at a log iteration, after the step's host synchronisations)."""
        still = []
        for start, end in self._pending:
            if complete:
                end.synchronize()
            elif not end.query():
                still.append((start, end))
                continue
            self._seconds += start.elapsed_time(end) / 1000.0
        self._pending = still
        seconds, self._seconds = self._seconds, 0.0
        return seconds


class Timers:
    """Named wall-clock timers; those at or below ``--timing-log-level`` are reported.

    On a GPU, kernels run asynchronously: an active timer synchronises the device when it starts and
    stops, so it measures the work, not its launch. Timers above the level do nothing at all, so the
    default (level 0) adds no host-device synchronisation to the step."""

    def __init__(self, log_level: int, device: torch.device | None = None):
        self.log_level = log_level
        self._cuda = device is not None and device.type == "cuda"
        self._start: dict[str, float] = {}
        self._elapsed: dict[str, float] = {}
        self._levels: dict[str, int] = {}

    def _synchronize(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    def start(self, name: str, level: int = 1) -> None:
        if level <= self.log_level:
            self._levels[name] = level
            self._synchronize()
            self._start[name] = time.perf_counter()

    def add(self, name: str, seconds: float, level: int = 1) -> None:
        """Account time measured elsewhere (e.g. pipeline receive waits)."""
        if level <= self.log_level:
            self._elapsed[name] = self._elapsed.get(name, 0.0) + seconds

    def stop(self, name: str) -> None:
        if name in self._start:
            self._synchronize()
            self._elapsed[name] = self._elapsed.get(name, 0.0) + time.perf_counter() - self._start.pop(name)

    def report(self, iterations: int) -> dict[str, float]:
        """Average ms per iteration of each timer since the last report; resets."""
        values = {name: 1000.0 * seconds / max(1, iterations) for name, seconds in self._elapsed.items()}
        self._elapsed.clear()
        return values
