"""Point-to-point exchange of activations and gradients between pipeline stages.

Shapes are known from the config ([seq (/tp with sequence parallelism), micro-batch, hidden] in the
model's dtype), so no shape is ever sent.

Overlap (the schedule executor in schedules.py drives it):
- ``send`` posts a send as soon as the tensor exists and never waits for it; the tensor is kept alive
  until its transfer completes (``flush`` waits for the rest at the end of a schedule);
- ``post_recv`` posts a receive ahead of need (the executor keeps the next receiving action's receive
  in flight while it computes the current one) and ``wait`` blocks only when the data is needed.
A stage therefore never waits on a neighbour that is itself waiting to receive, and the executor's
receive-wait timer measures true waits. Receives and sends are posted in each rank's action order, so
messages of one kind (activations, gradients) between two ranks are matched in order on gloo and
NCCL alike. NCCL ignores tags, so when activations and gradients between the same two ranks do not
interleave the same way on both sides (zbv: rank r sends chunk 0's activations to r + 1 and receives
chunk 1's from it), gradients travel in a second process group of the same ranks
(``gradient_group``), whose communicator matches them apart.

Works: one per operation, each waited at most once (a gloo work must never be waited twice), and a
completed send is dropped without a wait.

``exchange`` (a batch of sends plus one receive, waited at once) stays for callers that run in
lockstep (the asynchronous PipeDream schedules).

With virtual stages the stages form a ring: the last rank's chunk c feeds the first rank's chunk c + 1,
so "next" and "previous" wrap around.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


ACTIVATION_TAG, GRADIENT_TAG = 1, 2


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
    pending_sends: list = field(default_factory=list)     # [(works, tensors)] still in flight
    gradient_group: object = None  # same ranks as ``group``, for gradients (zbv); None: ``group``

    def _group_for(self, tag: int):
        return self.gradient_group if tag == GRADIENT_TAG and self.gradient_group is not None else self.group

    def global_rank(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.group, pipeline_rank % self.size)

    _global = global_rank

    @property
    def next_rank(self) -> int:
        return self.global_rank(self.rank + 1)

    @property
    def prev_rank(self) -> int:
        return self.global_rank(self.rank - 1)

    # ---- overlapped: post now, wait when needed ------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Post a send of ``tensor`` to global rank ``dst``; returns at once."""
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst, group=self._group_for(tag), tag=tag)
        self._drop_completed_sends()
        self.pending_sends.append(([work], [tensor]))

    def post_recv(self, src: int, tag: int) -> PendingReceive:
        """Post a receive from global rank ``src`` into a fresh buffer; ``wait`` it when needed."""
        tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return PendingReceive(dist.irecv(tensor, src, group=self._group_for(tag), tag=tag), tensor)

    @staticmethod
    def wait(received: PendingReceive) -> torch.Tensor:
        received.work.wait()
        received.work = None             # never waited twice
        return received.tensor

    def _drop_completed_sends(self) -> None:
        self.pending_sends = [(w, ts) for w, ts in self.pending_sends if not all(x.is_completed() for x in w)]

    # ---- lockstep exchange -----------------------------------------------------------------------
    def exchange(self, sends: list[tuple[torch.Tensor, int, int]], recv_from: int | None,
                 tag: int = 0) -> torch.Tensor | None:
        """Post ``sends`` [(tensor, global dst, tag)] and, if asked, a receive from ``recv_from``, as one
        batch (NCCL runs it as one group, so two neighbours sending to each other cannot deadlock).
        Returns the received tensor once it has arrived; sends complete in the background."""
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
        self._drop_completed_sends()
        if send_works:
            self.pending_sends.append((send_works, [t for t, _, _ in sends]))
        return received

    def flush(self) -> None:
        """Wait for every send still in flight (end of a schedule)."""
        for works, _ in self.pending_sends:
            for work in works:
                if not work.is_completed():
                    work.wait()
        self.pending_sends = []


def separate_gradient_group(parallel):
    """This rank's second pipeline group (same ranks as "pp"), for PipelineComm.gradient_group.
    Collective: every rank calls it, in the same order."""
    from megalite.parallel_state import rank_grid_groups
    mine = None
    for members in rank_grid_groups(parallel.world_size, parallel.tp_size, parallel.cp_size, parallel.pp_size, "p"):
        group = parallel.new_group(members)
        if parallel.rank in members:
            mine = group
    return mine
