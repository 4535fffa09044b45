"""Every rule between configuration fields, on the typed configs; each failure is one line naming the flags
and the fix.

Entry points:
- ``validate(config, world_size)``: all of them, for pretrain_gpt.py's command line (megatron_cli.py);
- ``check_layout(config)``: the rules of one parallel layout (sizes that must divide, schedules and what
  they compose with, the pipeline split); the trainer runs it at start-up and the planner on each
  candidate layout. It returns the number of model chunks per pipeline rank;
- ``check_async_schedule(config)``: what the asynchronous pipeline schedules support, checked when one is
  built (parallel/pipeline/pipedream.py);
- ``check_paths(training)``: the folders the run will write (the file system; --load is read, and
  checked, by train/command_line.py).
"""
from __future__ import annotations

import os

from megalite.config.pipeline_split import layout_mtp_layers, stage_layers_of
from megalite.config.validate_attention import (check_context_parallel, check_masked_attention,
                                                check_multi_latent_attention, check_window)
from megalite.config.validate_deepseek import check_group_routing, check_mtp
from megalite.config.validate_fp8 import check_fp8
from megalite.config.validate_muon import check_muon
from megalite.config.validate_qk_clip import check_qk_clip
from megalite.config.schema import (ASYNC_SCHEDULES, ZERO_BUBBLE_SCHEDULES, DataConfig, MegaliteConfig, ModelConfig,
                                    OptimizerConfig, ParallelConfig, TrainingConfig, rotary_dim)
from megalite.errors import UserError

MAX_SEED = 2 ** 32 - 1           # numpy's seeding range


def validate(config: MegaliteConfig, world_size: int) -> None:
    """Every cross-field rule of a run started on ``world_size`` processes."""
    if config.optimizer.bf16 and config.optimizer.fp16:
        raise UserError("--bf16 and --fp16 are exclusive; pick one")
    check_model(config.model)
    check_moe(config.model)
    check_group_routing(config.model)
    check_mtp(config)
    _check_ranges(config)
    check_world_size(world_size, config.parallel)
    check_layout(config)
    _check_data_parallel(config.parallel)
    _check_learning_rate(config.optimizer)
    check_muon(config)
    check_qk_clip(config)
    check_fp8(config)
    _check_data(config.data)
    check_masked_attention(config.model, config.data.reset_attention_mask)
    _check_checkpointing(config.training)
    _check_logging(config.training)
    _check_dry_run(config)


def _check_dry_run(config: MegaliteConfig) -> None:
    """--fake-process-group plays one rank without its peers: what it computes is not a model."""
    p = config.parallel
    if not p.fake_process_group:
        for flag, value in (("--fake-world-size", p.fake_world_size), ("--fake-rank", p.fake_rank)):
            if value is not None:
                raise UserError(f"{flag} names the rank a dry run plays; add --fake-process-group, or drop {flag}")
        if p.no_storage:
            raise UserError("--no-storage is a dry run's mode; add --fake-process-group, or drop --no-storage")
        return
    if config.training.save:
        raise UserError("--fake-process-group trains one rank on values its absent peers never sent, so its "
                        "checkpoint would be garbage; drop --save")
    if p.no_storage and p.use_torch_fsdp2:
        raise UserError("--no-storage runs on the meta device, where --use-torch-fsdp2's fully_shard finds no "
                        "device to shard on; drop --no-storage (the dry run with storage measures the same bytes)")


# ---- the model ---------------------------------------------------------------------------------------
def check_model(m: ModelConfig) -> None:
    check_multi_latent_attention(m)
    if m.num_attention_heads % m.num_query_groups:
        raise UserError(f"--num-attention-heads {m.num_attention_heads} must be divisible by "
                        f"--num-query-groups {m.num_query_groups}")
    if m.use_rope and m.rotary_head_dim % 2:
        raise UserError(f"rope needs an even head dimension, got {m.rotary_head_dim} (--kv-channels or "
                        "--hidden-size/--num-attention-heads)")
    _check_rotary_percent(m)
    check_variants(m)
    check_window(m)
    if m.max_position_embeddings < m.seq_length:
        raise UserError(f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
                        f"{m.max_position_embeddings}; raise --max-position-embeddings")
    for flag, value in (("--attention-dropout", m.attention_dropout), ("--hidden-dropout", m.hidden_dropout)):
        if not 0.0 <= value < 1.0:
            raise UserError(f"{flag} must be in [0, 1), got {value}")
    if m.init_method_std <= 0:
        raise UserError(f"--init-method-std must be > 0, got {m.init_method_std}")
    if m.recompute_granularity == "full" and m.recompute_method is None:
        raise UserError("--recompute-granularity full needs --recompute-method uniform or block")
    if m.recompute_granularity != "full" and (m.recompute_method or m.recompute_num_layers):
        raise UserError("--recompute-method and --recompute-num-layers apply only to --recompute-granularity full")


