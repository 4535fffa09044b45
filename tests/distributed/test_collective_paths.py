"""The collectives of megalite.parallel.collectives on 2 gloo ranks: right results under the torch 2.13
names and under the older ones, for every dtype and chunk size megalite uses; the data-parallel bucket
collectives right on both branches (gloo's sliced list form, and with MEGALITE_FORCE_NCCL_COLLECTIVE_PATH=1
the single-tensor form NCCL takes); training with every sharded strategy identical on the two branches.
So the default suite runs the NCCL branch of every collective. One spawn serves every check."""
from __future__ import annotations

import contextlib
import itertools
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dp_workloads import equivalence_and_eval, layout_flags
from harness import run_ranks

ENV = "MEGALITE_FORCE_NCCL_COLLECTIVE_PATH"
NEW_NAMES = ("reduce_scatter_single", "all_gather_single")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
CHUNKS = (0, 1, 7, 1000)                   # elements per rank
SHARDED = [(s, overlap) for s in ("optim", "optim_grads", "optim_grads_params") for overlap in (False, True)]
MIXED = [("optim_grads_params", dict(bf16=True)), ("optim", dict(bf16=True, grad_reduce_in_bf16=True)),
         ("optim_grads", dict(fp16=True, initial_loss_scale=4096))]


@contextlib.contextmanager
def torch_names(which: str):
    """'old': torch.distributed without the 2.13 names, as before 2.13; 'new': as installed."""
    removed = {n: vars(dist).pop(n) for n in NEW_NAMES if which == "old" and n in vars(dist)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)       # the old names warn from 2.13 on
            yield
    finally:
        vars(dist).update(removed)


@contextlib.contextmanager
def switch(forced: bool):
    """MEGALITE_FORCE_NCCL_COLLECTIVE_PATH set to 1 or 0 inside the block."""
    before = os.environ.get(ENV)
    os.environ[ENV] = "1" if forced else "0"
    try:
        yield
    finally:
        os.environ.pop(ENV) if before is None else os.environ.update({ENV: before})


@contextlib.contextmanager
def slices_of(n: int):
    """bucket_comm's gloo slices of ``n`` elements inside the block, so a small chunk spans several."""
    from megalite.parallel.data import bucket_comm
    before, bucket_comm.GLOO_SLICE = bucket_comm.GLOO_SLICE, n
    try:
        yield
    finally:
        bucket_comm.GLOO_SLICE = before


def values(world_n: int, rank: int, dtype) -> torch.Tensor:
    return (torch.arange(world_n) % 16 + 10 * rank).to(dtype)   # sums exact in every dtype


def both_right(rank: int, world: int, dtype, n: int, async_op: bool, reduce_scatter, all_gather) -> tuple:
    """One reduce-scatter and one all-gather of known values, ``n`` elements per rank: whether each result
    is right. ``reduce_scatter(out, flat, async_op)`` and ``all_gather(out, local, async_op)`` return a
    work to wait for when asynchronous."""
    reduced, gathered = torch.empty(n, dtype=dtype), torch.empty(world * n, dtype=dtype)
    works = [reduce_scatter(reduced, values(world * n, rank, dtype), async_op),
             all_gather(gathered, values(n, rank, dtype), async_op)]
    for work in works if async_op else []:
        work.wait()
    total = sum(values(world * n, r, torch.int64) for r in range(world))
    return (torch.equal(reduced, total[rank * n:(rank + 1) * n].to(dtype)),
            torch.equal(gathered, torch.cat([values(n, r, dtype) for r in range(world)])))


def single_tensor_forms(rank: int, world: int) -> dict:
    """(names, dtype, chunk, async) -> (reduce-scatter right, all-gather right), and the function picked."""
    from megalite.parallel import collectives

    def reduce_scatter(out, flat, async_op):
        return collectives.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, async_op=async_op)

    def all_gather(out, local, async_op):
        return collectives.all_gather_single(out, local, async_op=async_op)
    out = {}
    for which in ("new", "old"):
        with torch_names(which):
            out[(which, "picked")] = collectives.resolve("reduce_scatter_single", "reduce_scatter_tensor").__name__
            for dtype, n, async_op in itertools.product(DTYPES, CHUNKS, (False, True)):
                out[(which, str(dtype), n, async_op)] = both_right(rank, world, dtype, n, async_op,
                                                                   reduce_scatter, all_gather)
    return out


def comm_operations(comm, world: int) -> tuple:
    """bucket_comm.Comm's reduce-scatter and all-gather as both_right calls them."""
    def reduce_scatter(result, flat, async_op):
        return comm.reduce_scatter(result, flat, flat.chunk(world), async_op)

    def all_gather(out, local, async_op):
        return comm.all_gather(out, out.chunk(world), local, async_op)
    return reduce_scatter, all_gather


