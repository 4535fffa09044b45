"""Memory of a pretrain_gpt.py launch, process by process, read from /proc while it runs: each rank's peak
RSS (VmHWM, the kernel's high-water mark) and the peak proportional set size (PSS: each page counted once
over the processes that share it) of every process below the ranks: data-loader workers,
multiprocessing's resource tracker. ``children`` and ``descendants`` read the process tree."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass


@dataclass
class MeasuredRun:
    returncode: int
    stdout: str
    rank_peak_rss: dict          # rank -> bytes
    helper_peak_pss: dict        # pid -> bytes, every process below a rank


def _field(path: str, name: str) -> int | None:
    """A "Name:  N kB" field of a /proc file, in bytes (None once the process is gone)."""
    try:
        with open(path) as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(name))
    except (OSError, StopIteration):
        return None


def _cmdline(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (none once it is gone)."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:                     # the thread or process just ended
            pass
    return found


def descendants(pid: int) -> list[int]:
    return [p for child in children(pid) for p in [child, *descendants(child)]]


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        return int(env[b"RANK"])
    except (OSError, KeyError, ValueError):
        return None


# A process started by fork + exec (a spawned worker) is a copy of its rank until the exec, which can take
# seconds on a loaded machine: it is sampled once its command line is no longer the rank's. One that never
# execs (a forked worker) stays a copy, and is sampled from SETTLE seconds after it is first seen.
SETTLE = 5.0


def run_pretrain_measured(nproc: int, argv: list[str], timeout: float = 1800, every: float = 0.1,
                          env: dict | None = None) -> MeasuredRun:
    """pretrain_gpt.py under torchrun (in ``env``, default this process's environment), sampled every
    ``every`` seconds until it exits. A process below a
    rank is sampled once it has exec'd (a spawned worker is a copy of its rank until it execs a fresh
    interpreter), or SETTLE seconds after it is first seen: a forked one stays a copy, and is measured as one."""
    from harness import pretrain_command
    cmd, launch_env = pretrain_command(nproc, argv)
    if env is not None:          # what pretrain_command adds to this process's environment, over ``env``
        launch_env = {**env, **{k: v for k, v in launch_env.items() if os.environ.get(k) != v}}
    log = tempfile.TemporaryFile(mode="w+")                    # a pipe left unread would fill and stall the run
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=launch_env)
    ranks, rss, pss, seen, deadline = {}, {}, {}, {}, time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        for pid in children(proc.pid):                           # torchrun's children: the ranks
            if pid not in ranks and (rank := _rank_of(pid)) is not None:
                ranks[pid] = rank
            if (hwm := _field(f"/proc/{pid}/status", "VmHWM:")) is not None and pid in ranks:
                rss[ranks[pid]] = max(rss.get(ranks[pid], 0), hwm)
            for helper in descendants(pid):
                settled = (time.monotonic() - seen.setdefault(helper, time.monotonic()) >= SETTLE
                           or _cmdline(helper) not in (None, _cmdline(pid)))
                if settled and (size := _field(f"/proc/{helper}/smaps_rollup", "Pss:")) is not None:
                    pss[helper] = max(pss.get(helper, 0), size)
        time.sleep(every)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    with log:
        log.seek(0)
        return MeasuredRun(proc.returncode, log.read(), rss, pss)


def bare_torch_pss() -> int:
    """The PSS of an interpreter that has imported torch and nothing else."""
    code = "import torch, sys; sys.stdout.write(open('/proc/self/smaps_rollup').read())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return next(int(line.split()[1]) * 1024 for line in out.splitlines() if line.startswith("Pss:"))


WORKER_SLACK = 64 * 2 ** 20          # a loader worker's own allocations: the dataset, its batches, collate buffers


def assert_workers_hold_no_rank_state(helper_peak_pss: dict, workers: int) -> None:
    """At least ``workers`` processes ran below the ranks, and none peaked above a bare torch interpreter's
    PSS + WORKER_SLACK: none held a share of a rank's model or optimizer pages."""
    bound = bare_torch_pss() + WORKER_SLACK
    assert len(helper_peak_pss) >= workers, helper_peak_pss
    assert max(helper_peak_pss.values()) <= bound, {
        "peak PSS MiB": sorted(s // 2 ** 20 for s in helper_peak_pss.values()), "bound MiB": bound // 2 ** 20}
