"""Point-to-point exchange of activations and gradients between adjacent pipeline stages.

Shapes are known from the config ([seq (/tp with sequence parallelism), micro-batch, hidden] in the
model's dtype), so no shape is ever sent. Every exchange a stage makes at one moment (a send of what
it just computed plus the receive it needs next) goes into a single ``batch_isend_irecv`` call: NCCL
runs the batch as one group, so two neighbours that send to each other at the same time cannot
deadlock. Only receives are waited for at once; sends complete in the background (``flush`` waits
for the rest), so a stage never blocks on a neighbour that is itself waiting to receive.

With virtual stages (interleaving) the stages form a ring: the last rank's chunk c feeds the first
rank's chunk c + 1, so "next" and "previous" wrap around.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class PipelineComm:
    group: object                 # the pipeline group of this rank
    rank: int                     # pipeline rank
    size: int                     # pipeline size
    shape: tuple                  # activation shape exchanged between stages
    dtype: torch.dtype
    device: torch.device
    pending_sends: list = field(default_factory=list)

    def _global(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.group, pipeline_rank % self.size)

    @property
    def next_rank(self) -> int:
        return self._global(self.rank + 1)

    @property
    def prev_rank(self) -> int:
        return self._global(self.rank - 1)

    def exchange(self, sends: list[tuple[torch.Tensor, int, int]], recv_from: int | None,
                 tag: int = 0) -> torch.Tensor | None:
        """Post ``sends`` [(tensor, global dst, tag)] and, if asked, a receive from ``recv_from``, as one batch.

        Tags keep activations and gradients apart when next and previous stage are the same rank
        (two stages in a ring). Returns the received tensor once it has arrived."""
        sends = [(t.contiguous(), dst, t_tag) for t, dst, t_tag in sends]
        ops = [dist.P2POp(dist.isend, t, dst, group=self.group, tag=t_tag) for t, dst, t_tag in sends]
        received = None
        if recv_from is not None:
            received = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, received, recv_from, group=self.group, tag=tag))
        if not ops:
            return None
        works = dist.batch_isend_irecv(ops)      # one work per op (gloo) or one for the batch (NCCL)
        if received is not None:
            works[-1].wait()                     # never wait on a work twice: gloo would block
        send_works = works[:len(sends)] if len(works) == len(ops) else ([] if received is not None else works)
        # keep the sent tensors alive until their transfers complete
        self.pending_sends = [(w, ts) for w, ts in self.pending_sends if not all(x.is_completed() for x in w)]
        if send_works:
            self.pending_sends.append((send_works, [t for t, _, _ in sends]))
        return received

    def flush(self) -> None:
        """Wait for every send still in flight (end of a schedule)."""
        for works, _ in self.pending_sends:
            for work in works:
                work.wait()
        self.pending_sends = []
