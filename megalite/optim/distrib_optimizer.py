"""The distributed optimizer (ZeRO): each data-parallel rank updates only its shard of the model.

Data-parallel rank r of d owns the r-th of d contiguous chunks of every bucket of the flat buffer:
equal ones (one bucket: simply the r-th contiguous 1/d of the buffer), or with the whole-parameter
layout (--use-layer-wise-distributed-optimizer) the whole parameters assigned to it, without padding.
It keeps the fp32 master weights and the update rule's state (Adam: both moments) only for those
chunks: 12 bytes per owned parameter (8 for fp32 models, whose own weights are the master copy), i.e.
12Ψ/d per rank instead of 12Ψ (ZeRO paper).

One step: the data-parallel wrapper has reduce-scattered the gradients (each rank holds the summed
gradient of its chunks, divided by d); the global norm sums every rank's share over the data-parallel
group (and model-parallel ranks, clip_grads.py); AdamW steps the owned chunks; the updated chunks are
written into the model-dtype parameters and all-gathered (ZeRO-1/2, ``DistributedDataParallel.
start_param_sync``; overlapped with the next forward with --overlap-param-gather). Under ZeRO-3 the
parameters stay sharded, so the update lands directly in this rank's parameter shard.
"""
from __future__ import annotations

from megalite.config.schema import ModelConfig, OptimizerConfig
from megalite.parallel.data.protocol import DataParallel
from megalite.optim.master_weights import Piece
from megalite.optim.mixed_precision import MixedPrecisionOptimizer


class DistributedOptimizer(MixedPrecisionOptimizer):
    grads_sharded = True

    def __init__(self, ddp: DataParallel, config: OptimizerConfig, parallel=None, model: ModelConfig | None = None):
        if not ddp.shard_optimizer:
            raise ValueError("the distributed optimizer needs a sharding strategy other than no_shard")
        super().__init__(ddp.buffer, ddp.named_params, config, parallel=parallel, ddp=ddp, model=model)

    def _pieces(self) -> list[Piece]:
        """This rank's chunk of every bucket: the flat range, its parameters, its reduced gradients."""
        buf = self.buffer
        return [Piece(*buf.local_range(b), buf.local_param_chunk(b), buf.local_grad_chunk(b)) for b in buf.buckets]

    def _shard_groups(self) -> tuple:
        """The dense weights' shard group (replicas under hybrid sharding hold the same shards) and the
        expert weights' (the expert-data-parallel group, or its instance's part)."""
        dense = self.ddp.shard_group if self.ddp.group is not None else None
        p = self.parallel
        if p is None or p.group("expert_mp") is None or p.edp_size == 1:
            return dense, None
        return dense, p.group("edp_shard" if p.instances > 1 else "edp")

    def _after_step(self) -> None:
        self.ddp.start_param_sync()


def build_optimizer(ddp: DataParallel, config: OptimizerConfig, parallel=None,
                    model: ModelConfig | None = None) -> MixedPrecisionOptimizer:
    """The optimizer for ``ddp``'s sharding strategy: replicated (no_shard) or distributed (ZeRO).
    ``model``: the model's config, which Muon needs (its logical matrices)."""
    if ddp.shard_optimizer:
        return DistributedOptimizer(ddp, config, parallel, model)
    return MixedPrecisionOptimizer(ddp.buffer, ddp.named_params, config, parallel=parallel, ddp=ddp, model=model)
