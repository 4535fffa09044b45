"""--async-save: checkpoints written while training goes on.

A save stalls training only for as long as it takes to fix what is saved:

- the plan (save.plan_save: the tensors this rank owns, its RNG states, the publisher's metadata), as the
  synchronous save makes it, after the previous background save has finished;
- a snapshot of those tensors that later steps cannot change. On a GPU they are copied into host memory
  that is pinned once and reused (one shard's bytes), then written by a thread. On the CPU the rank
  forks: the child sees the memory as it was at the fork (copy-on-write: a page is copied only once
  training writes it, so the extra memory is bounded by one shard) and writes it with NumPy and file
  calls only, since a forked child must not run torch's thread pools.

A thread of the rank then waits for the files and completes the save with the synchronous save's own
steps (save.publish_plan), on a gloo group of its own so that it never competes with training's
collectives: every rank agrees that its files are durable (each written file is fsynced), the index is
exchanged and written, and only then does rank 0 publish iter_N and point the tracker file at it. A
save is therefore published complete or not at all. A killed rank takes its writer with it (the child
dies with its parent: PR_SET_PDEATHSIG), leaving only iter_N.tmp, which the next save removes.

The next save waits for the previous one, and so does the end of training: --train-iters,
--exit-interval, --exit-duration-in-mins and SIGTERM under --exit-signal-handler all wait for the
last save to be published before the process exits. The log says when a save was taken (and how long
training stalled) and when it was published.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megalite.checkpoint.state import CheckpointState
from megalite.checkpoint.save import Destination, SavePlan, plan_save, publish_plan, write_files
from megalite.checkpoint.tensor_file import HostArray

_LIBC = ctypes.CDLL(None, use_errno=True)      # opened before any fork: the child must not call dlopen
PR_SET_PDEATHSIG = 1
ALIGNMENT = 64                                  # bytes between tensors in the pinned snapshot


class PinnedSnapshot:
    """Host memory for one shard's tensors, pinned once and reused by every save (grown if a later save
    is larger), so a GPU save costs one device-to-host copy and no allocation."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None

    def copy(self, files: dict[str, dict], device: torch.device) -> dict[str, dict]:
        sizes = [-(-t.numel() * t.element_size() // ALIGNMENT) * ALIGNMENT for ts in files.values() for t in ts.values()]
        if self.buffer is None or self.buffer.numel() < sum(sizes):
            self.buffer = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
        out, offset, sizes = {}, 0, iter(sizes)
        for filename, tensors in files.items():
            out[filename] = {}
            for key, t in tensors.items():
                size = next(sizes)
                view = self.buffer[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                out[filename][key] = view.copy_(t.detach(), non_blocking=True)
                offset += size
        torch.cuda.current_stream(device).synchronize()
        return out


def fork_writer(plan: SavePlan) -> Callable[[], tuple[dict | None, str | None]]:
    """Fork a child that writes the plan's files as they are now; returns the function (for a thread)
    that waits for it: (records, None) or (None, the error)."""
    files = {name: {key: HostArray.of(t) for key, t in tensors.items()} for name, tensors in plan.files.items()}
    read_end, write_end = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:                                   # the child: never returns
        os.close(read_end)
        _write_and_exit(plan, files, write_end, parent)
    os.close(write_end)

    def result() -> tuple[dict | None, str | None]:
        with os.fdopen(read_end, "rb") as pipe:
            answer = pipe.read()
        _, status = os.waitpid(pid, 0)
        if not answer:
            return None, (f"{plan.destination.flag} {plan.root}: the process writing this rank's checkpoint files died "
                          f"({_describe(status)}); see the system log (out of memory?)")
        answer = json.loads(answer)
        return answer["records"], answer["error"]
    return result


def _write_and_exit(plan: SavePlan, files: dict, out: int, parent: int) -> None:
    """The forked writer: dies with the rank, ignores the signals meant for the rank (the rank decides
    when to stop; under --exit-signal-handler it waits for this save), writes, reports, exits."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:                 # the rank died before the line above
            os._exit(1)
        records, error = write_files(plan, files)
        answer = json.dumps({"records": records, "error": error}).encode()
    except BaseException as e:                     # anything else: the rank reports it
        answer = json.dumps({"records": None, "error": f"{plan.destination.flag} {plan.root}: writing failed ({e!r})"}).encode()
    while answer:
        answer = answer[os.write(out, answer):]
    os._exit(0)


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


class Pending:
    """One save on its way: a thread waits for the written files, then publishes."""

    def __init__(self, plan: SavePlan, wait_for_files, group, started: float):
        self.plan, self.started = plan, started
        self.path: str | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(wait_for_files, group), daemon=True,
                                       name=f"checkpoint-{plan.iteration}")
        self.thread.start()

    def _run(self, wait_for_files, group) -> None:
        try:
            records, error = wait_for_files()
            self.path = publish_plan(self.plan, records, error, torch.device("cpu"), group)
        except BaseException as e:                 # raised on the training thread (BackgroundSaves.poll)
            self.error = e
        finally:
            self.done.set()


class BackgroundSaves:
    """The run's asynchronous saves: at most one in flight. ``save`` takes one, ``poll`` (each iteration,
    no collective) reports one that has finished, ``wait`` blocks until none is in flight. Building it is
    collective (its gloo group)."""

    def __init__(self, log):
        self.log = log
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo") if distributed else None
        self.pinned = PinnedSnapshot()
        self.pending: Pending | None = None

    def save(self, run: CheckpointState, destination: Destination) -> None:
        start = time.perf_counter()
        self.wait()                                # the next save waits for the previous one
        plan = plan_save(run, destination)
        if run.device.type == "cpu":
            wait_for_files = fork_writer(plan)
        else:
            snapshot = self.pinned.copy(plan.files, run.device)
            wait_for_files = lambda: write_files(plan, snapshot)      # noqa: E731 (on the thread)
        self.pending = Pending(plan, wait_for_files, self.group, start)
        self.log(f" > saving checkpoint at iteration {plan.iteration} in the background "
                 f"(training stalled {time.perf_counter() - start:.3f} s)")

    def poll(self) -> None:
        if self.pending is not None and self.pending.done.is_set():
            self._finish()

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.thread.join()
            self._finish()

    def _finish(self) -> None:
        pending, self.pending = self.pending, None
        if pending.error is not None:
            raise pending.error
        self.log(f" > saved checkpoint at iteration {pending.plan.iteration} to {pending.path} "
                 f"({time.perf_counter() - pending.started:.2f} s, in the background)")

