"""--fp8-param-gather under --use-torch-fsdp2: FSDP2 gathers the FP8 layers' weights in FP8, with their scales.

FSDP2's extension point for a custom all-gather is the sharded local tensor's class: when it defines
``fsdp_pre_all_gather`` and ``fsdp_post_all_gather``, FSDP2 all-gathers what the first returns and hands
the gathered tensors to the second, which builds the unsharded parameter. ``Fp8ShardedWeight`` is that
local tensor for the weight of a linear whose GEMMs run in FP8 with a recipe that takes a gathered weight
(precision/fp8_params.py): a wrapper around the fp32 master rows FSDP2 keeps on this rank (every other
operation runs on those rows, so the optimizer, checkpoints and start-up see a plain tensor). Its gather

1. casts the rows to the compute dtype (as FSDP2's mixed precision would before gathering), takes the
   amax of each weight scaling block over them and all-reduces those amaxes (MAX) over the shard group,
   and over the tensor-parallel ranks where a block spans their parts, as the layer's own quantisation
   does: the scales serial quantisation of the whole weight computes (delayed scaling: the step's fixed
   scale, ``gather_scales``);
2. quantises the rows to FP8 with them and all-gathers the bytes (one per element, FSDP2's all-gather);
3. hands the layer's recipe the gathered weight as a ``GatheredWeight`` (``Fp8Gemm.gathered``), which the
   forward and input-gradient GEMMs take as is. The unsharded parameter is an ``Fp8UnshardedWeight``:
   the weight's shape and compute dtype without storage, the autograd leaf FSDP2 reads the gradient of;
   no one reads its values.

FSDP2 frees the gathered bytes when it reshards and gathers again (the backward, the next step).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from megalite.parallel.data.fp8_gather import fp8_gathered_linears
from megalite.precision.fp8 import WEIGHT, Fp8Gemm
from megalite.precision.fp8_layout import FORWARD_AXES
from megalite.precision.fp8_params import GatheredWeight, WeightBlocks, gather_scales, quantise_shard, shard_block_amax

aten = torch.ops.aten
# what FSDP2 and start-up do to a sharded local tensor whose result is that tensor (or a part of it) still
_KEEPS_WEIGHT = {aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.narrow.default,
                 aten.copy_.default, aten.view.default, aten.as_strided.default, aten._to_copy.default,
                 aten.split.Tensor, aten.clone.default, aten.detach.default, aten.alias.default}
_VIEWS = {aten.as_strided.default, aten.view.default, aten.detach.default, aten.alias.default,
          aten._unsafe_view.default}


def dim0_shard(rows: int, rank: int, size: int) -> tuple[int, int]:
    """Rows [r0, r1) that FSDP2's Shard(0) gives ``rank`` of ``size`` (torch.chunk: ceil(rows/size) each,
    the last ranks possibly fewer or none)."""
    per_rank = math.ceil(rows / size) if rows else 0
    return min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)


class Fp8ShardedWeight(torch.Tensor):
    """FSDP2's local shard (rows of dim 0) of an FP8 layer's weight, gathering in FP8 (module docstring).
    ``rows``: the plain tensor of those rows; ``precision``: the layer's recipe."""

    @staticmethod
    def __new__(cls, rows: torch.Tensor, precision: Fp8Gemm):
        return torch.Tensor._make_wrapper_subclass(cls, rows.shape, strides=rows.stride(), dtype=rows.dtype,
                                                   device=rows.device, requires_grad=rows.requires_grad)

    def __init__(self, rows: torch.Tensor, precision: Fp8Gemm):
        self.rows, self.precision = rows, precision

    def __repr__(self):
        return f"Fp8ShardedWeight({self.rows!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        precision = next(a.precision for a in tree_flatten((args, kwargs))[0] if isinstance(a, cls))
        args, kwargs = tree_map_only(cls, lambda t: t.rows, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEPS_WEIGHT:
            return out
        return tree_map_only(torch.Tensor, lambda t: cls(t, precision), out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's rows in FP8 [ceil(M / shards), K] (as bytes) with the whole weight's scales, and the
        scales' inverses and M for ``fsdp_post_all_gather``. The rows are contiguous and whole (``outer_stride``
        adds nothing); the scales need no FSDP ``module``."""
        del outer_stride, module
        precision, (m, k) = self.precision, tuple(outer_size)
        blocks = WeightBlocks.of(precision, (m, k))
        group, rank, size = mesh.get_group(), mesh.get_local_rank(), mesh.size()
        values = self.rows if mp_policy.param_dtype is None else self.rows.to(mp_policy.param_dtype)
        values, first = values.reshape(-1), dim0_shard(m, rank, size)[0] * k
        amax = shard_block_amax(values, first, blocks)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        reduce = precision.layout.amax_reduction((m, k), precision.blocks(WEIGHT), FORWARD_AXES[1])
        amax = amax if reduce is None else reduce(amax)
        scales = gather_scales(precision, amax)
        data = quantise_shard(values, first, blocks, scales, precision.dtypes[WEIGHT]).view(torch.uint8)
        data = F.pad(data.view(-1, k), (0, 0, 0, math.ceil(m / size) - values.numel() // k))
        return (data,), (scales.reciprocal(), m)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The gathered bytes [ceil(M / shards) * shards, K] (the rows past M are padding) become the recipe's
        GatheredWeight; the unsharded parameter stands for the weight in autograd (module docstring)."""
        (data,), (scale_inv, m) = outputs, metadata
        precision = self.precision
        data = data.view(precision.dtypes[WEIGHT])[:m]
        precision.gathered = GatheredWeight(data, scale_inv, WeightBlocks.of(precision, tuple(data.shape)))
        if out is not None:                  # FSDP2's later gathers refill the parameter of the first
            return None
        return Fp8UnshardedWeight(tuple(data.shape), param_dtype, data.device), ()


def gather_weights_in_fp8(model: nn.Module) -> None:
    """Make the weights of ``model``'s FP8 layers (fp8_gather.fp8_gathered_linears) gather in FP8 once
    ``fully_shard`` shards them: their tensors become ``Fp8ShardedWeight``s (before sharding)."""
    for module in fp8_gathered_linears([model]):
        module.weight = nn.Parameter(Fp8ShardedWeight(module.weight.data, module.precision), requires_grad=True)


def local_rows(local: torch.Tensor) -> torch.Tensor:
    """A parameter's FSDP2 local shard as the plain tensor holding its values."""
    return local.rows if isinstance(local, Fp8ShardedWeight) else local


class Fp8UnshardedWeight(torch.Tensor):
    """The unsharded parameter of a weight gathered in FP8: its shape and dtype, no storage. Its recipe
    multiplies by the gathered FP8 weight; FSDP2 and autograd only view it and take its gradient."""

    @staticmethod
    def __new__(cls, shape: tuple, dtype: torch.dtype, device: torch.device):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)

    def __repr__(self):
        return f"Fp8UnshardedWeight({tuple(self.shape)}, {self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        weight = args[0]
        if func in _VIEWS and isinstance(weight, cls):
            shape = args[1] if func is not aten.detach.default and func is not aten.alias.default else weight.shape
            if tuple(shape) == tuple(weight.shape):
                return cls(tuple(weight.shape), weight.dtype, weight.device)
        raise RuntimeError(f"{func} on a weight gathered in FP8 (--fp8-param-gather): its layer's recipe reads it "
                           "as FP8 only")
