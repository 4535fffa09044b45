"""--log-straggler: which ranks make everyone wait (Megatron's flag names).

At thousands of ranks one rank running 2x slower slows every step, and every rank's step takes as long
as the slowest one's. What tells them apart is how each rank's step splits into **compute** (its own
work: data loading, forward, backward, the optimizer's arithmetic) and **waiting** (blocked on
communication until its peers catch up): a straggler computes long and waits little, its peers wait for
it. A rank stopped while computing (a SIGSTOP, a throttled GPU) shows the stop as compute; its peers show
it as waiting. So a rank measures only its waits, and compute = step wall time - waiting.

``waiting()`` (observe/clocks.py) marks where a step blocks on communication; its time counts as the
rank's waiting while a StragglerDetector runs the step with its WaitClock: the
gradient finishing after the last backward (the data-parallel reduction and its bucket waits, also those
inside backward with --overlap-grad-reduce, the tensor/pipeline-parallel gradient fix-ups), the optimizer
step's gradient-norm and overflow all-reduces and ZeRO's parameter all-gather, ZeRO-3's parameter gathers,
each pipeline receive and the schedule's last sends, the loss average over the data-parallel ranks and
the per-token-loss count. Not marked (they count as compute): the collectives inside forward and
backward of tensor/sequence, context and expert parallelism (a per-layer cost), and FSDP2's (inside
torch). A rank whose tensor-parallel peer is slow therefore shows that delay as compute too, and the
report names the slow rank's tensor-parallel group; the ranks outside it wait for the whole group.

StragglerDetector: owns the clock's running window (inside each training step only), the interval's
totals, the one all_gather per log interval of every rank's [compute, wait, toggle] (a fixed-size tensor
on the device, at the same iterations on every rank), the report line, the metrics for the sinks and
the --straggler-ctrlr-port controller (ToggleServer).

The naming rule (named_stragglers): a rank is named when its compute per iteration exceeds
--straggler-factor (default 1.3) x the median rank's (the lower median for an even count, so that of two
ranks the faster one is the reference), slowest first, at most --straggler-minmax-count of them.
"""
from __future__ import annotations

import http.server
import statistics
import threading
import time
from contextlib import contextmanager

import torch

from megalite.observe.clocks import WaitClock
from megalite.parallel import collectives


def named_stragglers(compute: list[float], count: int, factor: float) -> list[int]:
    """The ranks whose ``compute`` (any unit, one entry per rank) exceeds ``factor`` x the lower median,
    slowest first (the lower rank first on a tie), at most ``count``."""
    if not compute:
        return []
    reference = statistics.median_low(compute)
    over = [rank for rank, value in enumerate(compute) if value > factor * reference]
    return sorted(over, key=lambda rank: (-compute[rank], rank))[:count]


def extremes(values: list[float], count: int) -> tuple[list[int], list[int]]:
    """(the ``count`` ranks of the largest values, largest first; those of the smallest, smallest first)."""
    order = sorted(range(len(values)), key=lambda rank: (values[rank], rank))
    return order[::-1][:count], order[:count]


