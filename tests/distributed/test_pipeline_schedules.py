"""Pipeline schedules: every order is complete, causal and deadlock-free (simulated), its posting plan runs
under NCCL's stream rules (simulated; the executor itself runs under the NCCL-semantics tier), it meets its
bubble theory with unit costs, and the zero-bubble schedules (zb-h1, zbv) equal one process."""
import functools

import pytest
import torch

from harness import run_ranks
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.errors import UserError
from megalite.config.schema import SYNCHRONOUS_SCHEDULES, ZERO_BUBBLE_SCHEDULES
from megalite.parallel.pipeline.orders import schedule_order
from megalite.parallel.pipeline.plan import RankPlan, async_step_plan, schedule_plans, stream_replay
from megalite.parallel.pipeline.simulate import replay_schedule
from pipeline_workloads import ARGS, one_thread, reference, run_executor  # noqa: F401 (one_thread: autouse fixture)

LAYOUTS = [(schedule, pp, m, chunks) for schedule in SYNCHRONOUS_SCHEDULES for pp in (2, 4) for m in (4, 8, 16)
           for chunks in ((2,) if schedule == "zbv" else (1, 2) if schedule == "1f1b" else (1,))]


def _orders(schedule, pp, m, chunks):
    return [schedule_order(schedule, pp, r, m, chunks) for r in range(pp)]


def unit_cost_bubble(schedule, pp, m, chunks=1):
    """The order's bubble with F = 1 and B = 2 per rank (B = W = 1 when the schedule splits B and W), a
    chunk taking 1/chunks of that (replay_schedule also fails on a deadlock or a mismatched message)."""
    cost = {"F": 1.0, "B": 1.0, "W": 1.0} if schedule in ZERO_BUBBLE_SCHEDULES else {"F": 1.0, "B": 2.0}
    return replay_schedule(schedule, pp, m, chunks, lambda rank, action: cost[action.kind] / chunks).bubble


@pytest.mark.parametrize("schedule, pp, m, chunks", LAYOUTS)
def test_orders_are_complete_causal_and_deadlock_free(schedule, pp, m, chunks):
    for order in _orders(schedule, pp, m, chunks):
        seen = {}
        for a in order:
            assert (a.kind, a.chunk, a.microbatch) not in seen, a
            seen[(a.kind, a.chunk, a.microbatch)] = len(seen)
        work = {(c, i) for c in range(chunks) for i in range(m)}
        assert {(c, i) for k, c, i in seen if k == "F"} == work and {(c, i) for k, c, i in seen if k == "B"} == work
        for (kind, c, i), at in seen.items():
            if kind == "B":
                assert at > seen[("F", c, i)]
            if kind == "W":
                assert at > seen[("B", c, i)]
        if schedule in ("zb-h1", "zbv"):
            assert {(c, i) for k, c, i in seen if k == "W"} == work
    unit_cost_bubble(schedule, pp, m, chunks)


@pytest.mark.parametrize("schedule", SYNCHRONOUS_SCHEDULES)
def test_plans_run_under_nccl_stream_rules(schedule):
    """Every schedule at pp 2/4/8, m 4/8/16, with and without virtual stages, training and evaluation: the
    executor's posts complete with one FIFO stream per rank pair and with one per rank, whatever the
    receive-ahead depth, and every message reaches the receive meant for it."""
    for pp in (2, 4, 8):
        for m in (4, 8, 16):
            for chunks in (2,) if schedule == "zbv" else (1, 2) if schedule == "1f1b" and m % pp == 0 else (1,):
                for forward_only in (False, True):
                    plans = list(schedule_plans(schedule, pp, m, chunks, forward_only))
                    for per in ("pair", "rank"):
                        for ahead in (0, 1, 4):
                            stream_replay(plans, ahead, per)


