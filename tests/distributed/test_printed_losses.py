"""What the user sees, per pipeline schedule at PP=2: the lm loss of pretrain_gpt.py's training lines and
validation lines, and of its metrics file, against the serial run's. The loss is computed on the rank
holding the last virtual stage (pipeline rank 0 under zbv's V placement) and printed by the last rank.
The asynchronous schedules train on stale weights by design: their printed losses are checked against
their single-process reference (test_pipedream.py) instead. The pipelined runs go through torchrun under
the NCCL-semantics tier (harness.run_pretrain(..., nccl=True)), as a user's command line would run on NCCL."""
import json
import math
import re

import pytest

from harness import logged_losses, run_pretrain
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from test_pipedream import reference_history

ARGV = with_flags(TINY_LLAMA_ARGS, num_layers=4, global_batch_size=8, train_iters=4, eval_interval=2, eval_iters=1,
                  num_workers=None)      # the default data-loader workers, as a user's command line has them
ITERATIONS, EVALUATED = [1, 2, 3, 4], [2, 4]
VALIDATION = re.compile(r" validation loss (.+?) \| lm loss value: (\S+) \|")
SCHEDULES = {       # name -> flags; pipeline_schedule when the name is a schedule of its own
    "1f1b": {},
    "gpipe": {},
    "interleaved": {"pipeline_schedule": "1f1b", "num_layers_per_virtual_pipeline_stage": 1},
    "zb-h1": {},
    "zbv": {},
    "pipedream": {},
    "pipedream-2bw": {},
}
ASYNCHRONOUS = ("pipedream", "pipedream-2bw")
IN_DEFAULT_SUITE = ("interleaved",)     # the rest are marked slow (a launch each; pipedream's also a reference)


def schedule_argv(name: str) -> list[str]:
    flags = {"pipeline_schedule": name, **SCHEDULES[name]}
    return with_flags(ARGV, pipeline_model_parallel_size=2, **flags)


def reported(nproc: int, argv: list[str], metrics_file, nccl: bool = False) -> dict:
    """The run's printed training losses, printed validation losses and metrics-file records."""
    proc = run_pretrain(nproc, with_flags(argv, metrics_file=str(metrics_file)), nccl=nccl)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    with open(metrics_file, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return {"printed": logged_losses(proc.stdout),
            "validation": {where: float(value) for where, value in VALIDATION.findall(proc.stdout)},
            "jsonl": {r["iteration"]: r["lm loss"] for r in records if "lm loss" in r},
            "jsonl validation": {r["iteration"]: r["validation lm loss"] for r in records
                                 if "validation lm loss" in r}}


def check_consistent(run: dict) -> None:
    """Every iteration and evaluation reported, non-zero, and the metrics file saying what was printed
    (the line rounds to 7 significant digits)."""
    assert sorted(run["printed"]) == sorted(run["jsonl"]) == ITERATIONS
    assert sorted(run["jsonl validation"]) == EVALUATED
    assert len(run["validation"]) == len(EVALUATED) + 2        # and the end of training's val and test
    for value in [*run["printed"].values(), *run["validation"].values()]:
        assert math.isfinite(value) and value > 1.0, run
    assert run["jsonl"] == pytest.approx(run["printed"], rel=1e-6)
    for it in EVALUATED:
        assert run["jsonl validation"][it] == pytest.approx(run["validation"][f"at iteration {it}"], rel=1e-6)


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    run = reported(1, ARGV, tmp_path_factory.mktemp("serial") / "metrics.jsonl")
    check_consistent(run)
    return run


@pytest.mark.parametrize("name", [name if name in IN_DEFAULT_SUITE else pytest.param(name, marks=pytest.mark.slow)
                                  for name in SCHEDULES])
def test_printed_losses_are_the_computed_losses(serial, tmp_path, name):
    argv = schedule_argv(name)
    run = reported(2, argv, tmp_path / "metrics.jsonl", nccl=True)
    check_consistent(run)
    if name in ASYNCHRONOUS:
        reference = reference_history(argv, name, 2)
        assert [run["printed"][it] for it in ITERATIONS] == pytest.approx(reference, rel=1e-5)
        return
    for key in ("printed", "validation", "jsonl", "jsonl validation"):
        assert run[key] == pytest.approx(serial[key], rel=1e-5), key