class ToggleServer:
    """--straggler-ctrlr-port on rank 0: each HTTP request (``curl HOST:PORT``) asks to turn the report on
    or off; every rank applies it at the next log interval (it travels with rank 0's row of the gather).
    A port already taken costs one line; the run goes on without the controller."""

    def __init__(self, port: int, print_fn):
        self.requests = 0
        self._lock = threading.Lock()
        self.server = None
        try:
            self.server = http.server.HTTPServer(("", port), self._handler())
        except OSError as error:
            print_fn(f" > warning: --straggler-ctrlr-port {port}: cannot listen ({error}); the straggler report "
                     "cannot be toggled during this run")
            return
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2}, name="straggler-controller",
                         daemon=True).start()
        print_fn(f" > straggler report: each request to port {port} of rank 0 (curl HOST:{port}) turns it on or off")

    def _handler(self):
        controller = self

        class Toggle(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                controller.ask()
                body = b"straggler report: toggled at the next log interval\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):      # no access log on the training's stderr
                pass
        return Toggle

    def ask(self) -> None:
        with self._lock:
            self.requests += 1

    def take(self) -> bool:
        """Whether an odd number of toggles was asked for since the last take."""
        with self._lock:
            requests, self.requests = self.requests, 0
        return requests % 2 == 1

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


class StragglerDetector:
    """Per rank and log interval: the training steps' wall time and waiting (WaitClock), gathered at each
    log interval into one report on the logging rank. Off without --log-straggler, and where the run
    backend has no peers to compare with (parallel/dry_run.py): then ``step`` only yields and ``report``
    returns {}, with no collective."""

    def __init__(self, config, parallel, device: torch.device, log, print_fn=print):
        self.enabled = parallel.run.compares_peers(config.log_straggler)
        self.reporting = not config.disable_straggler_on_startup
        self.count, self.factor = config.straggler_minmax_count, config.straggler_factor
        self.rank, self.world_size, self.device = parallel.rank, parallel.world_size, device
        self.clock, self.log = WaitClock(device), log
        self.wall, self.waited = 0.0, 0.0
        self.iterations = 0
        port = config.straggler_ctrlr_port
        self.controller = ToggleServer(port, print_fn) if self.enabled and self.rank == 0 and port else None

    @contextmanager
    def step(self):
        """One training step: its wall time, and the waits marked inside it."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        with self.clock.running():
            yield
        self.wall += time.perf_counter() - start
        self.waited += self.clock.take()
        self.iterations += 1

    def report(self) -> dict:
        """At a log iteration, on every rank (one all_gather): the report line through ``log`` and the
        figures for the metrics sinks; {} when off or toggled off. Starts the next interval."""
        if not self.enabled or not self.iterations:
            return {}
        self.waited += self.clock.take(complete=True)
        per_iteration = 1000.0 / self.iterations
        compute, wait = max(0.0, self.wall - self.waited) * per_iteration, self.waited * per_iteration
        toggle = self.controller is not None and self.controller.take()
        rows = self._gather([compute, wait, float(toggle)])
        self.wall = self.waited = 0.0
        self.iterations = 0
        if rows[0][2]:
            self.reporting = not self.reporting
            self.log(f" > straggler report turned {'on' if self.reporting else 'off'} (--straggler-ctrlr-port)")
        if not self.reporting:
            return {}
        computes, waits = [row[0] for row in rows], [row[1] for row in rows]
        named = named_stragglers(computes, self.count, self.factor)
        self.log(report_line(computes, waits, named, self.count, self.factor))
        return report_metrics(computes, waits, len(named))

    def _gather(self, row: list[float]) -> list[list[float]]:
        """Every rank's ``row``, in rank order."""
        local = torch.tensor(row, dtype=torch.float64, device=self.device)
        if self.world_size == 1:
            return [local.tolist()]
        gathered = torch.empty(self.world_size * len(row), dtype=torch.float64, device=self.device)
        collectives.all_gather_single(gathered, local)
        return gathered.view(self.world_size, len(row)).tolist()

    def close(self) -> None:
        if self.controller is not None:
            self.controller.close()


def report_line(computes: list[float], waits: list[float], named: list[int], count: int, factor: float) -> str:
    """The logging rank's line: the ``named`` ranks with their compute, wait and ratio to the median; when
    none is named, the slowest and fastest ``count`` ranks by compute, and by wait."""
    median = statistics.median_low(computes)
    if named:
        ranks = " | ".join(f"rank {r}: compute {computes[r]:.1f} ms, wait {waits[r]:.1f} ms, "
                           f"{computes[r] / median if median else float('inf'):.2f}x" for r in named)
        return (f" stragglers (compute per iteration over {factor:g}x the median rank's {median:.1f} ms): "
                f"{ranks}")
    most, least = extremes(computes, count)
    most_wait, least_wait = extremes(waits, count)
    return (f" no stragglers (ms per iteration/rank) | max compute: {_listed(computes, most)} | min compute: "
            f"{_listed(computes, least)} | median compute: {median:.1f} | max wait: {_listed(waits, most_wait)} | "
            f"min wait: {_listed(waits, least_wait)}")


def _listed(values: list[float], ranks: list[int]) -> str:
    return ", ".join(f"{values[r]:.1f}/{r}" for r in ranks)


def report_metrics(computes: list[float], waits: list[float], named: int) -> dict[str, float]:
    """The figures for the JSONL, tensorboard and wandb: the slowest and fastest rank by compute and by
    wait, the median compute, and how many ranks are named."""
    (slow,), (fast,) = extremes(computes, 1)
    (most,), (least,) = extremes(waits, 1)
    return {"straggler max compute (ms)": computes[slow], "straggler max compute rank": slow,
            "straggler min compute (ms)": computes[fast], "straggler min compute rank": fast,
            "straggler median compute (ms)": statistics.median_low(computes),
            "straggler max wait (ms)": waits[most], "straggler max wait rank": most,
            "straggler min wait (ms)": waits[least], "straggler min wait rank": least,
            "stragglers named": named}
