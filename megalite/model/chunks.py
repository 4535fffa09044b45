"""Which model chunks a pipeline rank builds: one GPTModel per virtual stage it holds, each with its
layers' global numbers (the layer counts per virtual stage come from config/pipeline_split.py)."""
from __future__ import annotations

from megalite.config.schema import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.context.ring_attention import ContextParallel
from megalite.parallel.tensor.layers import TensorParallel


def build_model_chunks(config: ModelConfig, seed: int, tp: TensorParallel, pp_rank: int, pp_size: int,
                       num_chunks: int, cp: ContextParallel | None = None, meta: bool = False,
                       stage_layers: list[int] | None = None, placement=None, moe=None) -> list[GPTModel]:
    """This rank's model chunks. ``stage_layers``: layers per virtual stage (virtual_stage_layers);
    None splits evenly. ``placement(rank, chunk, pp)``: the chunk's virtual stage
    (parallel/pipeline/orders.py: interleaved_stage, the default, or v_shape_stage for zbv). ``moe``: the
    expert grid's MoEContext (parallel/expert/dispatch.py), shared by the chunks."""
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