def _async_run(pp: int, m: int, steps: int, restart: int | None = None) -> list[list[tuple]]:
    """Each rank's actions over a run of the asynchronous schedules' step plans, micro-batches numbered
    over the run (H as the forward input it holds); every step's plans run under NCCL's stream rules.
    ``restart``: the step at which the stream starts afresh (as after loading a checkpoint)."""
    total, run = steps * m, [[] for _ in range(pp)]
    for t in range(restart or 0, steps):
        plans = [async_step_plan(pp, r, m, t == (restart or 0), total - t * m) for r in range(pp)]
        for per in ("pair", "rank"):
            for ahead in (0, 1, 4):
                stream_replay(plans, ahead, per)
        for r, plan in enumerate(plans):
            run[r] += [(a.kind, t * m + a.microbatch) for a in plan.order]
    return run


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 4), (4, 1), (4, 2), (4, 3), (4, 8), (8, 4)])
def test_async_steps_are_the_pipedream_stream_and_run_under_nccl_stream_rules(pp, m):
    """The step plans of pipedream / pipedream-2bw, one after another, are each stage's stream: w = pp - 1 - s
    warm-up forwards, then pairs (F(j + w), B(j)), the forwards stopping at the run's end; each stage but
    the first holds the next step's first forward input, received at the end of the step before."""
    steps = 5
    for restart in (None, 2):
        run = _async_run(pp, m, steps, restart)
        first = (restart or 0) * m
        for stage, actions in enumerate(run):
            w, total = pp - 1 - stage, steps * m
            stream = [("F", j) for j in range(first, min(first + w, total))]
            for j in range(first, total):
                stream += [("F", j + w)] if j + w < total else []
                stream += [("B", j)]
                if stage > 0 and (j + 1) % m == 0 and j + 1 + w < total:
                    stream += [("H", j + 1 + w)]
            assert actions == stream, (stage, restart)


def _in_action_order(plan: RankPlan) -> RankPlan:
    """The plan with each rank posting in its own action order instead of plan.py's global one."""
    posts = sorted(plan.posts, key=lambda post: (post.action, post.send))
    at = {post: i for i, post in enumerate(posts)}
    return RankPlan(plan.order, plan.stages, posts, {a: at[plan.posts[i]] for a, i in plan.receive_of.items()},
                    {a: at[plan.posts[i]] for a, i in plan.send_of.items()},
                    {at[plan.posts[i]]: a for i, a in plan.source_action.items()})


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("1f1b", 2), ("zbv", 2)])
def test_posting_in_action_order_deadlocks_under_the_stream_rules(schedule, chunks):
    """The simulator can fail: each rank posting in its own action order is what hangs on NCCL."""
    with pytest.raises(RuntimeError, match="deadlock"):
        stream_replay([_in_action_order(p) for p in schedule_plans(schedule, 2, 4, chunks)], 1)


@pytest.mark.parametrize("pp, m", [(2, 8), (4, 8), (4, 16)])
def test_unit_cost_bubbles_meet_theory(pp, m):
    """With F = 1, B = 2 (1F1B) or B = W = 1 (zero bubble): the orders themselves reach the theory of
    the bubble formulas (Narayanan et al. 2021) and Qi et al. 2024; what bench/bench_pipeline.py measures beyond is the executor's."""
    def bubble(schedule, chunks=1):
        return unit_cost_bubble(schedule, pp, m, chunks)
    assert bubble("1f1b") == pytest.approx((pp - 1) / (m + pp - 1))
    assert bubble("gpipe") == pytest.approx((pp - 1) / (m + pp - 1))
    assert bubble("1f1b", 2) == pytest.approx((pp - 1) / (2 * m + pp - 1))
    assert bubble("zb-h1") <= (pp - 1) / (3 * m + pp - 1) + 1e-9
    assert bubble("zbv", 2) <= bubble("zb-h1")



# ---- zero-bubble schedules vs one process ----------------------------------------------------------
# Each spawned world costs seconds (every rank imports torch), so one world serves several checks: a rank
# runs every executor case it is given, then pretrain() on every training-loop layout, and the tests
# below assert on their share of the results.
LOOP_ARGS = with_flags(TINY_LLAMA_ARGS, num_layers=4, train_iters=4, global_batch_size=8,
                       make_vocab_size_divisible_by=32, lr_warmup_iters=1, clip_grad=0.5, weight_decay=0.1)


