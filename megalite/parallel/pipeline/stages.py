"""Which model chunks a pipeline rank builds (the layer counts come from split.py), and the
stage-to-stage glue: a chunk's forward as the pipeline executor calls it.
"""
from __future__ import annotations

import torch

from megalite.config.schema import ModelConfig
from megalite.parallel.context.ring_attention import ContextParallel, context_parallel_loss, slice_for_context_parallel
from megalite.model.gpt import GPTModel
from megalite.parallel.tensor.layers import TensorParallel


def build_model_chunks(config: ModelConfig, seed: int, tp: TensorParallel, pp_rank: int, pp_size: int,
                       num_chunks: int, cp: ContextParallel | None = None, meta: bool = False,
                       stage_layers: list[int] | None = None, placement=None, moe=None) -> list[GPTModel]:
    """This rank's model chunks. ``stage_layers``: layers per virtual stage (virtual_stage_layers);
    None splits evenly. ``placement(rank, chunk, pp)``: the chunk's virtual stage
    (schedules.py: interleaved_stage, the default, or v_shape_stage for zbv). ``moe``: the expert grid's
    MoEContext (parallel/expert/dispatch.py), shared by the chunks."""
    if stage_layers is None:
        stage_layers = [config.num_layers // (pp_size * num_chunks)] * (pp_size * num_chunks)
    assert len(stage_layers) == pp_size * num_chunks and sum(stage_layers) == config.num_layers, stage_layers
    chunks = []
    for chunk in range(num_chunks):
        virtual_stage = placement(pp_rank, chunk, pp_size) if placement else chunk * pp_size + pp_rank
        chunks.append(GPTModel(config, seed=seed, pre_process=virtual_stage == 0,
                               post_process=virtual_stage == pp_size * num_chunks - 1,
                               layer_offset=sum(stage_layers[:virtual_stage]),
                               num_local_layers=stage_layers[virtual_stage], tp=tp, cp=cp, meta=meta,
                               moe=moe))
    return chunks


def chunk_forward(chunks: list[GPTModel], device: torch.device):
    """forward_fn for run_pipeline_schedule: a chunk's output activation, or the micro-batch mean loss."""
    def forward(chunk_index: int, input_tensor, batch: dict, is_last_stage: bool):
        chunk = chunks[chunk_index]
        batch = slice_for_context_parallel(batch, chunk.cp.rank, chunk.cp.size)
        tokens = batch["tokens"].to(device, non_blocking=True) if chunk.pre_process else None
        positions = batch["position_ids"].to(device, non_blocking=True) if chunk.pre_process else None
        labels = batch["labels"].to(device, non_blocking=True) if chunk.post_process else None
        out = chunk(tokens, positions, labels=labels, hidden_states=input_tensor)
        if not is_last_stage:
            return out
        loss_mask = batch["loss_mask"].to(device, non_blocking=True).float()
        return context_parallel_loss(out, loss_mask, chunk.cp)[0]
    return forward
