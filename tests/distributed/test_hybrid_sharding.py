"""Hybrid sharding (--num-distributed-optimizer-instances K): ZeRO within DP/K ranks, gradients all-reduced
across the K instances. At DP=4 K=2 every step equals the single-process run (ZeRO-1 and ZeRO-3, with and
without overlap), each rank holds 1/(DP/K) of the optimizer state, the collectives run on the instance's
shard group and its replica group with the ring bytes of the design, a checkpoint written at K=2 resumes at
K=1 (and back) as if never stopped, and the pattern passes the NCCL-semantics tier.

The default suite runs one small case (ZeRO-3 at K=2 equals one process, a few steps); the rest is slow."""
import os

import pytest

from dp_workloads import equivalence_and_eval, layout_flags, train_losses
from harness import logged_losses, run_pretrain, run_ranks
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from test_data_parallel_pretrain import MEMORY_LINE

K2 = {"num_distributed_optimizer_instances": 2}


def _matches(reference: dict, got: dict, what: str) -> None:
    for i, (a, b) in enumerate(zip(reference["losses"], got["losses"])):
        assert b == pytest.approx(a, rel=1e-5), f"{what}: loss of step {i + 1}"
    for i, (a, b) in enumerate(zip(reference["norms"], got["norms"])):
        assert b == pytest.approx(a, rel=1e-4), f"{what}: grad norm of step {i + 1}"


def test_zero3_with_two_instances_equals_one_process():
    """DP=4 split into 2 instances of 2: reduce-scatter within, all-reduce across, gather within."""
    argv = layout_flags("optim_grads_params", True, num_layers=2, **K2)
    reference = train_losses(layout_flags("no_shard", False, num_layers=2), 1, steps=3)
    for rank, got in enumerate(run_ranks(4, _train, [argv], 3)):
        _matches(reference, got[0], f"ZeRO-3 K=2 rank {rank}")
        assert got[0]["shard_size"] == 2


def _train(rank, world, layouts, steps):
    out = []
    for argv in layouts:
        result = train_losses(argv, world, steps)
        trainer = result.pop("trainer")
        out.append({**result, "shard_size": trainer.buffer.dp_size})
    return out


# ---- the slow tier --------------------------------------------------------------------------------
LAYOUTS = [("optim", False), ("optim", True), ("optim_grads", True), ("optim_grads_params", False),
           ("optim_grads_params", True)]


def _everything(rank, world):
    """Equivalence of every layout, the memory report, and the collectives of one ZeRO-1 step by group."""
    from megalite.train.performance import measure
    from megalite.train.command_line import parse_args
    from megalite.train.trainer import build_trainer
    equivalence = equivalence_and_eval(rank, world, [layout_flags(s, o, **K2) for s, o in LAYOUTS])
    memory = {}
    for k in (1, 2):
        for precision in ("bf16", "fp32"):
            flags = {"num_distributed_optimizer_instances": k, **({precision: True} if precision != "fp32" else {})}
            trainer = build_trainer(parse_args(layout_flags("optim_grads_params", False, **flags), world_size=world))
            memory[(k, precision)] = {**measure(trainer.ddp, trainer.optimizer), "psi": trainer.buffer.numel_unpadded}
    return {"equivalence": equivalence, "memory": memory, "traffic": _traffic(world)}


def _traffic(world):
    """(op, group kind, bytes) of the collectives of a second ZeRO-1 step over the data-parallel group, the
    instance's shard group and its replica group (not the loss and norm scalars)."""
    import torch.distributed as dist
    from dp_workloads import batches
    from megalite.train.command_line import parse_args
    from megalite.train.step import train_step
    from megalite.train.trainer import build_trainer
    trainer = build_trainer(parse_args(layout_flags("optim", True, **K2), world_size=world))
    groups = {id(trainer.parallel.group("dp_cp_shard")): "shard", id(trainer.parallel.group("dp_cp_replica")): "replica",
              id(trainer.ddp.group): "dp"}
    calls, originals = [], {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter", "all_gather")}

    def recording(name):
        def wrapper(*args, **kwargs):
            tensors = args[1] if name == "reduce_scatter" else args[0]
            nbytes = sum(t.numel() * t.element_size() for t in (tensors if isinstance(tensors, list) else [tensors]))
            calls.append((name, groups.get(id(kwargs.get("group")), "other"), nbytes))
            return originals[name](*args, **kwargs)
        return wrapper

    data = batches(trainer, 2)
    train_step(trainer, data)
    trainer.ddp.wait_for_param_gather()
    try:
        for name in originals:
            setattr(dist, name, recording(name))
        train_step(trainer, data)
        trainer.ddp.wait_for_param_gather()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"calls": [c for c in calls if c[2] > 64 and c[1] != "other"], "numel": trainer.buffer.numel,
            "psi": trainer.buffer.numel_unpadded}


@pytest.fixture(scope="module")
def dp4():
    return run_ranks(4, _everything)


@pytest.fixture(scope="module")
def reference():
    return equivalence_and_eval(0, 1, [layout_flags("no_shard", False)])[0]


@pytest.mark.slow
def test_every_sharding_strategy_with_two_instances_equals_one_process(dp4, reference):
    for rank, result in enumerate(dp4):
        for (strategy, overlap), got in zip(LAYOUTS, result["equivalence"]):
            what = f"DP=4 K=2 {strategy} overlap={overlap} rank {rank}"
            _matches(reference, got, what)
            assert got["updated"] == reference["updated"], what
            assert got["eval"] == pytest.approx(reference["eval"], rel=1e-5), what


