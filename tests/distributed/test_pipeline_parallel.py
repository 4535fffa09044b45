"""Pipeline parallelism: schedule orders, and the executor's losses and gradients vs one process."""
import pytest
import torch

from harness import run_ranks
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.config.schema import ParallelConfig
from megalite.config.validate import check_pipeline_split
from megalite.errors import UserError
from megalite.parallel.pipeline.orders import gpipe_order, interleaved_order, one_f_one_b_order
from pipeline_workloads import ARGS, one_thread, reference, run_executor  # noqa: F401 (one_thread: autouse fixture)

# Each spawned world costs seconds (every rank imports torch), so one world per size serves every check
# of that size: a rank runs the executor cases below, then pretrain() on the training-loop layouts, and
# the tests assert on their share of the results.
EXECUTOR_CASES = {2: [(2, 1, "1f1b", 1, False, False), (2, 1, "gpipe", 1, False, True), (2, 1, "1f1b", 2, False, True)],
                  4: [(4, 1, "1f1b", 1, False, True), (2, 2, "1f1b", 1, True, False)]}
# (pp, tp, schedule, chunks per rank, sequence parallel, tied embeddings)


def _argv(sp, tied):
    return with_flags(ARGS, untie_embeddings_and_output_weights=not tied, sequence_parallel=sp)


def _run_world(rank, world):
    """This world size's executor cases, then pretrain() on its training-loop layouts."""
    from megalite.train.trainer import pretrain
    executor = [run_executor(rank, world, _argv(sp, tied), pp, tp, schedule, chunks)
                for pp, tp, schedule, chunks, sp, tied in EXECUTOR_CASES[world]]
    loop = [pretrain(parse_args(argv, world_size=world), print_fn=lambda *_: None).history
            for argv in _loop_layouts(world)]
    return executor, loop


@pytest.fixture(scope="module")
def world_of_2():
    return run_ranks(2, _run_world)


@pytest.fixture(scope="module")
def world_of_4():
    return run_ranks(4, _run_world)


@pytest.fixture
def worlds(request):
    """world size -> each rank's results of _run_world (each world spawned once, on first use)."""
    return lambda world: request.getfixturevalue(f"world_of_{world}")


# every layout's losses are also checked through the training loop below; here, gradients per parameter
@pytest.mark.parametrize("pp, tp, schedule, chunks, sp, tied", [c for w in (2, 4) for c in EXECUTOR_CASES[w]])
def test_pipeline_losses_and_gradients_equal_one_process(worlds, pp, tp, schedule, chunks, sp, tied):
    case = EXECUTOR_CASES[pp * tp].index((pp, tp, schedule, chunks, sp, tied))
    results = [executor[case] for executor, _ in worlds(pp * tp)]
    ref_losses, ref_grads = reference(_argv(sp, tied))
    last = results[-1][0]                                    # the last rank holds the last stage
    assert last == pytest.approx(ref_losses, rel=1e-5)
    seen = set()
    for losses, grads in results:
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], atol=1e-6, rtol=1e-5, msg=name)
            seen.add(name)
    if tp == 1:
        assert seen == set(ref_grads)                        # every parameter lives on some stage


def test_schedule_orders():
    assert [(a.kind, a.microbatch) for a in one_f_one_b_order(2, 0, 3)] == \
        [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert [(a.kind, a.microbatch) for a in one_f_one_b_order(2, 1, 3)] == \
        [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    for rank in range(4):
        for order in (one_f_one_b_order(4, rank, 6), gpipe_order(4, rank, 6), interleaved_order(4, rank, 8, 2)):
            forwards = [(a.chunk, a.microbatch) for a in order if a.kind == "F"]
            backwards = [(a.chunk, a.microbatch) for a in order if a.kind == "B"]
            assert sorted(forwards) == sorted(backwards) and len(set(forwards)) == len(forwards)
            for a in order:              # a backward never precedes its own forward
                if a.kind == "B":
                    assert order.index(a) > order.index(type(a)("F", a.chunk, a.microbatch))


@pytest.mark.parametrize("layers, pp, per_virtual, micro, message", [
    (6, 4, None, 4, "--num-layers 6 must be divisible by --pipeline-model-parallel-size 4"),
    (8, 2, 3, 4, "must be divisible by --num-layers-per-virtual-pipeline-stage 3"),
    (8, 2, 2, 3, "needs the number of micro-batches (3) to be a multiple of --pipeline-model-parallel-size 2"),
    (8, 1, 2, 4, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"),
])
def test_bad_pipeline_configurations(layers, pp, per_virtual, micro, message):
    with pytest.raises(UserError) as err:
        check_pipeline_split(layers, ParallelConfig(pipeline_model_parallel_size=pp,
                                                    num_layers_per_virtual_pipeline_stage=per_virtual), micro)
    assert message in str(err.value) and "\n" not in str(err.value)


# ---- through the real training loop --------------------------------------------------------------
LOOP_ARGS = with_flags(TINY_LLAMA_ARGS, num_layers=4, train_iters=10, global_batch_size=8,
                       make_vocab_size_divisible_by=32, lr_warmup_iters=2, lr_decay_style="cosine", clip_grad=0.5,
                       weight_decay=0.1)


def _pretrain_histories(rank, world, layouts):
    from megalite.train.trainer import pretrain
    return [pretrain(parse_args(argv, world_size=world), print_fn=lambda *_: None).history for argv in layouts]


def _loop_layouts(world):
    layouts = {2: [{"pipeline_model_parallel_size": 2},
                   {"pipeline_model_parallel_size": 2, "pipeline_schedule": "gpipe"},
                   {"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1}],
               4: [{"pipeline_model_parallel_size": 4},
                   {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True}]}
    return [with_flags(LOOP_ARGS, untie_embeddings_and_output_weights=not tied, **layout)
            for layout in layouts[world] for tied in (False, True)]


@pytest.mark.parametrize("world", [2, 4])
def test_training_loop_with_pipelining_equals_one_process(worlds, world):
    serial = {tied: _pretrain_histories(0, 1, [with_flags(LOOP_ARGS, untie_embeddings_and_output_weights=not tied)])[0]
              for tied in (False, True)}
    last_rank = worlds(world)[-1][1]                         # the last rank logs the loss
    for argv, history in zip(_loop_layouts(world), last_rank):
        ref = serial["--untie-embeddings-and-output-weights" not in argv]
        assert len(history) == 10
        assert history == pytest.approx(ref, rel=1e-5), argv