def check_variants(m: ModelConfig) -> None:
    """YaRN's flags need YaRN RoPE (--position-embedding-type yarn, or MLA's default); the quick GEGLU's need --quick-geglu, not --swiglu."""
    yarn = [f for f, on in (("--rotary-scaling-factor", m.rotary_scaling_factor != 1.0),
                            ("--yarn-original-max-position-embeddings", m.yarn_original_max_position_embeddings))
            if on]
    if yarn and not m.uses_yarn:
        raise UserError(f"{yarn[0]} scales RoPE by YaRN: add --position-embedding-type yarn")
    glu = [f for f, on in (("--glu-linear-offset", m.glu_linear_offset != 0.0),
                           ("--activation-func-clamp-value", m.activation_func_clamp_value is not None)) if on]
    if glu and not m.quick_geglu:
        raise UserError(f"{glu[0]} applies to the quick GEGLU activation: add --quick-geglu")
    if m.quick_geglu and m.swiglu:
        raise UserError("--quick-geglu and --swiglu are two gated activations: give one")


def _check_rotary_percent(m: ModelConfig) -> None:
    if not 0.0 < m.rotary_percent <= 1.0:
        raise UserError(f"--rotary-percent must be in (0, 1], got {m.rotary_percent:g}")
    if m.rotary_percent == 1.0:
        return
    if not m.use_rope:
        raise UserError(f"--rotary-percent {m.rotary_percent:g} needs --position-embedding-type rope")
    dim = rotary_dim(m.kv_channels, m.rotary_percent)
    if dim < 2 or dim % 2:
        raise UserError(f"--rotary-percent {m.rotary_percent:g} rotates {dim} of the head's {m.kv_channels} "
                        "dimensions; RoPE needs an even number >= 2: choose a percent giving an even count")


def _check_ranges(config: MegaliteConfig) -> None:
    """Numbers that would otherwise fail deep inside torch/numpy, or silently train nonsense:
    (flag, value, smallest allowed value, is the bound itself allowed?)."""
    m, o, t = config.model, config.optimizer, config.training
    for flag, value, low, inclusive in (
            ("--norm-epsilon", m.norm_epsilon, 0.0, False), ("--rotary-base", m.rotary_base, 0.0, False),
            ("--weight-decay", o.weight_decay, 0.0, True), ("--adam-eps", o.adam_eps, 0.0, False),
            ("--clip-grad", o.clip_grad, 0.0, True), ("--lr-warmup-init", o.lr_warmup_init, 0.0, True),
            ("--initial-loss-scale", o.initial_loss_scale, 0.0, False),
            ("--min-loss-scale", o.min_loss_scale, 0.0, False), ("--seed", t.seed, 0, True)):
        if value < low or (value == low and not inclusive):
            raise UserError(f"{flag} must be {'>=' if inclusive else '>'} {low:g}, got {value:g}")
    if t.seed > MAX_SEED:
        raise UserError(f"--seed must be in [0, {MAX_SEED}], got {t.seed}")


# ---- the parallel layout -----------------------------------------------------------------------------
def check_world_size(world_size: int, p: ParallelConfig) -> None:
    if world_size % p.model_parallel_size:
        raise UserError(f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                        f"{p.tensor_model_parallel_size} x --pipeline-model-parallel-size "
                        f"{p.pipeline_model_parallel_size} x --context-parallel-size {p.context_parallel_size}; "
                        f"launch a multiple of {p.model_parallel_size} processes")
    stage = world_size // p.pipeline_model_parallel_size
    experts = p.expert_tp_size * p.expert_model_parallel_size
    if stage % experts:
        raise UserError(f"--expert-tensor-parallel-size {p.expert_tp_size} x --expert-model-parallel-size "
                        f"{p.expert_model_parallel_size} must divide the {stage} ranks of each pipeline stage "
                        f"(world {world_size} / --pipeline-model-parallel-size {p.pipeline_model_parallel_size}); "
                        "choose sizes whose product divides it")


