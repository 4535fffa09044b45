"""The ZeRO layouts through pretrain_gpt.py at DP=2: equal slices of every bucket (the default) and whole
parameters per rank (--use-layer-wise-distributed-optimizer).

One set of runs serves every assertion (each launched on first use, see Runs): AdamW at ZeRO-1/2/3 on both layouts trains as the single
process does (losses and gradient norms to fp32 rounding), the whole-parameter ZeRO-2/3 runs under the
NCCL-semantics tier (every rank issues the same collectives in the same order: a reduce to each owner
and a broadcast from each owner for unequal chunks), a checkpoint saved in either layout resumes in the
other with the uninterrupted run's losses, and the whole-parameter layout's per-rank optimizer state,
ZeRO-2/3 gradient shards and ZeRO-3 parameter shards cover the parameters the rank owns and no padding. --optimizer names only what exists.
"""
import os

import pytest

from harness import run_pretrain
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from test_checkpointing import exact_losses, one_line_error, run, run_single
from test_data_parallel_pretrain import MEMORY_LINE

ARGV = with_flags(TINY_LLAMA_ARGS, global_batch_size=8, train_iters=6, weight_decay=0.1, clip_grad=0.5,
                  lr_warmup_iters=2, lr_decay_style="cosine")
STAGES = {"zero1": ["--use-distributed-optimizer"],
          "zero2": ["--data-parallel-sharding-strategy", "optim_grads", "--overlap-grad-reduce",
                    "--overlap-param-gather", "--ddp-bucket-size", "30000"],
          "zero3": ["--data-parallel-sharding-strategy", "optim_grads_params"]}
LAYOUTS = {"slice": [], "param": ["--use-layer-wise-distributed-optimizer"]}


def metrics(path) -> dict[int, tuple[float, float]]:
    import json
    out = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if "lm loss" in record:
                out[record["iteration"]] = (record["lm loss"], record["grad norm"])
    return out


class Runs(dict):
    """name -> (stdout, metrics) of one pretrain_gpt.py run, launched on first use: the default tier starts
    only the runs its tests read (the whole-parameter layout's); the slow tier adds the slice layout,
    hybrid sharding and the slice -> whole-parameter resume."""

    def __init__(self, tmp):
        super().__init__()
        self.tmp = tmp

    def __missing__(self, name):
        self[name] = value = self._launch(name)
        return value

    def _launch(self, name):
        tmp = self.tmp
        if name == "serial":
            return run(1, ARGV + ["--metrics-file", str(tmp / "serial.jsonl")]).stdout, metrics(tmp / "serial.jsonl")
        if name == "zero3-param-hsdp":
            hybrid = STAGES["zero3"] + LAYOUTS["param"] + [
                "--num-distributed-optimizer-instances", "2", "--overlap-grad-reduce", "--overlap-param-gather",
                "--metrics-file", str(tmp / "hsdp.jsonl")]
            proc = run_pretrain(4, ARGV + hybrid, nccl=True)
            assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
            return proc.stdout, metrics(tmp / "hsdp.jsonl")
        if name.startswith("resume-"):
            _, saved, _, resumed = name.split("-")
            self[f"zero1-{saved}"]                                 # the run that saved the checkpoint
            proc = run(2, ARGV + STAGES["zero1"] + LAYOUTS[resumed] + [
                "--load", os.path.join(tmp / f"zero1-{saved}", "iter_0000003"),
                "--metrics-file", str(tmp / f"resume-{saved}.jsonl")])
            return proc.stdout, exact_losses(tmp / f"resume-{saved}.jsonl")
        stage, layout = name.split("-")
        flags = STAGES[stage] + LAYOUTS[layout] + ["--metrics-file", str(tmp / f"{name}.jsonl")]
        if stage == "zero1":
            flags += ["--save", str(tmp / name), "--save-interval", "3"]
        proc = run_pretrain(2, ARGV + flags, nccl=layout == "param" and stage != "zero1")
        assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
        return proc.stdout, metrics(tmp / f"{name}.jsonl")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("layouts"))


def slow_unless(default: bool, *values):
    return pytest.param(*values, marks=() if default else pytest.mark.slow)