@pytest.mark.slow
def test_each_rank_holds_one_instance_share_of_the_state(dp4):
    """Optimizer state, gradients and (ZeRO-3) parameters are 1/(DP/K) = 1/2 per rank at K=2, twice K=1's."""
    for rank, result in enumerate(dp4):
        mem = result["memory"]
        for precision, per_param in (("bf16", 12), ("fp32", 8)):
            one, two = mem[(1, precision)], mem[(2, precision)]
            psi = two["psi"]
            assert two["optimizer"] == pytest.approx(per_param * psi / 2, rel=0.02), (rank, precision)
            assert two["theoretical"] == round(per_param * psi / 2)
            assert two["gradients"] == pytest.approx(4 * psi / 2, rel=0.02)
            assert two["optimizer"] == pytest.approx(2 * one["optimizer"], rel=0.02)
            assert two["parameters"] == pytest.approx(2 * one["parameters"], rel=0.02)


@pytest.mark.slow
def test_gradients_reduce_within_then_across_instances_and_gather_within(dp4):
    """ZeRO-1 at DP=4 K=2: each bucket reduce-scattered over the 2 ranks of the instance (4Ψ), its 2Ψ-byte
    shard all-reduced over the 2 replicas, the updated parameters all-gathered over the instance only;
    nothing of that size runs over the whole data-parallel group."""
    for result in dp4:
        traffic = result["traffic"]
        numel = traffic["numel"]
        by = {}
        for op, group, nbytes in traffic["calls"]:
            by[(op, group)] = by.get((op, group), 0) + nbytes
        assert by.pop(("reduce_scatter", "shard")) == 4 * numel
        assert by.pop(("all_reduce", "replica")) == 4 * numel // 2
        assert by.pop(("all_gather", "shard")) == 4 * numel
        assert not by, by


# ---- checkpoints across instance counts ---------------------------------------------------------------
CKPT_ARGS = with_flags(TINY_LLAMA_ARGS, global_batch_size=16, train_iters=6, weight_decay=0.1, clip_grad=1.0,
                       lr_warmup_iters=2, lr_decay_style="cosine", ddp_bucket_size=30000,
                       data_parallel_sharding_strategy="optim_grads_params", **K2)


@pytest.fixture(scope="module")
def uninterrupted():
    proc = run_pretrain(4, CKPT_ARGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return logged_losses(proc.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_at_another_instance_count(tmp_path, uninterrupted, first, second):
    """Save at iteration 3 with K=first, resume to 6 with K=second: the losses of the uninterrupted run."""
    save = str(tmp_path / "ckpt")
    part = run_pretrain(4, with_flags(CKPT_ARGS, save=save, save_interval=3, exit_interval=3,
                                      num_distributed_optimizer_instances=first))
    assert part.returncode == 0, part.stderr[-3000:]
    written = sorted(f for f in os.listdir(os.path.join(save, "iter_0000003")) if f.startswith("model-"))
    # every element once: the instance's DP/K ranks write their shards, the other instance nothing
    assert written == [f"model-pp000-dp{r:05d}.safetensors" for r in range(4 // first)], written
    resumed = run_pretrain(4, with_flags(CKPT_ARGS, load=save, num_distributed_optimizer_instances=second))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = logged_losses(resumed.stdout)
    assert sorted(losses) == [4, 5, 6]
    for it in losses:
        assert losses[it] == pytest.approx(uninterrupted[it], rel=1e-5), f"iteration {it}"
    # the start-up memory lines: at K=2 every rank holds twice K=1's ZeRO-3 share (1/2 instead of 1/4)
    lines = {k: MEMORY_LINE.findall(proc.stdout) for k, proc in ((first, part), (second, resumed))}
    assert [int(m[0]) for m in lines[2]] == [int(m[0]) for m in lines[1]] == [0, 1, 2, 3]
    for one, two in zip(lines[1], lines[2]):
        params, grads, opt, theory = (int(x) for x in two[1:])
        assert opt == pytest.approx(theory, rel=0.02)
        for k2, k1 in zip((params, grads, opt), (int(x) for x in one[1:4])):
            assert k2 == pytest.approx(2 * k1, rel=0.02)


# ---- NCCL semantics ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_hybrid_sharding_passes_the_nccl_semantics_tier(reference):
    """Every strategy at DP=4 K=2 with overlap under NCCL's ordering rules, equal to one process."""
    layouts = [layout_flags(s, True, **K2) for s in ("optim", "optim_grads", "optim_grads_params")]
    for rank, results in enumerate(run_ranks(4, equivalence_and_eval, layouts, nccl=True)):
        for got in results:
            _matches(reference, got, f"NCCL tier rank {rank}")


# ---- MoE: expert weights split their expert-data-parallel group the same way ----------------------------
@pytest.mark.slow
def test_moe_experts_shard_within_their_instance_and_equal_serial():
    """At world 4: EP=1 (EDP 4: experts shard over 2, replicated over 2 instances) with ZeRO-1, and EP=2
    (EDP 2: one expert shard per rank, all-reduced across 2 instances) with ZeRO-3 under the NCCL tier."""
    from test_moe_parallel import assert_equal_runs, train
    serial = train(1, {})
    assert_equal_runs(serial, train(4, dict(use_distributed_optimizer=True, overlap_grad_reduce=True, **K2)))
    assert_equal_runs(serial, train(4, dict(expert_model_parallel_size=2, overlap_grad_reduce=True,
                                            data_parallel_sharding_strategy="optim_grads_params", **K2), nccl=True))