def check_layout(config: MegaliteConfig) -> int:
    """The rules of one parallel layout; returns the model chunks per pipeline rank."""
    check_tensor_parallel(config.model, config.parallel)
    check_world_size(config.parallel.world_size, config.parallel)
    check_experts(config.model, config.parallel)
    t, dp = config.training, config.parallel.data_parallel_size
    check_batch(t.micro_batch_size, t.global_batch_size, dp)
    check_zero_bubble(config.parallel, config.model)
    if config.parallel.use_torch_fsdp2:
        _check_torch_fsdp2(config.parallel)
    check_optimizer_instances(config.parallel, config.model)
    chunks = 1
    for batch in sorted({t.global_batch_size, *(b for _, b in t.batch_size_schedule)}):
        chunks = check_pipeline_split(config.model.num_layers, config.parallel, batch // (t.micro_batch_size * dp),
                                      config.model.mtp_num_layers or 0)
    return chunks


def check_moe(m: ModelConfig) -> None:
    """The MoE flags among themselves (model/moe.py)."""
    if not m.num_experts:
        moe_flags = [f for f, v in (("--moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size),
                                    ("--moe-router-enable-expert-bias", m.moe_router_enable_expert_bias),
                                    ("--moe-expert-capacity-factor", m.moe_expert_capacity_factor)) if v]
        if moe_flags:
            raise UserError(f"{moe_flags[0]} applies to MoE layers; add --num-experts N")
        return
    if m.moe_router_topk > m.num_experts:
        raise UserError(f"--moe-router-topk {m.moe_router_topk} exceeds --num-experts {m.num_experts}; "
                        "route each token to at most every expert")
    if isinstance(m.moe_layer_freq, list) and len(m.moe_layer_freq) != m.num_layers:
        raise UserError(f"--moe-layer-freq lists {len(m.moe_layer_freq)} layers but --num-layers is {m.num_layers}; "
                        "give one 0/1 per layer")
    if m.moe_expert_capacity_factor is not None and m.moe_expert_capacity_factor <= 0:
        raise UserError(f"--moe-expert-capacity-factor must be > 0, got {m.moe_expert_capacity_factor:g}; "
                        "leave it out for dropless routing")
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        raise UserError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        raise UserError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as DeepSeek-V3)")
    if m.moe_shared_expert_gate and not m.moe_shared_expert_intermediate_size:
        raise UserError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")


def check_experts(m: ModelConfig, p: ParallelConfig) -> None:
    """How the experts split over the expert grid."""
    ep, etp, tp = p.expert_model_parallel_size, p.expert_tp_size, p.tensor_model_parallel_size
    if not m.num_experts:
        if ep > 1 or p.expert_tensor_parallel_size not in (None, tp):
            raise UserError("--expert-model-parallel-size / --expert-tensor-parallel-size need an MoE model "
                            "(--num-experts N)")
        return
    if m.num_experts % ep:
        raise UserError(f"--expert-model-parallel-size {ep} does not divide --num-experts {m.num_experts}; "
                        "choose a divisor of the expert count")
    if m.expert_ffn_hidden_size % etp:
        raise UserError(f"--expert-tensor-parallel-size {etp} does not divide the experts' hidden size "
                        f"{m.expert_ffn_hidden_size} (--moe-ffn-hidden-size); choose a divisor")
    if m.add_bias_linear and etp > 1:
        raise UserError(f"expert biases (MoE without --disable-bias-linear) need whole experts on each rank: "
                        f"add --expert-tensor-parallel-size 1 (now {etp})")
    if tp > 1 and not p.sequence_parallel:
        raise UserError("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel "
                        "(each rank routes its own tokens)")
    if p.use_torch_fsdp2:
        raise UserError("--use-torch-fsdp2 does not shard experts over their own data-parallel group; use "
                        "--data-parallel-sharding-strategy (megalite's ZeRO) with MoE")


