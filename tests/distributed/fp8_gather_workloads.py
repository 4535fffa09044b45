"""Rank functions of test_fp8_param_gather.py: a few training steps with --fp8-param-gather, and the bytes
the data-parallel parameter all-gathers move."""
from __future__ import annotations

import torch
import torch.distributed as dist

from dp_workloads import batches, layout_flags, train_losses
from megalite.parallel.data.fsdp2 import FullyShardedDataParallel
from megalite.parallel.data.fsdp2_fp8 import Fp8ShardedWeight
from megalite.train.command_line import parse_args
from megalite.train.step import train_step
from megalite.train.trainer import build_trainer

GATHERS = ("all_gather", "all_gather_single", "all_gather_into_tensor", "broadcast")


def fp8_losses(rank: int, world: int, layouts: list[list[str]], steps: int = 3) -> list[list[float]]:
    return [train_losses(argv, world, steps)["losses"] for argv in layouts]


def gathered_bytes(rank: int, world: int, layouts: list[list[str]]) -> list[dict]:
    """Per layout: bytes received by this rank's parameter all-gathers over the data-parallel group in one
    step after a warm-up step (counted at torch.distributed's calls: every output byte not its own), and
    the buffer's element counts."""
    out = []
    for argv in layouts:
        trainer = build_trainer(parse_args(argv, world_size=world))
        data = batches(trainer, 2)
        train_step(trainer, data)
        trainer.ddp.wait_for_param_gather()
        received = []
        originals = {name: getattr(dist, name) for name in GATHERS if hasattr(dist, name)}

        def counting(name):
            def wrapper(*args, **kwargs):
                first = args[0]
                if name == "all_gather":             # list of output chunks, input
                    received.append(sum(t.numel() * t.element_size() for t in first) * (world - 1) // world)
                else:                                # broadcast, or one output tensor
                    received.append(first.numel() * first.element_size() * (world - 1) // world)
                return originals[name](*args, **kwargs)
            return wrapper

        try:
            for name in originals:
                setattr(dist, name, counting(name))
            train_step(trainer, data)
            trainer.ddp.wait_for_param_gather()
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        buffer = trainer.buffer
        out.append({"bytes": sum(received), "fp8_numel": _fp8_numel(trainer), "numel": buffer.numel,
                    "element_size": buffer.param_dtype.itemsize})
    return out


def _fp8_numel(trainer) -> int:
    """Elements gathered in FP8: megalite's ZeRO holds them in FP8 buckets, FSDP2 in weights whose local
    shard gathers in FP8."""
    if isinstance(trainer.ddp, FullyShardedDataParallel):
        return sum(p.numel() for _, p in trainer.ddp.named_params if isinstance(p.to_local(), Fp8ShardedWeight))
    return sum(b.numel for b in trainer.buffer.buckets if b.fp8)
