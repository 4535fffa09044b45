"""The batch-to-model glue that every schedule runs: ``forward_step`` takes one micro-batch through one
model chunk (context-parallel slicing, the batch's tensors to the device, the chunk's forward, and on the
stage with the loss the masked mean over whole sequences), and ``chunk_forward`` adapts it to the
pipeline executor's forward_fn.

With multi-token prediction (the chunk's ``mtp``, model/mtp.py) the last stage adds the MTP depths' inputs
and targets to the micro-batch before context parallelism slices it, and their loss term to the loss.

A micro-batch may carry its loss weight under ``LOSS_WEIGHT`` (--calculate-per-token-loss:
train/step.py's per_token_loss_weights); forward_step multiplies the loss by it, the one place it is
applied whatever the schedule.
"""
from __future__ import annotations

import torch

from megalite.parallel.context.ring_attention import context_parallel_loss, slice_for_context_parallel

LOSS_WEIGHT = "loss_weight"      # a micro-batch's 0-dim weight of its mean loss (per-token loss)


def forward_step(model, batch: dict, device: torch.device, hidden_states: torch.Tensor | None = None,
                 is_last_stage: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One micro-batch through ``model`` (a GPTModel chunk: its ``cp``, ``pre_process``, ``post_process``,
    ``mtp``).
    On the last stage: (the mean of the per-token losses where loss_mask is 1, over whole sequences: with
    context parallelism each rank computes its chunks and the sums are combined over the CP group, times
    the batch's LOSS_WEIGHT when it has one; the number of tokens counted). Elsewhere: (the chunk's output
    activation, None). ``hidden_states``: the previous stage's output, for chunks without the embedding."""
    # multi-token prediction (training, last stage): its shifted inputs and targets, from whole sequences
    mtp = model.mtp if is_last_stage and model.training else None
    if mtp is not None:
        batch = mtp.with_targets(batch)
    batch = slice_for_context_parallel(batch, model.cp.rank, model.cp.size)
    tokens = batch["tokens"].to(device, non_blocking=True) if model.pre_process else None
    labels = batch["labels"].to(device, non_blocking=True) if model.post_process else None
    # every stage: the positions (RoPE reads them with --reset-position-ids) and the document boundaries
    # (--reset-attention-mask), which every attention call needs
    positions, documents = (batch[key].to(device, non_blocking=True) if key in batch else None
                            for key in ("position_ids", "cu_seqlens"))
    extra = {} if mtp is None else {key: batch[key].to(device, non_blocking=True)
                                    for key in ("mtp_tokens", "mtp_labels")}
    out = model(tokens, positions, labels=labels, hidden_states=hidden_states, cu_seqlens=documents, **extra)
    if not is_last_stage:
        return out, None
    if mtp is not None:
        out, mtp_out = out
    loss_mask = batch["loss_mask"].to(device, non_blocking=True).float()
    loss, num_tokens = context_parallel_loss(out, loss_mask, model.cp)
    weight = batch.get(LOSS_WEIGHT)
    if mtp is not None:      # 0-valued: the reported loss stays the lm loss, the gradient gains the MTP term
        mtp_mask = batch["mtp_loss_mask"].to(device, non_blocking=True).float()
        loss = loss + mtp.loss_term(mtp_out, mtp_mask, model.cp, weight)
    return (loss if weight is None else loss * weight), num_tokens


def chunk_forward(chunks: list, device: torch.device):
    """forward_fn for run_pipeline_schedule: forward_step's output activation, or its loss on the last
    stage."""
    def forward(chunk_index: int, input_tensor, batch: dict, is_last_stage: bool):
        return forward_step(chunks[chunk_index], batch, device, input_tensor, is_last_stage)[0]
    return forward