def check_tensor_parallel(m: ModelConfig, p: ParallelConfig) -> None:
    """Heads, KV groups and the FFN split over TP ranks; the sequence over TP (sequence parallel) and over
    2 x CP chunks (ring attention)."""
    tp, groups = p.tensor_model_parallel_size, m.num_query_groups
    if m.num_attention_heads % tp:
        raise UserError(f"--num-attention-heads {m.num_attention_heads} must be divisible by "
                        f"--tensor-model-parallel-size {tp}")
    if tp <= groups and groups % tp:
        raise UserError(f"--num-query-groups {groups} must be divisible by --tensor-model-parallel-size {tp}")
    if tp > groups and tp % groups:
        raise UserError(f"--tensor-model-parallel-size {tp} must be a multiple of --num-query-groups {groups} "
                        "(KV heads are then replicated)")
    if m.ffn_hidden_size % tp:
        raise UserError(f"--ffn-hidden-size {m.ffn_hidden_size} must be divisible by --tensor-model-parallel-size {tp}")
    if m.padded_vocab_size % tp:
        raise UserError(f"padded vocabulary {m.padded_vocab_size} is not divisible by --tensor-model-parallel-size {tp}; "
                        "pad it with megalite.config.schema.padded_vocab_size")
    if p.sequence_parallel and tp > 1 and m.seq_length % tp:
        raise UserError(f"--sequence-parallel needs --seq-length {m.seq_length} divisible by "
                        f"--tensor-model-parallel-size {tp}")
    check_context_parallel(m, p)


def check_batch(micro_batch_size: int, global_batch_size: int, dp: int) -> None:
    """The global batch splits into whole micro-batches over the data-parallel ranks."""
    if global_batch_size < micro_batch_size * dp:
        raise UserError(f"--micro-batch-size {micro_batch_size} x data-parallel size {dp} exceeds "
                        f"--global-batch-size {global_batch_size}; lower --micro-batch-size or raise "
                        "--global-batch-size")
    if global_batch_size % (micro_batch_size * dp):
        raise UserError(f"--global-batch-size {global_batch_size} must be divisible by --micro-batch-size "
                        f"{micro_batch_size} x data-parallel size {dp}")


def check_pipeline_split(num_layers: int, p: ParallelConfig, num_microbatches: int, mtp_num_layers: int = 0) -> int:
    """Number of model chunks per rank (virtual pipeline size) of the split the flags ask for."""
    pp = p.pipeline_model_parallel_size
    chunks = len(stage_layers_of(num_layers, p)) // pp
    placed = layout_mtp_layers(p.pipeline_model_parallel_layout)
    if placed and placed != mtp_num_layers:
        raise UserError(f"--pipeline-model-parallel-layout places {placed} multi-token prediction layers (m) but "
                        f"--mtp-num-layers is {mtp_num_layers or 'not given'}; make them agree")
    if chunks > 1 and num_microbatches % pp:
        raise UserError(f"interleaved pipelining needs the number of micro-batches ({num_microbatches}) to be a "
                        f"multiple of --pipeline-model-parallel-size {pp}; change --global-batch-size")
    return chunks


def check_zero_bubble(p: ParallelConfig, m: ModelConfig) -> None:
    """What the zero-bubble schedules (zb-h1, zbv) do not compose with."""
    schedule = p.pipeline_schedule
    if schedule not in ZERO_BUBBLE_SCHEDULES:
        return
    flag = f"--pipeline-schedule {schedule}"
    if p.pipeline_model_parallel_size < 2:
        raise UserError(f"{flag} needs --pipeline-model-parallel-size > 1")
    if p.use_torch_fsdp2:
        raise UserError(f"{flag} does not compose with --use-torch-fsdp2: FSDP2 reduces a layer's gradients when its "
                        "input gradient is done, before the deferred weight-gradient pass")
    if p.data_parallel_sharding_strategy == "optim_grads_params":
        raise UserError(f"{flag} does not compose with ZeRO-3 (--data-parallel-sharding-strategy optim_grads_params): "
                        "its weight-gradient pass runs after ZeRO-3 has freed the layer's gathered parameters; "
                        "use optim_grads")
    if m.recompute_granularity == "full":
        raise UserError(f"{flag} does not compose with --recompute-granularity full: the deferred weight-gradient "
                        "pass would recompute each layer's forward a second time; use selective or none")
    given = [name for name, value in (
        ("--num-layers-per-virtual-pipeline-stage", p.num_layers_per_virtual_pipeline_stage),
        ("--num-virtual-stages-per-pipeline-rank", p.num_virtual_stages_per_pipeline_rank)) if value is not None]
    if schedule == "zb-h1" and given:
        raise UserError(f"{flag} runs one model chunk per rank; drop {given[0]} (or use --pipeline-schedule zbv, "
                        "two chunks per rank)")
    if schedule == "zbv":
        _check_zbv(p, m, flag)


