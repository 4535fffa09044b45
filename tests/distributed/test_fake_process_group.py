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
# FP8 (whole 128-blocks for blockwise: hidden 128, FFN 256, heads of 64): each recipe serially, and ZeRO-3 gathering
# the FP8 layers' weights in FP8 (both ranks); blockwise emulated (no CPU kernel for its scale layout)
FP8_BASE = with_flags(BASE, num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=2,
                      fp8_format="hybrid")
FP8_LAYOUTS = {
    "tensorwise": (1, dict(fp8_recipe="tensorwise"), (0,)),
    "delayed": (1, dict(fp8_recipe="delayed", fp8_amax_history_len=16), (0,)),
    "blockwise": (1, dict(fp8_recipe="blockwise", fp8_emulate=True), (0,)),
    "dp2-zero3-fp8-param-gather": (2, dict(fp8_recipe="tensorwise", fp8_param_gather=True,
                                           data_parallel_sharding_strategy="optim_grads_params"), (0, 1)),
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


def check_layout(world: int, flags: dict, ranks, no_storage: bool = True, whole_step: bool = True,
                 base: list[str] = BASE) -> dict:
    """Each dry run holds the real rank's state, and accounts its first step's bytes exactly as the real
    rank does (--log-memory-breakdown; ``whole_step`` False: the state it holds, not the step's); without storage
    (where the layout runs so), within the inputs' host-to-device copies. Returns the real run's breakdowns."""
    argv = with_flags(base, **flags)
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
    return breakdowns


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


@pytest.mark.parametrize("layout", [layout if layout in ("tensorwise", "dp2-zero3-fp8-param-gather") else
                                    pytest.param(layout, marks=pytest.mark.slow) for layout in FP8_LAYOUTS])
def test_a_dry_run_holds_what_the_real_rank_holds_with_fp8(layout):
    """FP8's bytes as the real rank holds them: the GEMMs' quantisation in backward's temporaries (without
    storage on the path the real rank's kernels take: torch._scaled_mm here for tensorwise, the emulation
    for blockwise), delayed scaling's histories and --fp8-param-gather's FP8 chunks in the parameters, its
    FP8 gathers in the gathered parameters."""
    check_layout(*FP8_LAYOUTS[layout], base=FP8_BASE)


def test_fp8_changes_the_bytes_and_the_dry_run_follows():
    """Against the same runs without FP8: the parameters grow by the FP8 state (delayed: 4 bytes x 3 operands x
    (16 history entries + a scale + the step's amax) per linear; ZeRO-3: a byte per element of its chunk of
    the FP8 weights), ZeRO-3's gathers shrink, the quantisation adds backward temporaries (dry runs with
    storage, which hold what the real ranks hold: the test above)."""
    plain = parse_breakdowns(dry_run(with_flags(FP8_BASE, fp8_format=None), 1, 0))[0]
    delayed = parse_breakdowns(dry_run(with_flags(FP8_BASE, **FP8_LAYOUTS["delayed"][1]), 1, 0))[0]
    linears, h, ffn, kv = 2 * 4, 128, 256, 2 * 64
    assert delayed["parameters"] - plain["parameters"] == linears * 3 * 4 * (16 + 2)
    assert delayed["backward temporaries"] > plain["backward temporaries"] + 12 * 2 * ffn * BATCH_TOKENS
    world, flags, _ = FP8_LAYOUTS["dp2-zero3-fp8-param-gather"]
    bf16 = {k: v for k, v in flags.items() if not k.startswith("fp8")}
    zero3 = parse_breakdowns(dry_run(with_flags(FP8_BASE, fp8_format=None, **bf16), world, 1))[1]
    fp8 = parse_breakdowns(dry_run(with_flags(FP8_BASE, **flags), world, 1))[1]
    fp8_weights = 2 * (h * (h + 2 * kv) + h * h + 3 * ffn * h)       # qkv, proj, fc1 (SwiGLU), fc2 per layer
    assert fp8["parameters"] - zero3["parameters"] == fp8_weights // world
    assert fp8["gathered parameters"] < zero3["gathered parameters"]


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
