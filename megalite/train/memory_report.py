"""Start-up memory report: bytes of parameters, gradients and optimizer state each rank holds.

Measured from the tensors that exist (storage sizes, so padding and ZeRO-3's gathered buckets count),
next to the theoretical optimizer-state bytes of REFERENCE §6 (ZeRO paper): Adam with fp32 master
weights keeps 12 bytes per parameter (master, m, v), sharded over the d data-parallel ranks by the
distributed optimizer: 12Ψ/d, Ψ = parameters on this model-parallel rank. An fp32 model's own
weights are its master copy, so there it is 8Ψ/d (m, v). Rank 0 prints one line per rank:

    memory rank R: parameters P bytes | gradients G bytes | optimizer state O bytes | theoretical O' bytes
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.distributed import collectives


def theoretical_optimizer_bytes(num_params: int, param_dtype: torch.dtype, shards: int) -> int:
    per_param = 8 if param_dtype == torch.float32 else 12
    return round(per_param * num_params / shards)


def measure(ddp, optimizer) -> dict[str, int]:
    buf = ddp.buffer
    shards = ddp.dp_size if ddp.shard_optimizer else 1
    return {"parameters": buf.param_bytes(), "gradients": buf.grad_bytes(), "optimizer": optimizer.state_bytes(),
            "theoretical": theoretical_optimizer_bytes(buf.numel_unpadded, buf.param_dtype, shards)}


def format_memory_line(rank: int, m: dict[str, int]) -> str:
    return (f"memory rank {rank}: parameters {m['parameters']} bytes | gradients {m['gradients']} bytes | "
            f"optimizer state {m['optimizer']} bytes | theoretical {m['theoretical']} bytes")


def gather_memory(ddp, optimizer) -> list[dict[str, int]]:
    """Every rank's measurement (collective: all ranks call it)."""
    keys = ("parameters", "gradients", "optimizer", "theoretical")
    mine = measure(ddp, optimizer)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    device = ddp.buffer.params[0].device
    local = torch.tensor([mine[k] for k in keys], dtype=torch.int64, device=device)
    everyone = torch.empty(dist.get_world_size() * len(keys), dtype=torch.int64, device=device)
    collectives.all_gather_single(everyone, local)
    rows = everyone.view(-1, len(keys)).tolist()
    return [dict(zip(keys, row)) for row in rows]


def report_memory(ddp, optimizer, rank: int, print_fn=print) -> list[dict[str, int]]:
    """Rank 0 prints the line of every rank; every rank returns all measurements."""
    per_rank = gather_memory(ddp, optimizer)
    if rank == 0:
        for r, m in enumerate(per_rank):
            print_fn(format_memory_line(r, m))
    return per_rank
