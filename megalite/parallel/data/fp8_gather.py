"""--fp8-param-gather: ZeRO's parameter all-gathers carry the weights of FP8 layers in FP8, with their scales.

The weights whose layers run their GEMMs in FP8 with a recipe that takes a gathered weight
(precision/fp8_params.py: tensorwise, delayed, blockwise) sit in buckets of their own (grad_buffer.py,
``Bucket.fp8``). Their master weights stay fp32 in the optimizer, which writes this rank's chunk of the
parameters as usual; a gather of such a bucket then

1. takes each weight's block amaxes over the elements of this rank's chunk and all-reduces them (MAX)
   over the bucket's shard group: one small vector per bucket, so every rank has the scales the GEMM
   would compute from the whole weight;
2. quantises this rank's chunk to FP8 (one byte per element) with those scales;
3. all-gathers the FP8 chunks (the bucket's collective, in bytes: half of bf16's, a quarter of fp32's);
4. hands each layer's recipe its weight as a ``GatheredWeight`` (FP8 bytes + block scales), which the
   forward and input-gradient GEMMs take as is (``Fp8Gemm.gathered``); no one reads the parameter itself.

ZeRO-3 gathers a bucket around each use (the unit's forward, its backward) and frees the FP8 bytes after
(``release``). ZeRO-1/2 keep the FP8 copy of the whole bucket from one optimizer step to the next: the
step marks it stale (``mark_stale``) and the unit's next forward gathers it again (``refresh``); their
full parameter buffer then holds current values only in this rank's chunks of these buckets.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megalite.parallel.data.bucket_comm import Comm, traced, wait
from megalite.parallel.data.grad_buffer import Bucket, ParamAndGradBuffer, Transient
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from megalite.precision.fp8 import WEIGHT, Fp8Gemm
from megalite.precision.fp8_layout import FORWARD_AXES
from megalite.precision.fp8_params import (GatheredWeight, WeightBlocks, gather_scales, quantise_shard,
                                           shard_block_amax, takes_gathered_weight)


def fp8_gathered_linears(models: list[nn.Module]) -> list[nn.Module]:
    """Every tensor-parallel linear whose GEMMs run in FP8 with a recipe that takes gathered weights. Other
    parameters (norms, embedding, output head, router, layers kept in high precision, expert weights) are
    gathered in their own dtype."""
    return [module for model in models for module in model.modules()
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.weight.requires_grad
            and takes_gathered_weight(module.precision)]


def fp8_gathered_weights(models: list[nn.Module]) -> dict[int, Fp8Gemm]:
    """id(weight) -> its layer's recipe, for the weights of ``fp8_gathered_linears``."""
    return {id(module.weight): module.precision for module in fp8_gathered_linears(models)}


def _reduce_over_tensor_parallel(amax: torch.Tensor, parts: list[tuple]) -> None:
    """The amaxes of a weight whose scaling block spans the tensor-parallel ranks' parts (tensorwise: one
    block, the whole weight) reduced over those ranks as well, as the layer's own quantisation of the weight
    does (precision/fp8_layout.py); block recipes' blocks are whole on each TP rank and take nothing. Every
    rank of the TP group holds the same buckets' weights in the same order, so the collectives line up."""
    offset = 0
    for slot, precision, blocks, *_ in parts:
        reduce = precision.layout.amax_reduction(tuple(slot.shape), precision.blocks(WEIGHT), FORWARD_AXES[1])
        if reduce is not None:
            amax[offset:offset + blocks.count] = reduce(amax[offset:offset + blocks.count].clone())
        offset += blocks.count