def _check_zbv(p: ParallelConfig, m: ModelConfig, flag: str) -> None:
    if p.num_layers_per_virtual_pipeline_stage is not None:
        raise UserError(f"{flag} places two chunks per rank itself; drop --num-layers-per-virtual-pipeline-stage")
    vpp = p.num_virtual_stages_per_pipeline_rank
    if vpp not in (None, 2):
        raise UserError(f"{flag} needs two chunks per rank, not --num-virtual-stages-per-pipeline-rank {vpp}")
    sharded = p.data_parallel_size > 1 and p.data_parallel_sharding_strategy != "no_shard"
    if sharded and not m.untie_embeddings_and_output_weights:
        raise UserError(f"{flag} keeps both copies of the tied embedding on rank 0 and sums their gradients there, "
                        "which gradients sharded over data-parallel ranks (--use-distributed-optimizer / ZeRO) do not "
                        "allow; add --untie-embeddings-and-output-weights")
    for name, value in (("--decoder-first-pipeline-num-layers", p.decoder_first_pipeline_num_layers),
                        ("--decoder-last-pipeline-num-layers", p.decoder_last_pipeline_num_layers)):
        if value is not None:
            raise UserError(f"{flag} puts the first and last virtual stages on rank 0; give per-stage layer "
                            f"counts with --pipeline-model-parallel-layout instead of {name}")


def check_async_schedule(config: MegaliteConfig) -> None:
    """What the asynchronous schedules (pipedream, pipedream-2bw) do not combine with."""
    par, t = config.parallel, config.training
    schedule = par.pipeline_schedule
    if schedule not in ASYNC_SCHEDULES:
        return
    flag = f"--pipeline-schedule {schedule}"
    if par.context_parallel_size > 1:
        raise UserError(f"{flag} does not support --context-parallel-size > 1 (not built: the ring attention's "
                        "per-step exchanges are not versioned); use --pipeline-schedule 1f1b")
    if par.num_layers_per_virtual_pipeline_stage or par.num_virtual_stages_per_pipeline_rank:
        raise UserError(f"{flag} runs one model chunk per rank: drop --num-layers-per-virtual-pipeline-stage / "
                        "--num-virtual-stages-per-pipeline-rank")
    if par.data_parallel_sharding_strategy == "optim_grads_params":
        raise UserError(f"{flag} keeps whole weight versions per stage, which ZeRO-3 "
                        "(--data-parallel-sharding-strategy optim_grads_params) never gathers; use optim or optim_grads")
    if par.overlap_param_gather:
        raise UserError(f"{flag} needs the updated weights in place right after the step to stash them: drop "
                        "--overlap-param-gather")
    if par.use_torch_fsdp2:
        raise UserError(f"{flag} does not support --use-torch-fsdp2 (one copy of the weights); drop it")
    if t.batch_size_schedule:
        raise UserError(f"{flag} needs a fixed number of micro-batches per step: drop --rampup-batch-size / "
                        "--step-batch-size-schedule")
    pp, m = par.pipeline_model_parallel_size, config.num_microbatches
    if schedule == "pipedream-2bw" and m < pp - 1:
        raise UserError(f"--pipeline-schedule pipedream-2bw needs at least pipeline size - 1 = {pp - 1} micro-batches "
                        f"per step (it has {m}): raise --global-batch-size")


