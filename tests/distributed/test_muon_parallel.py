"""--optimizer muon through pretrain_gpt.py at layouts that split experts or reshard a checkpoint.

A tiny Llama-MoE (test_moe_parallel.py's: 8 experts, top-2, shared expert, aux loss) trained with Muon logs
the serial run's losses and gradient norms at EP=2, EP=2 x DP=2 ZeRO-1, ETP=2 and EP=2 x ETP=2 ZeRO-1: each
expert of the stacked weights is a matrix of its own, orthogonalised on the rank that holds it (gathered over
the expert-tensor-parallel group first when ETP splits it); --muon-tp-mode distributed's all-reduces pass the
NCCL-semantics tier with the serial losses. A dense Muon checkpoint saved at
TP=2 x DP=2 ZeRO-1 resumes at DP=4 ZeRO-1 and serially with the uninterrupted run's losses (the momentum of
the TP-sharded matrices reshards like every other tensor). EP=2 x DP=2 ZeRO-3 equals serial too, and at DP=2
ZeRO-3 (whole parameters, balanced by Newton-Schulz FLOPs) each rank's parameter, gradient and optimizer-state
bytes are those of the parameters it owns: about half of the single process's each. Under FSDP2 (DP=2, DP=2 x
TP=2 + SP in duplicated and distributed mode, and DP=3 with uneven rows) the dense model equals serial, its rows redistributed to whole matrices on
their owners, and its checkpoint resumes at ZeRO-3 and serially."""
import os

import pytest

from harness import logged_losses, run_pretrain
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from test_data_parallel_pretrain import MEMORY_LINE
from test_moe_parallel import ARGV as MOE_ARGV, assert_equal_runs, train

MUON = dict(optimizer="muon", lr="2e-2", muon_fp32_matmul_prec="high")
LAYOUTS = {"ep2-etp2-zero1": (4, dict(expert_model_parallel_size=2, expert_tensor_parallel_size=2,
                                      use_distributed_optimizer=True)),
           "ep2-dp2-zero3": (4, dict(expert_model_parallel_size=2, data_parallel_sharding_strategy="optim_grads_params"))}
SLOW_LAYOUTS = {"ep2-dp2-zero1": (4, dict(expert_model_parallel_size=2, use_distributed_optimizer=True)),
                "ep2": (2, dict(expert_model_parallel_size=2)),          # each part of ep2-etp2 alone
                "ep1-etp2": (2, dict(expert_tensor_parallel_size=2))}
# FSDP2 (no MoE there): row shards redistributed to whole matrices on their owners; DP=3 cuts rows unevenly
DENSE_ARGV = with_flags(TINY_LLAMA_ARGS, global_batch_size=12)
FSDP2_LAYOUTS = {"fsdp2-dp2": (2, dict(use_torch_fsdp2=True)),
                 "fsdp2-dp2-tp2-sp": (4, dict(use_torch_fsdp2=True, tensor_model_parallel_size=2, sequence_parallel=True))}
SLOW_FSDP2_LAYOUTS = {"fsdp2-dp3": (3, dict(use_torch_fsdp2=True)),
                      "fsdp2-dp2-tp2-sp-distributed": (4, dict(use_torch_fsdp2=True, tensor_model_parallel_size=2,
                                                               sequence_parallel=True, muon_tp_mode="distributed"))}


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


@pytest.fixture(scope="module")
def serial_dense():
    return train(1, MUON, base=DENSE_ARGV)


@pytest.mark.parametrize("layout", list(FSDP2_LAYOUTS) + [pytest.param(name, marks=pytest.mark.slow)
                                                            for name in SLOW_FSDP2_LAYOUTS])
def test_muon_under_fsdp2_equals_serial(serial_dense, layout):
    """--use-torch-fsdp2: each rank's rows of a matrix's update go to its owner by one all-to-all, the owner
    orthogonalises it whole (gathered over TP first) and a second all-to-all brings the rows back; under the
    NCCL-semantics tier, every rank issues the same collectives in the same order. AdamW differs."""
    nproc, flags = {**FSDP2_LAYOUTS, **SLOW_FSDP2_LAYOUTS}[layout]
    assert_equal_runs(serial_dense, train(nproc, {**MUON, **flags}, nccl=True, base=DENSE_ARGV))
    if layout == "fsdp2-dp2":
        adam = train(1, {**MUON, "optimizer": "adam"}, base=DENSE_ARGV)
        assert max(abs(adam[i][0] - serial_dense[i][0]) for i in range(2, 5)) > 1e-3, (adam, serial_dense)


def test_muon_gathers_under_nccl_semantics(serial_moe):
    """Muon's all-gathers of TP-sharded matrices and of ETP-split experts are collectives every rank of
    the group issues in the same order (the NCCL-semantics tier compares the ranks' logs)."""
    flags = dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
                 use_distributed_optimizer=True)
    assert_equal_runs(serial_moe, train(4, {**MUON, **flags}, nccl=True, base=MOE_ARGV))


@pytest.mark.slow
def test_muon_distributed_all_reduces_under_nccl_semantics(serial_moe):
    """--muon-tp-mode distributed's all-reduces (sums of squares, Gram matrices) over TP and over the ETP
    group (TP's size here) pass the NCCL-semantics tier, and the run logs the serial losses. (Slow tier: the
    default tier checks the mode's rule on 2 TP ranks in test_muon_tp_modes.py.)"""
    flags = dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
                 use_distributed_optimizer=True, muon_tp_mode="distributed")
    assert_equal_runs(serial_moe, train(4, {**MUON, **flags}, nccl=True, base=MOE_ARGV))


CKPT_ARGV = with_flags(TINY_LLAMA_ARGS, global_batch_size=8, micro_batch_size=1, **MUON)


