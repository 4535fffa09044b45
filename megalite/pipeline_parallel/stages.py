"""Which part of the model a pipeline rank holds, and the stage-to-stage glue.

Layers are split evenly over pp x vpp virtual stages; virtual stage v = chunk * pp + pp_rank holds
layers [v * L/(pp*vpp), (v+1) * L/(pp*vpp)). The first virtual stage also embeds, the last also
normalises, projects to the vocabulary and computes the loss.
"""
from __future__ import annotations

import torch

from megalite.config import ModelConfig
from megalite.context_parallel.ring_attention import ContextParallel, context_parallel_loss, slice_for_context_parallel
from megalite.errors import UserError
from megalite.model.gpt import GPTModel
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel.layers import TensorParallel
from megalite.tensor_parallel.setup import all_reduce_main_grads


def check_pipeline_split(num_layers: int, pp: int, layers_per_virtual_stage: int | None,
                         num_microbatches: int) -> int:
    """Number of model chunks per rank (virtual pipeline size), or a one-line UserError."""
    if num_layers % pp:
        raise UserError(f"--num-layers {num_layers} must be divisible by --pipeline-model-parallel-size {pp}")
    if layers_per_virtual_stage is None:
        return 1
    if pp == 1:
        raise UserError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    per_rank = num_layers // pp
    if per_rank % layers_per_virtual_stage:
        raise UserError(f"--num-layers {num_layers} / --pipeline-model-parallel-size {pp} = {per_rank} layers per "
                        f"stage must be divisible by --num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage}")
    chunks = per_rank // layers_per_virtual_stage
    if chunks > 1 and num_microbatches % pp:
        raise UserError(f"interleaved pipelining needs the number of micro-batches ({num_microbatches}) to be a "
                        f"multiple of --pipeline-model-parallel-size {pp}; change --global-batch-size")
    return chunks


def build_model_chunks(config: ModelConfig, seed: int, tp: TensorParallel, pp_rank: int, pp_size: int,
                       num_chunks: int, cp: ContextParallel | None = None, meta: bool = False) -> list[GPTModel]:
    per_chunk = config.num_layers // (pp_size * num_chunks)
    chunks = []
    for chunk in range(num_chunks):
        virtual_stage = chunk * pp_size + pp_rank
        chunks.append(GPTModel(config, seed=seed, pre_process=virtual_stage == 0,
                               post_process=virtual_stage == pp_size * num_chunks - 1,
                               layer_offset=virtual_stage * per_chunk, num_local_layers=per_chunk, tp=tp, cp=cp,
                               meta=meta))
    return chunks


def shared_embedding_params(chunks: list[GPTModel]) -> list[torch.nn.Parameter]:
    """The word embedding (first stage) and its output-layer copy (last stage) when tied."""
    params = []
    for chunk in chunks:
        if not chunk.share_embeddings_and_output_weights:
            continue
        if chunk.pre_process:
            params.append(chunk.embedding.word_embeddings.weight)
        if chunk.post_process and not chunk.pre_process:
            params.append(chunk.output_layer.weight)
    return params


def sync_shared_embedding_grads(chunks: list[GPTModel], state: ParallelState, ddp=None) -> None:
    """Sum the gradients of the tied embedding's two copies so both receive the same update
    (through ``ddp.all_reduce_param_grads`` when gradients may be ZeRO-sharded)."""
    if state.pp_size == 1:
        return
    all_reduce = ddp.all_reduce_param_grads if ddp is not None else all_reduce_main_grads
    all_reduce([(p, None) for p in shared_embedding_params(chunks)], state.group("embedding"))


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