# ---- data parallelism ----------------------------------------------------------------------------------
def _check_torch_fsdp2(p: ParallelConfig) -> None:
    """What PyTorch's FSDP2 backend (parallel/data/fsdp2.py) cannot combine with, one line each."""
    if p.data_parallel_sharding_strategy in ("no_shard", "optim"):
        raise UserError(f"--use-torch-fsdp2 always shards parameters, gradients and optimizer state, not "
                        f"--data-parallel-sharding-strategy {p.data_parallel_sharding_strategy}: use "
                        "optim_grads_params (ZeRO-3, the default) or optim_grads (no reshard after forward)")
    if p.ddp_bucket_size:
        raise UserError("--ddp-bucket-size does not apply to --use-torch-fsdp2, which reduces one transformer layer "
                        "at a time; drop it")
    if p.pipeline_schedule not in ("1f1b", "gpipe"):
        raise UserError(f"--use-torch-fsdp2 works with --pipeline-schedule 1f1b or gpipe, not "
                        f"{p.pipeline_schedule} (FSDP2 reduces a layer's gradients when its whole backward has "
                        "run and keeps one copy of the weights)")


def check_optimizer_instances(p: ParallelConfig, m: ModelConfig) -> None:
    """--num-distributed-optimizer-instances K (hybrid sharding): K replicas of a ZeRO shard group of
    DP x CP / K consecutive ranks, over megalite's own data parallelism. MoE experts split their own
    expert-data-parallel group the same way, so K must divide it too."""
    k = p.num_distributed_optimizer_instances
    if k == 1:
        return
    flag = f"--num-distributed-optimizer-instances {k}"
    if p.data_parallel_sharding_strategy == "no_shard":
        raise UserError(f"{flag} splits the sharded optimizer state into instances: add --use-distributed-optimizer "
                        "(or --data-parallel-sharding-strategy optim_grads/optim_grads_params), or drop it")
    if p.use_torch_fsdp2:
        raise UserError(f"{flag} applies to megalite's own ZeRO, not --use-torch-fsdp2; drop one of them")
    shards = p.data_parallel_size * p.context_parallel_size
    if shards % k:
        raise UserError(f"{flag} must divide the {shards} data-parallel x context-parallel ranks; choose a divisor")
    if m.num_experts and p.expert_data_parallel_size % k:
        raise UserError(f"{flag} must divide the {p.expert_data_parallel_size} expert-data-parallel ranks "
                        "(world / (expert TP x EP x PP)) too; choose a divisor of both")


def _check_data_parallel(p: ParallelConfig) -> None:
    if p.overlap_param_gather and p.data_parallel_sharding_strategy == "no_shard":
        raise UserError("--overlap-param-gather needs --use-distributed-optimizer (or --data-parallel-sharding-strategy "
                        "optim/optim_grads/optim_grads_params): without sharding there is no parameter all-gather")


# ---- optimizer, data, checkpoints, logging -------------------------------------------------------------
def _check_learning_rate(o: OptimizerConfig) -> None:
    if o.lr <= 0:
        raise UserError(f"--lr must be > 0, got {o.lr}")
    if o.decoupled_min_lr is not None and o.decoupled_lr is None:
        raise UserError("--decoupled-min-lr needs --decoupled-lr (the embedding and output layer's peak learning rate)")
    if o.min_lr < 0 or o.min_lr > o.lr:
        raise UserError(f"--min-lr {o.min_lr} must be in [0, --lr {o.lr}]")
    if o.lr_decay_style == "WSD" and o.lr_wsd_decay_iters is None:
        raise UserError("--lr-decay-style WSD needs --lr-wsd-decay-iters N (or --lr-wsd-decay-samples N)")
    if o.lr_wsd_decay_iters is not None and o.lr_wsd_decay_iters > o.lr_decay_iters:
        raise UserError(f"--lr-wsd-decay-iters ({o.lr_wsd_decay_iters:g}) exceeds the decay length "
                        f"({o.lr_decay_iters:g} iterations)")
    if o.fp16 and o.loss_scale is not None and o.loss_scale <= 0:
        raise UserError(f"--loss-scale must be > 0, got {o.loss_scale}")
    for flag, beta in (("--adam-beta1", o.adam_beta1), ("--adam-beta2", o.adam_beta2)):
        if not 0.0 <= beta < 1.0:
            raise UserError(f"{flag} must be in [0, 1), got {beta}")