def _argv(tied, sp=False, num_layers=4):
    return with_flags(ARGS, untie_embeddings_and_output_weights=not tied, sequence_parallel=sp, num_layers=num_layers)


def _loop_argv(tied, **layout):
    return with_flags(LOOP_ARGS, untie_embeddings_and_output_weights=not tied, **layout)


def _run_cases(rank, world, executor_cases, loop_argvs):
    """Every executor case (argv, pp, tp, schedule), then pretrain() on every loop argv, in one world."""
    from megalite.train.trainer import pretrain
    executor = [run_executor(rank, world, argv, pp, tp, schedule, 2 if schedule == "zbv" else 1)
                for argv, pp, tp, schedule in executor_cases]
    loop = [pretrain(parse_args(argv, world_size=world), print_fn=lambda *_: None).history for argv in loop_argvs]
    return executor, loop


def _check_equals_one_process(per_rank, argv, tp, schedule):
    """per_rank: each rank's (losses, grads) of one executor case."""
    ref_losses, ref_grads = reference(argv)
    holder = 0 if schedule == "zbv" else -1              # zbv's last virtual stage is on rank 0
    assert per_rank[holder][0] == pytest.approx(ref_losses, rel=1e-5)
    seen = set()
    for _, grads in per_rank:
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], atol=1e-6, rtol=1e-5, msg=name)
            seen.add(name)
    if tp == 1:
        assert seen == set(ref_grads)


@functools.cache
def _serial_history(untied: bool) -> list:
    return _run_cases(0, 1, [], [with_flags(LOOP_ARGS, untie_embeddings_and_output_weights=untied)])[1][0]


def _check_loop_equals_one_process(histories, argv):
    """histories: each rank's loss history of one pretrain() run; the rank that logs the loss is compared."""
    serial = _serial_history("--untie-embeddings-and-output-weights" in argv)
    logged = [h for h in histories if h and any(h)]
    assert logged and logged[0] == pytest.approx(serial, rel=1e-5), argv


ZERO_BUBBLE = [("zb-h1", False), ("zbv", True)]          # (schedule, tied embeddings) for the executor;
LOOP_ZERO_BUBBLE = [("zb-h1", True), ("zbv", False)]     # the other tying through the training loop


@pytest.fixture(scope="module")
def world_of_two():
    """One world of 2 ranks: the executor cases of ZERO_BUBBLE, then the training loop's."""
    return run_ranks(2, _run_cases, [(_argv(tied), 2, 1, s) for s, tied in ZERO_BUBBLE],
                     [_loop_argv(tied, pipeline_model_parallel_size=2, pipeline_schedule=s)
                      for s, tied in LOOP_ZERO_BUBBLE], nccl=True)


@pytest.mark.parametrize("case, schedule, tied", [(i, *c) for i, c in enumerate(ZERO_BUBBLE)])
def test_zero_bubble_equals_one_process(world_of_two, case, schedule, tied):
    _check_equals_one_process([executor[case] for executor, _ in world_of_two], _argv(tied), 1, schedule)


@pytest.mark.parametrize("case, schedule, tied", [(i, *c) for i, c in enumerate(LOOP_ZERO_BUBBLE)])
def test_training_loop_with_zero_bubble_equals_one_process(world_of_two, case, schedule, tied):
    _check_loop_equals_one_process([loop[case] for _, loop in world_of_two],
                                   _loop_argv(tied, pipeline_model_parallel_size=2, pipeline_schedule=schedule))


AT_SCALE = [(2, 1, "zb-h1", True, False), (2, 1, "zbv", False, False),
            (4, 1, "zb-h1", True, False), (4, 1, "zb-h1", False, False),
            (4, 1, "zbv", True, False), (4, 1, "zbv", False, False),
            (2, 2, "zb-h1", False, True), (2, 2, "zbv", True, True)]       # (pp, tp, schedule, tied, sp)


