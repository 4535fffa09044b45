"""--log-straggler's parts in one process: the naming rule, the report line and metrics, the wait clock and
the --straggler-ctrlr-port toggle (tests/distributed/test_stragglers.py slows a real rank)."""
import time
import urllib.request
from types import SimpleNamespace

import torch

import megalite.train.straggler as straggler
from harness import free_port
from megalite.train.command_line import parse_args
from megalite.observe.clocks import WaitClock, waiting
from megalite.parallel.dry_run import REAL_RUN, DryRun
from megalite.parallel.launch_env import LaunchEnv
from megalite.train.straggler import StragglerDetector, ToggleServer, named_stragglers, report_line, report_metrics
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags


def test_a_rank_is_named_beyond_the_factor_times_the_median():
    assert named_stragglers([100.0, 101.0, 99.0, 128.0], 1, 1.3) == []             # within 1.3x of 100
    assert named_stragglers([100.0, 101.0, 99.0, 140.0], 1, 1.3) == [3]
    assert named_stragglers([100.0, 250.0, 99.0, 140.0], 1, 1.3) == [1]            # the slowest first
    assert named_stragglers([100.0, 250.0, 99.0, 140.0], 2, 1.3) == [1, 3]
    assert named_stragglers([100.0, 250.0, 99.0, 140.0], 2, 2.0) == [1]
    assert named_stragglers([300.0, 300.0, 100.0, 100.0, 100.0], 3, 1.3) == [0, 1]  # a tie: the lower rank first


def test_of_two_ranks_the_faster_is_the_reference_and_waiting_does_not_count():
    assert named_stragglers([140.0, 100.0], 1, 1.3) == [0]      # the lower median: 100, not their mean 120
    assert named_stragglers([120.0, 100.0], 1, 1.3) == []
    assert named_stragglers([100.0], 1, 1.3) == []
    # a rank that waited for the straggler has the short compute, however long its step was
    assert named_stragglers([100.0, 100.0, 100.0, 400.0], 1, 1.3) == [3]


def test_the_report_names_ratio_compute_and_wait_else_the_extremes():
    computes, waits = [100.0, 102.0, 98.0, 400.0], [300.0, 298.0, 302.0, 1.0]
    line = report_line(computes, waits, [3], 1, 1.3)
    assert line == (" stragglers (compute per iteration over 1.3x the median rank's 100.0 ms): "
                    "rank 3: compute 400.0 ms, wait 1.0 ms, 4.00x")
    line = report_line(computes[:3], waits[:3], [], 2, 1.3)
    assert line == (" no stragglers (ms per iteration/rank) | max compute: 102.0/1, 100.0/0 | min compute: "
                    "98.0/2, 100.0/0 | median compute: 100.0 | max wait: 302.0/2, 300.0/0 | min wait: 298.0/1, 300.0/0")
    assert report_metrics(computes, waits, 1) == {
        "straggler max compute (ms)": 400.0, "straggler max compute rank": 3,
        "straggler min compute (ms)": 98.0, "straggler min compute rank": 2,
        "straggler median compute (ms)": 100.0, "straggler max wait (ms)": 302.0, "straggler max wait rank": 2,
        "straggler min wait (ms)": 1.0, "straggler min wait rank": 3, "stragglers named": 1}


def test_waits_count_once_and_only_while_the_clock_runs(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(straggler.time, "perf_counter", lambda: now[0])
    clock = WaitClock(torch.device("cpu"))
    with waiting():
        now[0] += 1.0                        # no step running: not counted
    with clock.running():
        with waiting():
            now[0] += 2.0
            with waiting():                  # nested: counted once, by the outer block
                now[0] += 4.0
        now[0] += 8.0                        # compute
    assert clock.take() == 6.0
    assert clock.take() == 0.0


def detector(*flags):
    config = parse_args(with_flags(TINY_LLAMA_ARGS, log_straggler=True, **dict(flags)), world_size=1)
    lines = []
    parallel = SimpleNamespace(rank=0, world_size=1, run=REAL_RUN)
    return StragglerDetector(config.training, parallel, torch.device("cpu"), lines.append, lines.append), lines


def test_requests_to_the_controller_port_turn_the_report_off_and_on():
    port = free_port()
    stragglers, lines = detector(("straggler_ctrlr_port", str(port)), ("disable_straggler_on_startup", True))
    try:
        with stragglers.step():
            with waiting():
                time.sleep(0.01)
        assert stragglers.report() == {} and lines[-1].startswith(" > straggler report: each request to port")
        urllib.request.urlopen(f"http://127.0.0.1:{port}/").read()
        with stragglers.step():
            pass
        metrics = stragglers.report()
        assert lines[-2] == " > straggler report turned on (--straggler-ctrlr-port)", lines
        assert lines[-1].startswith(" no stragglers") and metrics["stragglers named"] == 0
    finally:
        stragglers.close()


def test_two_requests_cancel_out_and_a_taken_port_is_one_line():
    port = free_port()
    server = ToggleServer(port, print)
    try:
        for _ in range(2):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/").read()
        assert not server.take()
        lines = []
        assert ToggleServer(port, lines.append).server is None
        assert "cannot listen" in lines[0] and "the straggler report cannot be toggled" in lines[0]
    finally:
        server.close()


def test_without_the_flag_or_in_a_dry_run_nothing_is_measured_or_gathered():
    config = parse_args(TINY_LLAMA_ARGS, world_size=1)
    off = StragglerDetector(config.training, SimpleNamespace(rank=0, world_size=1, run=REAL_RUN),
                            torch.device("cpu"), print)
    with off.step():
        with waiting():
            pass
    assert off.report() == {} and off.controller is None
    peerless = SimpleNamespace(rank=0, world_size=8, run=DryRun(LaunchEnv(0, 8, 0), storage=True))
    dry = StragglerDetector(parse_args(with_flags(TINY_LLAMA_ARGS, log_straggler=True), world_size=1).training,
                            peerless, torch.device("cpu"), print)
    with dry.step():
        pass
    assert dry.report() == {} and dry.controller is None