def _check_data(d: DataConfig) -> None:
    has_paths = bool(d.data_path or d.train_data_path)
    if d.mock_data and has_paths:
        raise UserError("--mock-data and --data-path/--train-data-path are exclusive; give one")
    if not d.mock_data and not has_paths:
        raise UserError("no training data: give --data-path PREFIX (made by tools/preprocess_data.py) or --mock-data")
    if d.data_path and d.train_data_path:
        raise UserError("--data-path and --train-data-path are exclusive; give one")
    if d.tokenizer_type is None:
        raise UserError("--tokenizer-type is required (GPT2BPETokenizer, SentencePieceTokenizer, "
                        "HuggingFaceTokenizer or NullTokenizer)")
    if d.vocab_size is not None and d.tokenizer_type != "NullTokenizer":
        raise UserError(f"--vocab-size only applies to --tokenizer-type NullTokenizer (the {d.tokenizer_type} "
                        "vocabulary comes from its files); remove it")
    parts = [x.strip() for x in d.split.replace("/", ",").split(",")]
    try:
        weights = [float(x) for x in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise UserError(f'--split {d.split!r} must be up to 3 non-negative weights like "969,30,1"')


def _check_checkpointing(t: TrainingConfig) -> None:
    if t.save_interval is not None and not t.save:
        raise UserError("--save-interval needs --save DIR (where to write the checkpoints)")
    if t.async_save and not t.save:
        raise UserError("--async-save needs --save DIR (where to write the checkpoints)")
    if t.non_persistent_save_interval is not None and t.non_persistent_ckpt_type is None:
        raise UserError("--non-persistent-save-interval needs --non-persistent-ckpt-type global or local")
    if t.non_persistent_ckpt_type == "local" and not t.non_persistent_local_ckpt_dir:
        raise UserError("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir DIR (a node-local "
                        "directory)")
    if t.non_persistent_ckpt_type is not None and not t.save:
        raise UserError("--non-persistent-ckpt-type needs --save DIR (the persistent checkpoints)")
    if t.finetune and not t.load:       # --no-load-optim / --no-load-rng alone only get a note (megatron_cli.py)
        raise UserError("--finetune needs --load DIR (the checkpoint to start from)")


def _check_logging(t: TrainingConfig) -> None:
    if t.profile and t.profile_step_end <= t.profile_step_start:
        raise UserError(f"--profile-step-end {t.profile_step_end} must be after --profile-step-start "
                        f"{t.profile_step_start}")
    if t.manual_gc_interval and not t.manual_gc:
        raise UserError("--manual-gc-interval needs --manual-gc (without it Python collects on its own schedule)")


# ---- the file system -----------------------------------------------------------------------------------
def check_paths(t: TrainingConfig) -> None:
    """Folders the run will write (checkpoints, logs, metrics) can be written, known before any time is
    spent: a path through an existing file, or below a folder we may not write, is refused. Nothing is
    created here."""
    for flag, path in (("--save", t.save), ("--tensorboard-dir", t.tensorboard_dir),
                       ("--wandb-save-dir", t.wandb_save_dir), ("--metrics-file", t.metrics_file),
                       ("--non-persistent-global-ckpt-dir", t.non_persistent_global_ckpt_dir),
                       ("--non-persistent-local-ckpt-dir", t.non_persistent_local_ckpt_dir)):
        if not path:
            continue
        if flag == "--metrics-file":
            if os.path.isdir(path):
                raise UserError(f"--metrics-file {path} is a folder; give a file name (e.g. {path}/metrics.jsonl)")
            path_folder = os.path.dirname(os.path.abspath(path))
        else:
            path_folder = os.path.abspath(path)
        existing = path_folder
        while not os.path.exists(existing) and os.path.dirname(existing) != existing:
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise UserError(f"{flag} {path}: cannot write there ({existing} is a file, not a folder); choose "
                            "another path")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise UserError(f"{flag} {path}: cannot write there (no write permission in {existing}); choose a "
                            "writable path")