def _scale_argv(pp, schedule, tied, sp):
    """zbv has 2 * pp virtual stages, one layer or more each."""
    return _argv(tied, sp, num_layers=max(4, 2 * pp) if schedule == "zbv" else 4)


@pytest.fixture(scope="module")
def at_scale():
    """Every AT_SCALE case, one world per world size."""
    results = {}
    for world in (2, 4):
        cases = [c for c in AT_SCALE if c[0] * c[1] == world]
        per_rank = run_ranks(world, _run_cases, [(_scale_argv(pp, s, tied, sp), pp, tp, s)
                                                 for pp, tp, s, tied, sp in cases], [], nccl=True)
        results.update({c: [executor[i] for executor, _ in per_rank] for i, c in enumerate(cases)})
    return results


@pytest.mark.slow
@pytest.mark.parametrize("pp, tp, schedule, tied, sp", AT_SCALE)
def test_zero_bubble_equals_one_process_at_scale(at_scale, pp, tp, schedule, tied, sp):
    _check_equals_one_process(at_scale[(pp, tp, schedule, tied, sp)], _scale_argv(pp, schedule, tied, sp), tp,
                              schedule)


@pytest.mark.parametrize("flags, message", [
    ({"pipeline_schedule": "zb-h1"}, "--pipeline-schedule zb-h1 needs --pipeline-model-parallel-size > 1"),
    ({"pipeline_model_parallel_size": 2, "pipeline_schedule": "zb-h1", "num_layers_per_virtual_pipeline_stage": 1},
     "runs one model chunk per rank"),
    ({"pipeline_model_parallel_size": 2, "pipeline_schedule": "zbv", "recompute_granularity": "full",
      "recompute_method": "uniform"},
     "does not compose with --recompute-granularity full"),
    ({"pipeline_model_parallel_size": 2, "pipeline_schedule": "zbv", "decoder_first_pipeline_num_layers": 2},
     "--pipeline-model-parallel-layout instead of --decoder-first-pipeline-num-layers"),
    ({"pipeline_model_parallel_size": 2, "pipeline_schedule": "zbv", "use_distributed_optimizer": True,
      "untie_embeddings_and_output_weights": False},
     "add --untie-embeddings-and-output-weights"),
    ({"pipeline_model_parallel_size": 2, "pipeline_schedule": "zb-h1",
      "data_parallel_sharding_strategy": "optim_grads_params"}, "does not compose with ZeRO-3"),
])
def test_zero_bubble_refuses_what_it_cannot_compose_with(flags, message):
    argv = with_flags(ARGS, global_batch_size=8, **flags)
    with pytest.raises(UserError) as err:
        parse_args(argv, world_size=4)
    assert message in str(err.value) and "\n" not in str(err.value)


# ---- through the real training loop at world 4 (DP/ZeRO gradient hooks, TP/SP, CP) -------------------
WORLD_4_LOOPS = [({"data_parallel_sharding_strategy": "optim_grads", "overlap_grad_reduce": True}, "zb-h1", True),
                 ({"use_distributed_optimizer": True, "overlap_grad_reduce": True}, "zbv", False),
                 ({"overlap_grad_reduce": True}, "zbv", True),
                 ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, "zb-h1", False),
                 ({"context_parallel_size": 2}, "zbv", True)]         # (other flags, schedule, tied)


@pytest.mark.slow
def test_training_loop_with_zero_bubble_composes_at_world_4():
    argvs = [_loop_argv(tied, pipeline_model_parallel_size=2, pipeline_schedule=s, **flags)
             for flags, s, tied in WORLD_4_LOOPS]
    per_rank = run_ranks(4, _run_cases, [], argvs, nccl=True)
    for i, argv in enumerate(argvs):
        _check_loop_equals_one_process([loop[i] for _, loop in per_rank], argv)