@pytest.mark.parametrize("name", [slow_unless(layout == "param", f"{stage}-{layout}") for stage in STAGES
                                  for layout in LAYOUTS] + [slow_unless(False, "zero3-param-hsdp")])
def test_adamw_trains_as_the_single_process_on_both_layouts(runs, name):
    """Every stage on both layouts, and the whole-parameter ZeRO-3 with overlap at DP=4 in two instances
    (hybrid sharding: reduces within the instance, all-reduce of the owned region across). The default
    tier runs the whole-parameter layout (this file's own; pretrain_gpt.py at the slice layout is also
    test_data_parallel_pretrain.py's), the slow tier the slice layout and hybrid sharding."""
    reference, mine = runs["serial"][1], runs[name][1]
    assert sorted(reference) == list(range(1, 7)) and sorted(mine) == sorted(reference)
    for it, (loss, norm) in reference.items():
        assert mine[it][0] == pytest.approx(loss, rel=1e-5), f"loss, iteration {it}"
        assert mine[it][1] == pytest.approx(norm, rel=1e-4), f"grad norm, iteration {it}"


@pytest.mark.parametrize("saved, resumed", [slow_unless(False, "slice", "param"), ("param", "slice")])
def test_a_checkpoint_resumes_in_the_other_layout(runs, saved, resumed):
    full = {it: loss for it, (loss, _) in runs[f"zero1-{saved}"][1].items()}
    stdout, tail = runs[f"resume-{saved}-as-{resumed}"]
    assert "loaded checkpoint" in stdout and sorted(tail) == [4, 5, 6]
    for it in tail:
        assert tail[it] == pytest.approx(full[it], rel=1e-5), f"iteration {it}"


def largest_parameter() -> tuple[int, int]:
    """(elements of all trainable parameters, of the largest one) of the test model."""
    from megalite.train.command_line import parse_args
    from megalite.train.trainer import build_trainer
    named = build_trainer(parse_args(ARGV, world_size=1)).ddp.named_params
    return sum(p.numel() for _, p in named), max(p.numel() for _, p in named)


def test_whole_parameter_optimizer_state_is_the_ranks_share(runs):
    """ZeRO-1, one bucket, fp32: a rank's optimizer state is m and v (master = weights) of the whole
    parameters it owns: together the ranks hold the single process's state, and each is within the
    largest parameter of total/d."""
    _, largest = largest_parameter()
    serial = int(MEMORY_LINE.findall(runs["serial"][0])[0][3])
    per_rank = [int(line[3]) for line in MEMORY_LINE.findall(runs["zero1-param"][0])]
    assert len(per_rank) == 2 and sum(per_rank) == pytest.approx(serial, abs=64)       # step counters aside
    assert all(abs(state - serial / 2) <= 8 * largest for state in per_rank)


@pytest.mark.parametrize("stage, kinds", [("zero2", (2,)), ("zero3", (1, 2))])
def test_whole_parameter_zero_shards_hold_no_padding(runs, stage, kinds):
    """ZeRO-2 gradients and ZeRO-3 parameters and gradients, per-unit buckets: the ranks' shards add up
    to exactly the single process's bytes (no padding), and each rank holds within the largest
    parameter of total/d (memory report, fp32)."""
    total, largest = largest_parameter()
    serial = [int(x) for x in MEMORY_LINE.findall(runs["serial"][0])[0]]
    lines = MEMORY_LINE.findall(runs[f"{stage}-param"][0])
    assert len(lines) == 2
    for kind in kinds:                                     # 1: parameters, 2: gradients (bytes)
        per_rank = [int(line[kind]) for line in lines]
        assert serial[kind] == 4 * total and sum(per_rank) == serial[kind], (kind, per_rank, serial[kind])
        assert all(abs(held - serial[kind] / 2) <= 4 * largest for held in per_rank), (kind, per_rank)
        print(f"{stage} whole-parameter layout, DP=2: {('parameters', 'gradients')[kind - 1]} per rank "
              f"{per_rank} bytes, max / (total/d) = {max(per_rank) / (serial[kind] / 2):.4f}")


@pytest.mark.parametrize("name", ["sgd", "lion"])
def test_only_implemented_optimizers_are_accepted(tmp_path, name):
    one_line_error(run_single(ARGV + ["--optimizer", name]), "--optimizer")
