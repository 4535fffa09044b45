"""--optimizer muon through pretrain_gpt.py at layouts that split experts or reshard a checkpoint.

A tiny Llama-MoE (test_moe_parallel.py's: 8 experts, top-2, shared expert, aux loss) trained with Muon logs
the serial run's losses and gradient norms at EP=2, EP=2 x DP=2 ZeRO-1, ETP=2 and EP=2 x ETP=2 ZeRO-1: each
expert of the stacked weights is a matrix of its own, orthogonalised on the rank that holds it (gathered over
the expert-tensor-parallel group first when ETP splits it); --muon-tp-mode distributed's all-reduces pass the
NCCL-semantics tier with the serial losses. A dense Muon checkpoint saved at
TP=2 x DP=2 ZeRO-1 resumes at DP=4 ZeRO-1 and serially with the uninterrupted run's losses (the momentum of
the TP-sharded matrices reshards like every other tensor)."""
import os

import pytest

from harness import logged_losses, run_pretrain
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from test_moe_parallel import ARGV as MOE_ARGV, assert_equal_runs, train

MUON = dict(optimizer="muon", lr="2e-2", muon_fp32_matmul_prec="high")
LAYOUTS = {"ep2-dp2-zero1": (4, dict(expert_model_parallel_size=2, use_distributed_optimizer=True)),
           "ep2-etp2-zero1": (4, dict(expert_model_parallel_size=2, expert_tensor_parallel_size=2,
                                      use_distributed_optimizer=True))}
SLOW_LAYOUTS = {"ep2": (2, dict(expert_model_parallel_size=2)),          # each part of the two above alone
                "ep1-etp2": (2, dict(expert_tensor_parallel_size=2))}


@pytest.fixture(scope="module")
def serial_moe():
    return train(1, MUON, base=MOE_ARGV)


def test_muon_and_adamw_moe_runs_differ(serial_moe):
    """The layouts' comparison can fail: the same serial run with AdamW logs other losses."""
    adam = train(1, {**MUON, "optimizer": "adam"}, base=MOE_ARGV)
    assert max(abs(adam[i][0] - serial_moe[i][0]) for i in range(2, 5)) > 1e-3, (adam, serial_moe)


@pytest.mark.parametrize("layout", list(LAYOUTS) + [pytest.param(name, marks=pytest.mark.slow)
                                                      for name in SLOW_LAYOUTS])
def test_muon_moe_at_expert_parallel_layouts_equals_serial(serial_moe, layout):
    nproc, flags = {**LAYOUTS, **SLOW_LAYOUTS}[layout]
    assert_equal_runs(serial_moe, train(nproc, {**MUON, **flags}, base=MOE_ARGV))


def test_muon_gathers_under_nccl_semantics(serial_moe):
    """Muon's all-gathers of TP-sharded matrices and of ETP-split experts are collectives every rank of
    the group issues in the same order (the NCCL-semantics tier compares the ranks' logs)."""
    flags = dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
                 use_distributed_optimizer=True)
    assert_equal_runs(serial_moe, train(4, {**MUON, **flags}, nccl=True, base=MOE_ARGV))


def test_muon_distributed_all_reduces_under_nccl_semantics(serial_moe):
    """--muon-tp-mode distributed's all-reduces (sums of squares, Gram matrices) over TP and over the ETP
    group (TP's size here) pass the NCCL-semantics tier, and the run logs the serial losses."""
    flags = dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
                 use_distributed_optimizer=True, muon_tp_mode="distributed")
    assert_equal_runs(serial_moe, train(4, {**MUON, **flags}, nccl=True, base=MOE_ARGV))


def test_muon_checkpoint_saved_at_tp2_dp2_resumes_at_dp4_and_serially(tmp_path):
    save = str(tmp_path / "ckpt")
    argv = with_flags(TINY_LLAMA_ARGS, global_batch_size=8, micro_batch_size=1, **MUON)
    full = run_pretrain(4, with_flags(argv, tensor_model_parallel_size=2, use_distributed_optimizer=True,
                                      save=save, save_interval=2))
    assert full.returncode == 0, full.stderr[-3000:]
    uninterrupted = logged_losses(full.stdout)
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")                                  # resume from the iteration-2 checkpoint
    for nproc, flags in ((4, dict(use_distributed_optimizer=True)), (1, {})):
        resumed = run_pretrain(nproc, with_flags(argv, load=save, **flags))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        ours = logged_losses(resumed.stdout)
        assert sorted(ours) == [3, 4], ours
        assert all(abs(ours[i] - uninterrupted[i]) <= 1e-5 for i in ours), (nproc, ours, uninterrupted)
