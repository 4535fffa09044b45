"""The one place that picks the data-parallel backend (megalite's own DDP/ZeRO, or PyTorch FSDP2) and the
one moment the model chunks get their storage and initial values: once the backend has laid out what
this rank keeps, before anything uses it (materialise.py)."""
from __future__ import annotations

import torch
from torch import nn

from megalite.config.schema import ParallelConfig
from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.data.materialise import materialise
from megalite.parallel.data.protocol import DataParallel
from megalite.parallel.mesh import ParallelState


def build_data_parallel(chunks: list[nn.Module], config: ParallelConfig, parallel: ParallelState,
                        num_microbatches: int, device: torch.device, owner_cost=None) -> DataParallel:
    """The backend for ``config`` over this rank's model chunks (built on the meta device), with the
    chunks' parameters and buffers on ``device`` holding their initial values. ``owner_cost(name, param)``:
    what the whole-parameter ZeRO layout balances the parameters' owners by (None: their sizes)."""
    if config.use_torch_fsdp2:
        # imported only here: torch.distributed.fsdp and DTensor lengthen every other run's start-up
        from megalite.parallel.data.fsdp2 import FullyShardedDataParallel
        backend = FullyShardedDataParallel(chunks, config, parallel, num_microbatches, device=device)
    else:
        backend = DistributedDataParallel(chunks, config, parallel, num_microbatches, device=device,
                                          owner_cost=owner_cost)
    materialise(chunks, backend, device)
    return backend