class Fp8ParamGather:
    """The FP8 gathers of a buffer's ``fp8`` buckets (module docstring). ``precisions``: id(weight) -> its
    layer's recipe (fp8_params.fp8_gathered_weights of the models holding the buffer's parameters)."""

    def __init__(self, buffer: ParamAndGradBuffer, precisions: dict):
        self.buffer = buffer
        self.buckets = [b for b in buffer.buckets if b.fp8]
        self.precisions = {id(p): precisions[id(p)] for b in self.buckets for p in b.params}
        for b in self.buckets:
            b.fp8_gathered = Transient(b.numel, torch.uint8, buffer.device)
            b.fp8_gathered.free()
            b.fp8_local = torch.zeros(b.chunk_numel, dtype=torch.uint8, device=buffer.device)
        self._work: dict[int, object] = {}
        self._stale = {b.index for b in self.buckets}

    def _parts(self, bucket: Bucket) -> list[tuple]:
        """(slot, recipe, blocks, first, at, values) per weight of the bucket: ``values`` its flattened
        elements from ``first`` on that lie in this rank's chunk (maybe none), at offset ``at`` of the chunk."""
        start, end = self.buffer.local_range(bucket)
        chunk, parts = self.buffer.local_param_chunk(bucket), []
        for name, param in zip(bucket.names, bucket.params):
            slot, precision = self.buffer.slots[name], self.precisions[id(param)]
            lo, hi = max(start, slot.start), min(end, slot.end)
            at = min(lo, end) - start
            parts.append((slot, precision, WeightBlocks.of(precision, slot.shape), lo - slot.start, at,
                          chunk[at:at + max(hi - lo, 0)]))
        return parts

    @torch.no_grad()
    def gather(self, bucket: Bucket, comm: Comm, async_op: bool) -> None:
        """Quantise this rank's chunk of ``bucket`` with scales of the whole weights and all-gather it."""
        parts, local = self._parts(bucket), bucket.fp8_local
        amax = torch.cat([shard_block_amax(values, first, blocks) for _, _, blocks, first, _, values in parts])
        if comm.group is not None:
            with traced("fp8 amax all-reduce", bucket):
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=comm.group)
        _reduce_over_tensor_parallel(amax, parts)
        out = bucket.fp8_gathered.allocate()
        offset = 0
        for slot, precision, blocks, first, at, values in parts:
            dtype = precision.dtypes[WEIGHT]
            scales = gather_scales(precision, amax[offset:offset + blocks.count])
            offset += blocks.count
            if values.numel():
                local[at:at + values.numel()] = quantise_shard(values, first, blocks, scales, dtype).view(torch.uint8)
            data = out[slot.start - bucket.start:slot.end - bucket.start].view(dtype).view(slot.shape)
            precision.gathered = GatheredWeight(data, scales.reciprocal(), blocks)
        self._stale.discard(bucket.index)
        if comm.group is None:
            out.copy_(local)
            return
        with traced("fp8 param all-gather", bucket):
            work = comm.all_gather(out, bucket.regions(out), local, async_op=async_op)
        if async_op:
            self._work[bucket.index] = work

    def is_gathered(self, bucket: Bucket) -> bool:
        return bucket.fp8_gathered.allocated and bucket.index not in self._stale

    def wait(self, bucket: Bucket) -> None:
        work = self._work.pop(bucket.index, None)
        if work is not None:
            wait(work, "fp8 param all-gather", bucket)

    def release(self, bucket: Bucket) -> None:
        """Free the bucket's FP8 bytes; its layers' recipes quantise nothing until the next gather."""
        self.wait(bucket)
        bucket.fp8_gathered.free()
        for param in bucket.params:
            self.precisions[id(param)].gathered = None

    # ---- ZeRO-1/2: one FP8 copy per optimizer step ---------------------------------------------------------
    def mark_stale(self) -> None:
        """The optimizer step changed the parameters: every bucket is gathered again before its next use."""
        self._stale = {b.index for b in self.buckets}

    def refresh(self, buckets: list[Bucket], comm_of) -> None:
        """Gather the stale ones among ``buckets`` (a unit's forward pre-hook)."""
        for bucket in buckets:
            if bucket.fp8 and bucket.index in self._stale:
                self.gather(bucket, comm_of(bucket), async_op=False)
