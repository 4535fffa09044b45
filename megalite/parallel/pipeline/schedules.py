"""Forward/backward over the micro-batches of one global batch: ``forward_backward_no_pipelining``
(gradient accumulation on one stage) and ``forward_backward_pipelined`` (this rank's stages under a
synchronous pipeline schedule: 1F1B, interleaved 1F1B, GPipe, ZB-H1, ZB-V; their orders are orders.py's).

Every schedule runs ``forward_step`` (stages.py) per micro-batch, whose loss is the mean per-token loss of
that micro-batch, and backpropagates ``loss * loss_scale / num_microbatches`` so the accumulated gradient
is that of the mean over micro-batches (Megatron's default).

Schedules return the micro-batch losses as one detached tensor on the device (None on pipeline stages
without the loss): reading them on the host would wait for the device, so the training loop reads them
only when it logs.
"""
from __future__ import annotations

import torch

from megalite.parallel.pipeline.executor import PipelineRecord, run_pipeline_schedule
from megalite.parallel.pipeline.plan import rank_plan
from megalite.parallel.pipeline.stages import chunk_forward, forward_step


def forward_backward_no_pipelining(model, batches: list, device: torch.device, loss_scale: float = 1.0,
                                   forward_only: bool = False) -> torch.Tensor:
    """Gradient accumulation on one stage over ``batches`` (the micro-batches); returns each micro-batch's
    mean loss, stacked."""
    losses = []
    num_microbatches = len(batches)
    for batch in batches:
        if forward_only:
            with torch.no_grad():
                loss, _ = forward_step(model, batch, device)
        else:
            loss, _ = forward_step(model, batch, device)
            (loss * (loss_scale / num_microbatches)).backward()
        losses.append(loss.detach())
    return torch.stack(losses)


def forward_backward_pipelined(chunks: list, batches: list, device: torch.device, comm, schedule: str,
                               loss_scale: float = 1.0, forward_only: bool = False,
                               record: PipelineRecord | None = None) -> torch.Tensor | None:
    """One global batch (``batches``, its micro-batches) through this rank's model ``chunks`` with the
    synchronous ``schedule`` (--pipeline-schedule), exchanging with the neighbouring stages over ``comm``
    (p2p.py's PipelineComm); ``record`` collects what ran when and the time spent waiting to receive."""
    plan = rank_plan(schedule, comm.size, comm.rank, len(batches), len(chunks), forward_only)
    return run_pipeline_schedule(plan, chunk_forward(chunks, device), batches, comm, loss_scale, forward_only,
                                 record or PipelineRecord(comm.rank))