@pytest.fixture(scope="module")
def saved_tp2_dp2(tmp_path_factory):
    """The uninterrupted dense Muon run at TP=2 x DP=2 ZeRO-1, its tracker rewound to the iteration-2
    checkpoint; its losses."""
    save = str(tmp_path_factory.mktemp("muon_ckpt") / "ckpt")
    full = run_pretrain(4, with_flags(CKPT_ARGV, tensor_model_parallel_size=2, use_distributed_optimizer=True,
                                      save=save, save_interval=2))
    assert full.returncode == 0, full.stderr[-3000:]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")                                  # resume from the iteration-2 checkpoint
    return save, logged_losses(full.stdout)


@pytest.mark.parametrize("nproc, flags", [pytest.param(1, {}, id="serial"),
                                          pytest.param(4, dict(use_distributed_optimizer=True), id="dp4-zero1",
                                                       marks=pytest.mark.slow)])
def test_muon_checkpoint_saved_at_tp2_dp2_resumes_at_another_layout(saved_tp2_dp2, nproc, flags):
    """The momentum of the TP-sharded matrices reshards like every other tensor: serially (default tier)
    and at DP=4 ZeRO-1 (slow tier), the uninterrupted run's losses."""
    save, uninterrupted = saved_tp2_dp2
    resumed = run_pretrain(nproc, with_flags(CKPT_ARGV, load=save, **flags))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ours = logged_losses(resumed.stdout)
    assert sorted(ours) == [3, 4], ours
    assert all(abs(ours[i] - uninterrupted[i]) <= 1e-5 for i in ours), (nproc, ours, uninterrupted)


def owned_elements(argv, ranks):
    """Per data-parallel rank of the whole-parameter layout: (Muon matrix elements, other elements) it owns,
    from the layout pretrain_gpt.py builds (owners balanced by Newton-Schulz FLOPs)."""
    from megalite.model.chunks import build_model_chunks
    from megalite.optim.muon_cost import owner_cost
    from megalite.parallel.data.grad_buffer import ParamAndGradBuffer
    from megalite.parallel.tensor.layers import TensorParallel
    from megalite.train.command_line import parse_args
    config = parse_args(argv, world_size=1)
    named = list(build_model_chunks(config.model, 1, TensorParallel(rank=0, size=1), 0, 1, 1, meta=True)[0]
                 .named_parameters())
    cost = owner_cost(config.model, config.optimizer)
    buffer = ParamAndGradBuffer(named, None, 0, ranks, whole_params=True, owner_cost=cost, device="cpu")
    (bucket,) = buffer.buckets
    owned = [[0, 0] for _ in range(ranks)]
    for name, param in named:
        rank = next(r for r in range(ranks) if bucket.chunk(r)[0] <= buffer.slots[name].start < bucket.chunk(r)[1])
        owned[rank][cost(name, param) is None] += param.numel()
    return owned


def test_muon_zero3_rank_holds_its_owned_share():
    """fp32 Muon at DP=2 ZeRO-3 (under the NCCL-semantics tier): a rank's parameter and gradient shards are
    4 bytes per owned element, its optimizer state 4 per owned matrix element (momentum) and 8 per other
    owned element (AdamW's moments; the fp32 weights are the master copy); together the single process's
    bytes, each rank within 5% of half of them."""
    argv = with_flags(TINY_LLAMA_ARGS, train_iters=2, **MUON)
    serial = run_pretrain(1, argv)
    zero3 = run_pretrain(2, with_flags(argv, data_parallel_sharding_strategy="optim_grads_params"), nccl=True)
    assert serial.returncode == 0 and zero3.returncode == 0, serial.stderr[-2000:] + zero3.stderr[-2000:]
    whole = [int(x) for x in MEMORY_LINE.findall(serial.stdout)[0][1:4]]
    lines = MEMORY_LINE.findall(zero3.stdout)
    assert [int(line[0]) for line in lines] == [0, 1]
    for (matrices, other), line in zip(owned_elements(argv, 2), lines):
        params, grads, state = (int(x) for x in line[1:4])
        assert params == grads == 4 * (matrices + other), (line, matrices, other)
        assert abs(state - (4 * matrices + 8 * other)) <= 64, (line, matrices, other)     # step counters aside
    for kind, total in enumerate(whole):
        per_rank = [int(line[kind + 1]) for line in lines]
        assert abs(sum(per_rank) - total) <= 64 and max(per_rank) <= 1.05 * total / 2, (kind, per_rank, total)
        print(f"Muon ZeRO-3 DP=2, {('parameters', 'gradients', 'optimizer state')[kind]}: per rank {per_rank} "
              f"bytes, max / (total/d) = {max(per_rank) / (total / 2):.4f}")


@pytest.mark.slow
def test_muon_checkpoint_saved_under_fsdp2_resumes_at_zero3_and_serially(tmp_path):
    """The row-sharded momentum of an FSDP2 run reshards into ZeRO-3's whole-parameter owners and into the
    single process, with the uninterrupted losses."""
    save = str(tmp_path / "ckpt")
    argv = with_flags(DENSE_ARGV, **MUON)
    full = run_pretrain(2, with_flags(argv, use_torch_fsdp2=True, save=save, save_interval=2))
    assert full.returncode == 0, full.stderr[-3000:]
    uninterrupted = logged_losses(full.stdout)
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    for nproc, flags in ((2, dict(data_parallel_sharding_strategy="optim_grads_params")), (1, {})):
        resumed = run_pretrain(nproc, with_flags(argv, load=save, **flags))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        ours = logged_losses(resumed.stdout)
        assert sorted(ours) == [3, 4] and all(abs(ours[i] - uninterrupted[i]) <= 1e-5 for i in ours), (nproc, ours)
