"""Every pipeline schedule through the training loop under the NCCL-semantics tier (nccl_semantics.py):
NCCL's stream and matching rules imposed on gloo, and every rank of a group issuing the same collectives.
The synchronous schedules must equal one process; the asynchronous ones their own delayed reference
(test_pipedream.py runs them under the tier). A fast slice runs in the default suite, the whole matrix
(pp 2 and 4 with TP, DP, ZeRO-1/2/3, FSDP2 and CP) in the slow tier, with a sharded checkpoint's save
and resume."""
import functools

import pytest

from harness import logged_losses, run_pretrain, run_ranks
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args

ARGS = with_flags(TINY_LLAMA_ARGS, num_layers=8, train_iters=3, global_batch_size=8,
                  make_vocab_size_divisible_by=32, lr_warmup_iters=1, clip_grad=0.5, weight_decay=0.1,
                  untie_embeddings_and_output_weights=True)
SCHEDULES = {"1f1b": {}, "gpipe": {"pipeline_schedule": "gpipe"}, "zb-h1": {"pipeline_schedule": "zb-h1"},
             "zbv": {"pipeline_schedule": "zbv"},
             "interleaved": {"num_layers_per_virtual_pipeline_stage": 1}}
COMBOS = {"tp2-sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
          "zero1": {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True},
          "zero2": {"data_parallel_sharding_strategy": "optim_grads", "overlap_grad_reduce": True},
          "zero3": {"data_parallel_sharding_strategy": "optim_grads_params"},
          "fsdp2": {"use_torch_fsdp2": True},
          "cp2": {"context_parallel_size": 2}}
ZERO_BUBBLE_REFUSES = {"zero3", "fsdp2"}        # their weight-gradient pass runs after the layer is reduced


def _argv(schedule: str, pp: int, combo: str | None = None, global_batch_size: int = 8) -> list[str]:
    """Two chunks per rank need a multiple of pp micro-batches: raise the global batch at pp 4 x dp 2."""
    layers = {"interleaved": 2 * pp, "zbv": 2 * pp}.get(schedule, pp)
    num_layers = max(8, layers)
    flags = dict(SCHEDULES[schedule], pipeline_model_parallel_size=pp, num_layers=num_layers,
                 global_batch_size=global_batch_size)
    if schedule == "interleaved":
        flags["num_layers_per_virtual_pipeline_stage"] = num_layers // (2 * pp)
    return with_flags(ARGS, **flags, **(COMBOS[combo] if combo else {}))


def _world(argv: list[str]) -> int:
    def size(flag):
        return int(argv[argv.index(flag) + 1]) if flag in argv else 1
    dp = 2 if any(f in argv for f in ("--use-distributed-optimizer", "--data-parallel-sharding-strategy",
                                      "--use-torch-fsdp2")) else 1
    return size("--pipeline-model-parallel-size") * size("--tensor-model-parallel-size") * \
        size("--context-parallel-size") * dp


def _histories(rank, world, argvs):
    from megalite.train.trainer import pretrain
    return [pretrain(parse_args(argv, world_size=world), print_fn=lambda *_: None).history for argv in argvs]


@functools.cache
def _serial(num_layers: int, global_batch_size: int) -> list:
    return _histories(0, 1, [with_flags(ARGS, num_layers=num_layers, global_batch_size=global_batch_size)])[0]


def check_under_the_tier(argvs: list[list[str]]) -> None:
    """Run each world's argvs in one spawned world under the tier; each logged history equals serial's."""
    for world in sorted({_world(a) for a in argvs}):
        runs = [a for a in argvs if _world(a) == world]
        per_rank = run_ranks(world, _histories, runs, nccl=True)
        for i, argv in enumerate(runs):
            logged = [h[i] for h in per_rank if h[i] and any(h[i])]
            serial = _serial(*(int(argv[argv.index(flag) + 1]) for flag in ("--num-layers", "--global-batch-size")))
            assert logged and logged[0] == pytest.approx(serial, rel=1e-5), argv


def test_schedules_with_dp_tp_cp_under_the_tier():
    check_under_the_tier([_argv("gpipe", 2), _argv("1f1b", 2, "zero1"), _argv("interleaved", 2, "tp2-sp"),
                          _argv("zbv", 2, "cp2")])


MATRIX = [_argv(s, pp) for s in SCHEDULES for pp in (2, 4)] + \
         [_argv(s, 2, c) for s in SCHEDULES for c in COMBOS
          if not (s in ("zb-h1", "zbv") and c in ZERO_BUBBLE_REFUSES)] + \
         [_argv("1f1b", 4, "zero1"), _argv("zbv", 4, "zero2", global_batch_size=16), _argv("interleaved", 4, "tp2-sp")]


@pytest.mark.slow
def test_every_schedule_and_layout_under_the_tier():
    check_under_the_tier(MATRIX)


@pytest.mark.slow
def test_a_sharded_checkpoint_saves_and_resumes_under_the_tier(tmp_path):
    """Saving exchanges the tensor index (two all-to-alls: byte counts, then bytes) and agrees on errors;
    loading reads only its own index files. Under the tier, a PP2 x ZeRO-1 run saved at iteration 2 resumes
    to iteration 3 with the uninterrupted run's history."""
    argv = with_flags(_argv("1f1b", 2, "zero1"), save=str(tmp_path / "ck"), save_interval=2)
    whole = run_pretrain(4, argv, nccl=True)
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = run_pretrain(4, with_flags(argv, save=str(tmp_path / "ck2"), train_iters=2), nccl=True)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_pretrain(4, with_flags(argv, save=str(tmp_path / "ck2"), load=str(tmp_path / "ck2")), nccl=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert logged_losses(resumed.stdout)[3] == logged_losses(whole.stdout)[3]
