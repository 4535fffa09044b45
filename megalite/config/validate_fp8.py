"""The rules of FP8 GEMMs (--fp8-format), one line each:
- a recipe that scales in fixed blocks along the contraction dimension (blockwise 128, MXFP8 32) needs
  every linear's input and output width on each tensor-parallel rank to be whole blocks, which the FP8
  kernels read;
- where ranks hold other tokens of the same sequences (context parallelism; sequence parallelism for
  multi-latent attention's down projections), the weight gradient's contraction runs over each rank's
  tokens, which the recipe scales in 1 x block tiles: a rank's runs of positions (--seq-length / (2 x CP)
  load-balanced chunks; / (CP x TP) for the down projections), times --micro-batch-size sequences
  (positions first), must be whole tiles, so that its tiles are the single process's; or one micro-batch
  fits a tile, whose amax those ranks then share;
- the linears' FP8 backward GEMMs run in their own autograd Functions, which a torch.compile graph replaces
  with its own backward (--compile);
- --first-last-layers-bf16 keeps at most one pipeline stage's layers at each end (Megatron's bound);
- --fp8-param-gather changes the parameter all-gathers of ZeRO (megalite's own or FSDP2's), so it needs
  FP8 layers and a sharding strategy;
- --moe-router-padding-for-fp8 pads the experts' rows for FP8 GEMMs, so it needs both."""
from __future__ import annotations

from megalite.config.fp8_fields import FP8_BLOCKS
from megalite.config.schema import MegaliteConfig, ModelConfig, ParallelConfig
from megalite.errors import UserError


def _gemm_widths(m: ModelConfig, p: ParallelConfig) -> list[tuple[str, int]]:
    """(what, width per tensor-parallel rank) of the transformer layers' GEMM dimensions."""
    tp = p.tensor_model_parallel_size
    widths = [(f"--hidden-size {m.hidden_size}", m.hidden_size),
              (f"--ffn-hidden-size {m.ffn_hidden_size}", m.ffn_hidden_size // tp),
              (f"the query width {m.num_attention_heads * m.kv_channels} (heads x --kv-channels)",
               m.num_attention_heads * m.kv_channels // tp)]
    if m.num_query_groups >= tp:
        widths.append((f"the key/value width {m.kv_projection_size} (--num-query-groups x --kv-channels)",
                       m.kv_projection_size // tp))
    if m.num_experts:
        widths.append((f"the expert FFN width {m.expert_ffn_hidden_size}", m.expert_ffn_hidden_size // p.expert_tp_size))
    if m.multi_latent_attention:
        widths += [(f"--kv-lora-rank {m.kv_lora_rank}", m.kv_lora_rank)]
        widths += [(f"--q-lora-rank {m.q_lora_rank}", m.q_lora_rank)] if m.q_lora_rank else []
    return widths


def check_fp8(config: MegaliteConfig) -> None:
    m, p = config.model, config.parallel
    if m.moe_router_padding_for_fp8 and not (m.fp8_format and m.num_experts):
        raise UserError("--moe-router-padding-for-fp8 pads the experts' rows for FP8 GEMMs: it needs --fp8-format and "
                        "--num-experts; drop it or add them")
    if m.fp8_format is not None and config.training.compile:
        raise UserError("--compile builds its own backward, not the FP8 one of --fp8-format; drop --compile")
    _check_fp8_param_gather(m, p)
    per_stage = m.num_layers // p.pipeline_model_parallel_size
    for name, count in (("start", m.num_layers_at_start_in_bf16), ("end", m.num_layers_at_end_in_bf16)):
        if m.first_last_layers_bf16 and count > per_stage:
            raise UserError(f"--num-layers-at-{name}-in-bf16 {count} is more than the {per_stage} layers of a "
                            "pipeline stage; lower it")
    block = FP8_BLOCKS.get(m.fp8_recipe)
    if m.fp8_format is None or block is None:
        return
    tp = p.tensor_model_parallel_size
    for what, width in _gemm_widths(m, p):
        if width % block:
            per_rank = f" ({width} per tensor-parallel rank)" if tp > 1 else ""
            raise UserError(f"--fp8-recipe {m.fp8_recipe} scales in blocks of {block}: {what}{per_rank} is not a "
                            f"multiple of {block}; change it or use --fp8-recipe tensorwise / rowwise")
    _check_token_tiles(config, block)


def _check_token_tiles(config: MegaliteConfig, block: int) -> None:
    m, p, mbs = config.model, config.parallel, config.training.micro_batch_size
    cp, tp = p.context_parallel_size, p.tensor_model_parallel_size
    runs = [(m.seq_length // (2 * cp), f"--seq-length {m.seq_length} / {2 * cp} (--context-parallel-size {cp})")]
    if m.multi_latent_attention and p.sequence_parallel:      # its down projections run on the sequence shard
        runs.append((m.seq_length // (cp * tp), f"--seq-length {m.seq_length} / {cp * tp} (CP x TP, the down "
                                                "projections' sequence shard)"))
    for positions, what in runs[0 if cp > 1 else 1:]:
        if (positions * mbs) % block and m.seq_length * mbs > block:
            raise UserError(f"--fp8-recipe {m.fp8_recipe} scales tokens in tiles of {block}: a rank holds runs of "
                            f"{what} positions x --micro-batch-size {mbs} = {positions * mbs} tokens, not whole "
                            f"tiles; make that a multiple of {block}")


def _check_fp8_param_gather(m: ModelConfig, p: ParallelConfig) -> None:
    if not p.fp8_param_gather:
        return
    if m.fp8_format is None:
        raise UserError("--fp8-param-gather gathers the weights of FP8 layers: add --fp8-format e4m3|hybrid")
    if p.data_parallel_sharding_strategy == "no_shard":
        raise UserError("--fp8-param-gather needs a sharding strategy: add --use-distributed-optimizer or "
                        "--data-parallel-sharding-strategy optim_grads_params")
