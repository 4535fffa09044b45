"""Point-to-point transfers of activations and gradients between pipeline stages.

Shapes are known from the config ([seq (/tp with sequence parallelism), micro-batch, hidden] in the
model's dtype), so no shape is ever sent. Every transfer is a single ``isend`` / ``irecv`` with tag 0:
NCCL ignores tags and matches the n-th send from a to b with the n-th receive on b from a, and gloo,
given one tag, matches the same way, so both backends pair messages by posting order alone. The one
caller, executor.py, posts in plan.py's global order, which both ends agree on.

- ``send`` posts a send and never waits for it; the tensor is kept alive until the transfer completes
  (``flush`` waits for the rest at the end of a schedule). A completed send is dropped without a wait
  (whether it completed is the run backend's question: a dry run's absent peer takes it at once).
- ``post_recv`` posts a receive into a fresh buffer and ``wait`` blocks only when the data is needed.

Works: one per operation, each waited at most once (a gloo work must never be waited twice).

With virtual stages the stages form a ring: the last rank's chunk c feeds the first rank's chunk c + 1,
so pipeline ranks wrap around (``global_rank``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.observe.memory import memory_label
from megalite.parallel.dry_run import REAL_RUN, RealRun


@dataclass
class PendingReceive:
    work: object
    tensor: torch.Tensor


@dataclass
class PipelineComm:
    group: object                 # the pipeline group of this rank
    rank: int                     # pipeline rank
    size: int                     # pipeline size
    shape: tuple                  # activation shape exchanged between stages
    dtype: torch.dtype
    device: torch.device
    pending_sends: list = field(default_factory=list)     # [(work, tensor)] still in flight
    run: RealRun = REAL_RUN       # peers present or absent (parallel/dry_run.py)

    def global_rank(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.group, pipeline_rank % self.size)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Post a send of ``tensor`` to global rank ``dst``; returns at once."""
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst, group=self.group)
        self.pending_sends = [(w, t) for w, t in self.pending_sends if not self.run.send_completed(w)]
        self.pending_sends.append((work, tensor))

    def post_recv(self, src: int) -> PendingReceive:
        """Post a receive from global rank ``src`` into a fresh buffer; ``wait`` it when needed."""
        with memory_label("activations: received"):
            tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return PendingReceive(dist.irecv(tensor, src, group=self.group), tensor)

    @staticmethod
    def wait(received: PendingReceive) -> torch.Tensor:
        received.work.wait()
        received.work = None             # never waited twice
        return received.tensor

    def flush(self) -> None:
        """Wait for every send still in flight (end of a schedule)."""
        for work, _ in self.pending_sends:
            if not work.is_completed():
                work.wait()
        self.pending_sends = []
