"""Layout-independent weight initialisation that never draws a whole tensor.

Element k of the full (unsharded) tensor ``global_name`` gets a value that depends only on (run seed,
global name, k): a counter-based generator (an integer hash of the element's index, turned into a
normal sample by Box-Muller) instead of a sequential stream. A rank therefore computes exactly the
elements it holds, its tensor-parallel shard or only its ZeRO-3 chunk of it, and the same seed gives
bit-identical weights at any TP x PP x DP x CP x ZeRO layout without any rank building a full tensor
(what makes every parallel feature testable against the single-process run, and a model whose full
weights fit no single device startable).
"""
from __future__ import annotations

import math
import zlib

import torch

from megalite.parallel.param_meta import param_meta
from megalite.parallel.tensor.layers import shard_positions

_MASK32 = 0xFFFFFFFF
_HASH_MULTIPLIER = 0x45D9F3B            # < 2**27, so (x < 2**32) * it never overflows int64
_CHUNK = 1 << 22                        # elements generated at a time: bounds the temporaries (~100 MiB)


def param_seed(seed: int, global_name: str) -> int:
    """A 32-bit key for one parameter of one run."""
    return (seed * 1_000_003 + zlib.crc32(global_name.encode())) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (int64 tensor of values < 2**32 -> the same)."""
    for _ in range(3):
        x = (((x >> 16) ^ x) * _HASH_MULTIPLIER) & _MASK32
    return (x >> 16) ^ x


def _uniform(index: torch.Tensor, key: int) -> torch.Tensor:
    """Uniform (0, 1) float64 per int64 ``index``, keyed: both 32-bit halves of the index are mixed in."""
    high = _hash32((index >> 32) ^ key)
    bits = _hash32(_hash32((index & _MASK32) ^ high) ^ ((key * 0x9E3779B1) & _MASK32))
    return (bits.double() + 0.5) / 2.0 ** 32


def normal_at(index: torch.Tensor, key: int) -> torch.Tensor:
    """Standard normal samples (float64) for flat element indices of a tensor keyed ``key``."""
    u1 = _uniform(index, key)
    u2 = _uniform(index, key ^ 0x5BD1E995)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


def full_normal(global_name: str, full_shape, std: float, seed: int) -> torch.Tensor:
    """The whole fp32 tensor N(0, std) a parameter name gets for this seed (tests and small tools only)."""
    n = math.prod(full_shape)
    return (normal_at(torch.arange(n), param_seed(seed, global_name)) * std).float().view(full_shape)


def init_std(global_name: str, base_std: float, num_layers: int) -> float:
    """Megatron's scheme: output projections of each block are scaled by 1/sqrt(2 * num_layers)."""
    if global_name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return base_std / math.sqrt(2.0 * num_layers)
    return base_std


def initial_values(param: torch.nn.Parameter, global_name: str, base_std: float, num_layers: int, seed: int,
                   start: int, end: int) -> torch.Tensor:
    """fp32 initial values of this rank's elements [start, end) of ``param`` (flat, local to its TP shard):
    norms -> 1, biases -> 0, weights -> N(0, std) at their positions in the full tensor.

    A sharded parameter's record carries ``full_shape``, ``partition_dim`` and ``take_shard`` (set by the
    tensor-parallel layers; see ``shard_positions``); an unsharded one is its own full tensor."""
    meta = param_meta(param)
    if meta.is_norm_weight:      # 1, or 0 for --apply-layernorm-1p's zero-centred weights
        return torch.full((end - start,), float(meta.norm_init_value))
    if global_name.endswith(".bias"):
        return torch.zeros(end - start)
    rows, cols, full_cols = shard_positions(param)
    local_cols = cols.numel()
    key, std = param_seed(seed, global_name), init_std(global_name, base_std, num_layers)
    out = torch.empty(end - start)
    for lo in range(start, end, _CHUNK):
        hi = min(end, lo + _CHUNK)
        local = torch.arange(lo, hi)
        full_index = rows[local // local_cols] * full_cols + cols[local % local_cols]
        out[lo - start:hi - start] = normal_at(full_index, key) * std
    return out


@torch.no_grad()
def initialize_parameter(param: torch.nn.Parameter, global_name: str, base_std: float, num_layers: int,
                         seed: int) -> None:
    """Fill a materialised ``param`` in place with its initial values."""
    values = initial_values(param, global_name, base_std, num_layers, seed, 0, param.numel())
    param.copy_(values.view(param.shape))
