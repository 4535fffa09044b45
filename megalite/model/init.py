"""Layout-independent weight initialisation.

Each parameter is drawn from a generator seeded by (run seed, the parameter's *global* name), for the
full unsharded shape; a rank then keeps its shard. The same seed therefore gives bit-identical weights
at any tensor / pipeline / data-parallel layout, which is what makes every parallel feature testable
against the single-process run.
"""
from __future__ import annotations

import math
import zlib

import torch


def param_seed(seed: int, global_name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(global_name.encode())) % (2 ** 63)


def full_normal(global_name: str, full_shape, std: float, seed: int) -> torch.Tensor:
    """The full-size fp32 tensor N(0, std) this parameter name always gets for this seed."""
    gen = torch.Generator().manual_seed(param_seed(seed, global_name))
    return torch.empty(full_shape, dtype=torch.float32).normal_(0.0, std, generator=gen)


def init_std(global_name: str, base_std: float, num_layers: int) -> float:
    """Megatron's scheme: output projections of each block are scaled by 1/sqrt(2 * num_layers)."""
    if global_name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return base_std / math.sqrt(2.0 * num_layers)
    return base_std


@torch.no_grad()
def initialize_parameter(param: torch.nn.Parameter, global_name: str, base_std: float, num_layers: int,
                         seed: int) -> None:
    """Fill ``param`` in place: norms -> 1, biases -> 0, weights -> slice of the full seeded normal.

    A sharded parameter carries ``param.full_shape`` and ``param.take_shard(full) -> local`` (set by the
    tensor-parallel layers); an unsharded one is its own full tensor.
    """
    if getattr(param, "is_norm_weight", False):
        param.fill_(1.0)
        return
    if global_name.endswith(".bias"):
        param.zero_()
        return
    full_shape = getattr(param, "full_shape", tuple(param.shape))
    full = full_normal(global_name, full_shape, init_std(global_name, base_std, num_layers), seed)
    take_shard = getattr(param, "take_shard", None)
    param.copy_(take_shard(full) if take_shard is not None else full)
