"""--fake-process-group: one process plays rank R of a world it does not have, on torch's fake backend,
and holds exactly what rank R of the real run holds.

The real run (torchrun, gloo) prints every rank's state from rank 0 ("memory rank R: parameters ... |
gradients ... | optimizer state ...") and, with --log-memory-breakdown, each rank its first step's peak
by category and its activations by layer; each dry run prints its own rank's lines, which must be the
same bytes (without storage: the same but for the inputs' copies to the device), and trains its
--train-iters steps to the end (its values are meaningless: its peers' tensors
never arrive, so no NaN check stops it). The default suite runs a 4-rank pipeline x ZeRO-3 layout with
virtual stages; the slow tier an 8-rank TP x PP x EP MoE layout, routed evenly
(--moe-router-force-load-balancing: every rank routes alike, which is what a dry run assumes of the
peers whose token counts it never receives, and without storage of its own router too)."""
import os
import re
import subprocess
import sys

import pytest

from harness import ROOT, run_pretrain
from megalite.train.memory_account import CATEGORIES, parse_breakdowns
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_layouts import AGREEMENT_ARGS, AGREEMENT_RANKS  # noqa: E402

BASE = with_flags(TINY_LLAMA_ARGS, num_layers=4, global_batch_size=8, train_iters=2)
BATCH_TOKENS = 2 * 32                   # a micro-batch's: --micro-batch-size x --seq-length
# name -> (world, flags, the ranks dry-run: the default suite's two cover both stages and both DP shards)
LAYOUTS = {
    "pp2-vpp-dp2-zero3": (4, dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1,
                                  data_parallel_sharding_strategy="optim_grads_params"), (1, 2)),
}
SLOW_LAYOUTS = {
    "tp2-pp2-ep2-moe-zero1": (8, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                      sequence_parallel=True, num_experts=4, moe_router_topk=2,
                                      expert_model_parallel_size=2, use_distributed_optimizer=True,
                                      moe_router_force_load_balancing=True), range(8)),
}
MEMORY_LINE = re.compile(r"^memory rank (\d+)(?: \w+ weights)?: .*$", re.M)


def memory_lines(stdout: str) -> dict[int, list[str]]:
    lines = {}
    for m in MEMORY_LINE.finditer(stdout):
        lines.setdefault(int(m.group(1)), []).append(m.group(0))
    return lines


def environment(**extra) -> dict:
    """This process's environment less any launcher's variables, plus ``extra``."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in launcher}, "OMP_NUM_THREADS": "1",
            "WANDB_MODE": "offline", **extra}


def dry_run(argv: list[str], world: int, rank: int) -> str:
    cmd = [sys.executable, f"{ROOT}/pretrain_gpt.py", *argv, "--fake-process-group", "--fake-world-size", str(world),
           "--fake-rank", str(rank)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=environment())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def check_layout(world: int, flags: dict, ranks, no_storage: bool = True, whole_step: bool = True) -> None:
    """Each dry run holds the real rank's state, and accounts its first step's bytes exactly as the real
    rank does (--log-memory-breakdown; ``whole_step`` False: the state it holds, not the step's); without storage
    (where the layout runs so), within the inputs' host-to-device copies."""
    argv = with_flags(BASE, **flags)
    real = run_pretrain(world, argv + ["--log-memory-breakdown"])
    assert real.returncode == 0, real.stderr[-3000:]
    expected, breakdowns = memory_lines(real.stdout), parse_breakdowns(real.stdout)
    assert sorted(expected) == sorted(breakdowns) == list(range(world))
    for rank in ranks:
        out = dry_run(argv, world, rank)
        assert memory_lines(out) == {rank: expected[rank]}, f"rank {rank}"
        if whole_step:
            assert parse_breakdowns(out) == {rank: breakdowns[rank]}, f"rank {rank}"
        else:
            assert sorted(parse_breakdowns(out)) == [rank], out[-2000:]       # it accounts the step too
        assert re.search(r"iteration\s+2/\s+2 \|", out), out[-2000:]            # it logs as the rank it plays
        if no_storage:
            check_no_storage(dry_run(argv + ["--no-storage"], world, rank), rank, breakdowns[rank])


def check_no_storage(out: str, rank: int, real: dict) -> None:
    """The same bytes by category, but for the inputs a real device receives from the host (on a CPU
    the micro-batches' tensors are used in place, on the meta device they are copies)."""
    (measured,) = parse_breakdowns(out).values()
    inputs = 4 * 8 * BATCH_TOKENS                        # tokens, labels, position ids, loss mask per micro-batch
    assert real["peak"] <= measured["peak"] <= real["peak"] + inputs, (rank, measured, real)
    for category in CATEGORIES:
        slack = inputs if category == "activations" else 0
        assert real[category] <= measured[category] <= real[category] + slack, (rank, category, measured, real)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_dry_run_holds_what_the_real_rank_holds(layout):
    check_layout(*LAYOUTS[layout])


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW_LAYOUTS)
def test_a_dry_run_holds_what_the_real_rank_holds_moe(layout):
    check_layout(*SLOW_LAYOUTS[layout])


