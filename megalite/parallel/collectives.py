"""The single-tensor collectives under whichever name the installed torch gives them, and the one
choice of collective form that depends on the backend. The data-parallel buckets
(parallel/data/bucket_comm.py), the tensor-parallel mappings and the training step's and
performance report's reductions call the collectives through this module.

Names. torch 2.13 calls the single-tensor reduce-scatter and all-gather ``reduce_scatter_single`` and
``all_gather_single`` and keeps ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` as deprecated
aliases that warn; earlier releases have only the latter. The functions below call the new name where
torch has it, else the old one. The name is looked up at each call, so a test that replaces a
torch.distributed function (to count or reorder collectives) sees the calls made through here.

One code path for NCCL and gloo. gloo runs the single-tensor forms for every case megalite uses: any
chunk size (including 0 and odd sizes), fp32, bf16, fp16 and integer tensors, ReduceOp.SUM, sync or
async (a mean is a SUM then a division, as in the data-parallel buckets: ReduceOp.AVG is not used). The one
backend-dependent path is the data-parallel bucket collectives (bucket_comm.Comm): on gloo they use the list
forms (``dist.reduce_scatter`` / ``dist.all_gather`` over per-rank chunk views) in bounded slices,
because gloo's single-tensor forms are slower on CPU and copy the whole bucket through a temporary.
``bucket_list_form`` says when that branch is taken.

``MEGALITE_FORCE_NCCL_COLLECTIVE_PATH=1`` makes ``bucket_list_form`` false on gloo as well, so the
bucket collectives take the branch NCCL takes: the default test suite trains with every sharded
strategy on both branches, so it runs the NCCL branch of every collective. Read at each call, so a
process forked after import sees its own environment.
"""
from __future__ import annotations

import os

import torch.distributed as dist

FORCE_NCCL_PATH_ENV = "MEGALITE_FORCE_NCCL_COLLECTIVE_PATH"


def resolve(new: str, old: str):
    """torch.distributed's function ``new`` where this torch has it, else ``old``."""
    fn = getattr(dist, new, None)
    return fn if fn is not None else getattr(dist, old)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``input`` (world x ``output``'s size, contiguous) over ``group``; this rank's chunk lands in
    ``output``. dist.reduce_scatter_single, or dist.reduce_scatter_tensor before torch 2.13."""
    fn = resolve("reduce_scatter_single", "reduce_scatter_tensor")
    return fn(output, input, op=op, group=group, async_op=async_op)


def all_gather_single(output, input, group=None, async_op=False):
    """Every rank's ``input`` concatenated, in rank order, into ``output`` (contiguous).
    dist.all_gather_single, or dist.all_gather_into_tensor before torch 2.13."""
    fn = resolve("all_gather_single", "all_gather_into_tensor")
    return fn(output, input, group=group, async_op=async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    """``input`` cut by ``input_split_sizes`` (equal parts when None), part r sent to rank r; the parts
    received land in ``output`` in rank order (cut by ``output_split_sizes``). dist.all_to_all_single."""
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)


def bucket_list_form(group) -> bool:
    """Whether the data-parallel bucket collectives over ``group`` use gloo's list forms: a gloo group,
    unless MEGALITE_FORCE_NCCL_COLLECTIVE_PATH=1."""
    if group is None or os.environ.get(FORCE_NCCL_PATH_ENV) == "1":
        return False
    return dist.get_backend(group) == "gloo"