def bucket_comm(rank: int, world: int) -> dict:
    """bucket_comm.Comm on both branches, in gloo slices of 5 elements so a chunk spans several: (forced, dtype,
    chunk, async) -> (reduce-scatter right, all-gather right), and which branch each took."""
    from megalite.parallel.data import bucket_comm
    out = {}
    for forced in (False, True):
        with switch(forced), slices_of(5):
            comm = bucket_comm.Comm(dist.group.WORLD, world, None)
            out[(forced, "list_form")] = comm.list_form
            for dtype, n, async_op in itertools.product((torch.float32, torch.bfloat16), (1, 7, 12), (False, True)):
                out[(forced, str(dtype), n, async_op)] = both_right(rank, world, dtype, n, async_op,
                                                                    *comm_operations(comm, world))
    return out


def memory_rows(rank: int, world: int) -> list:
    from megalite.train.performance import gather_memory
    buffer = SimpleNamespace(param_bytes=lambda: 100 + rank, grad_bytes=lambda: 200 + rank, numel_unpadded=12,
                             param_dtype=torch.float32, params=[torch.zeros(1)], dp_size=world)
    ddp = SimpleNamespace(buffer=buffer, dp_size=world, shard_optimizer=True, named_params=[])
    adam = ("exp_avg", "exp_avg_sq")
    return gather_memory(ddp, SimpleNamespace(state_bytes=lambda: 300 + rank, state_names=adam,
                                              state_names_of=lambda name: adam))


@contextlib.contextmanager
def counting_data_parallel_calls(counts: dict):
    """Count the bucket collectives (the calls that name a group) by the torch function they reach."""
    names = ("reduce_scatter", "all_gather", *NEW_NAMES, "reduce_scatter_tensor", "all_gather_into_tensor")
    originals = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def counting(name):
        def call(*args, **kwargs):
            if kwargs.get("group") is not None:
                counts[name] = counts.get(name, 0) + 1
            return originals[name](*args, **kwargs)
        return call
    try:
        for name in originals:
            setattr(dist, name, counting(name))
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def training_on_both_branches(rank: int, world: int, layouts: list) -> dict:
    out = {}
    for forced in (False, True):
        counts = {}
        with switch(forced), counting_data_parallel_calls(counts):
            out[forced] = {"results": equivalence_and_eval(rank, world, layouts, steps=6), "calls": counts}
    return out


def everything(rank: int, world: int, layouts: list) -> dict:
    return {"single": single_tensor_forms(rank, world), "bucket": bucket_comm(rank, world),
            "memory": memory_rows(rank, world), "training": training_on_both_branches(rank, world, layouts)}


@pytest.fixture(scope="module")
def ranks():
    layouts = [layout_flags(s, o) for s, o in SHARDED] + [layout_flags(s, True, **extra) for s, extra in MIXED]
    return run_ranks(2, everything, layouts)


def test_single_tensor_collectives_are_right_under_new_and_old_names(ranks):
    for rank, r in enumerate(ranks):
        single = r["single"]
        assert single[("old", "picked")] == "reduce_scatter_tensor"
        if hasattr(dist, "reduce_scatter_single"):
            assert single[("new", "picked")] == "reduce_scatter_single"
        wrong = [k for k, v in single.items() if k[1] != "picked" and v != (True, True)]
        assert not wrong, f"rank {rank}: wrong results for {wrong}"


def test_bucket_collectives_are_right_on_the_list_branch_and_the_nccl_branch(ranks):
    for rank, r in enumerate(ranks):
        bucket = r["bucket"]
        assert bucket[(False, "list_form")] is True and bucket[(True, "list_form")] is False
        wrong = [k for k, v in bucket.items() if k[1] != "list_form" and v != (True, True)]
        assert not wrong, f"rank {rank}: wrong results for {wrong}"


def test_memory_report_gathers_every_rank(ranks):
    for r in ranks:
        assert [row["parameters"] for row in r["memory"]] == [100, 101]
        assert [row["optimizer"] for row in r["memory"]] == [300, 301]


def test_sharded_training_is_identical_on_both_branches(ranks):
    """Two ranks: each sum has two terms, so the two branches agree bit for bit."""
    for rank, r in enumerate(ranks):
        listed, forced = r["training"][False], r["training"][True]
        assert listed["calls"].keys() == {"reduce_scatter", "all_gather"}, listed["calls"]
        # the 2.13 names where torch has them (the old ones warn), else the old ones
        picked = set(NEW_NAMES) if hasattr(dist, NEW_NAMES[0]) else {"reduce_scatter_tensor", "all_gather_into_tensor"}
        assert forced["calls"].keys() == picked, forced["calls"]
        for i, (a, b) in enumerate(zip(listed["results"], forced["results"])):
            assert a == b, f"rank {rank} layout {i}: the NCCL branch trained differently"