def test_a_dry_run_holds_what_the_real_rank_holds_under_fsdp2():
    """FSDP2's shards as the memory account's parameters and gradients; --no-storage is refused with it.
    The step's bytes are not compared: FSDP2's gather and reduction buffers are torch's own, and how long they
    live depends on when the peer's collective completes, which the dry run's peers do at once."""
    check_layout(2, dict(use_torch_fsdp2=True), (1,), no_storage=False, whole_step=False)


def test_a_dry_run_reads_a_real_dataset_as_a_later_rank_from_the_environment(tmp_path):
    """The rank and world from RANK/WORLD_SIZE; rank 0 builds the index caches that the other ranks map,
    and a dry run has no rank 0, so it builds them."""
    import numpy as np
    from megalite.data.indexed_dataset import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(str(tmp_path / "corpus"), np.uint16)
    for d in range(200):
        builder.add_document(np.append(np.arange(1, 40) % 150 + d % 7, 199))
    builder.finalize()
    argv = with_flags(BASE, mock_data=None, data_path=str(tmp_path / "corpus"), split="98,2,0",
                      pipeline_model_parallel_size=2)
    proc = subprocess.run([sys.executable, f"{ROOT}/pretrain_gpt.py", *argv, "--fake-process-group"],
                          capture_output=True, text=True, timeout=300, env=environment(WORLD_SIZE="4", RANK="3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(memory_lines(proc.stdout)) == [3] and os.path.isdir(tmp_path / "cache")


@pytest.mark.slow
def test_a_0_7b_layout_agrees_in_a_real_run_and_both_dry_runs():
    """bench/bench_layouts.py's agreement layout (the ~0.7B bf16 Llama at TP2 x PP2 x DP2, ZeRO-3): the real
    8-process run and the dry runs with and without storage agree on each role's peak within 3% (the first
    and the last pipeline stage: every TP and DP rank of a stage holds the same); with storage, exactly."""
    real = run_pretrain(8, AGREEMENT_ARGS + ["--log-memory-breakdown"], timeout=1200)
    assert real.returncode == 0, real.stderr[-3000:]
    measured = parse_breakdowns(real.stdout)
    assert sorted(measured) == list(range(8))
    for rank in AGREEMENT_RANKS:
        with_storage = parse_breakdowns(dry_run(AGREEMENT_ARGS, 8, rank))[rank]
        without = parse_breakdowns(dry_run(AGREEMENT_ARGS + ["--no-storage"], 8, rank))[rank]
        for peak in (with_storage["peak"], without["peak"]):
            assert abs(peak / measured[rank]["peak"] - 1) <= 0.03, (rank, peak, measured[rank])
        assert with_storage == measured[rank]
