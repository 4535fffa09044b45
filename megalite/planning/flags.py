"""The planner and pretrain_gpt.py's flags, both ways: the flags that run a layout, the layout a parsed
command line runs, and a ModelConfig from pretrain_gpt.py's own flags (its parser and rules, the one
home of every flag) or from a Hugging Face config."""
from __future__ import annotations

import argparse
import dataclasses

from megalite.checkpoint.hf_config import dropout_fields, model_fields
from megalite.config import megatron_cli
from megalite.config import validate as rules
from megalite.config.muon_fields import MuonFields
from megalite.config.schema import MegaliteConfig, ModelConfig, ParallelConfig
from megalite.config.pipeline_split import SplitFlags, virtual_stage_layers
from megalite.planning.inputs import Layout, Workload


def parallel_config(workload: Workload, layout: Layout) -> ParallelConfig:
    """The ParallelConfig pretrain_gpt.py builds for ``layout`` (for megalite's own checks)."""
    split = split_flags(workload, layout)
    return ParallelConfig(
        world_size=layout.num_gpus, tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp, num_layers_per_virtual_pipeline_stage=split.layers_per_virtual_stage,
        num_virtual_stages_per_pipeline_rank=split.virtual_stages_per_rank,
        decoder_first_pipeline_num_layers=split.first, decoder_last_pipeline_num_layers=split.last,
        account_for_embedding_in_pipeline_split=split.account_for_embedding,
        account_for_loss_in_pipeline_split=split.account_for_loss, pipeline_model_parallel_layout=split.layout,
        sequence_parallel=layout.sp, pipeline_schedule=layout.schedule,
        use_distributed_optimizer=layout.sharding != "no_shard", data_parallel_sharding_strategy=layout.sharding,
        use_layer_wise_distributed_optimizer=workload.optimizer == "muon" and layout.sharding != "no_shard",
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
        num_distributed_optimizer_instances=layout.instances)


def split_flags(workload: Workload, layout: Layout) -> SplitFlags:
    """The split flags pretrain_gpt.py gets for ``layout`` (virtual stages named the way Megatron wants:
    --num-virtual-stages-per-pipeline-rank with first/last counts, else --num-layers-per-virtual-pipeline-stage)."""
    split = layout.split
    if layout.vpp == 1 or split.layout or layout.schedule == "zbv":
        return split
    if split.first is not None or split.last is not None:
        return dataclasses.replace(split, virtual_stages_per_rank=layout.vpp)
    extra = int(split.account_for_embedding) + int(split.account_for_loss)
    return dataclasses.replace(split, layers_per_virtual_stage=(workload.model.num_layers + extra) // (layout.pp * layout.vpp))


def pretrain_flags(workload: Workload, layout: Layout) -> list[str]:
    """pretrain_gpt.py flags that run ``layout``."""
    flags = ["--tensor-model-parallel-size", str(layout.tp)]
    if layout.sp:
        flags.append("--sequence-parallel")
    flags += ["--pipeline-model-parallel-size", str(layout.pp)]
    split = split_flags(workload, layout)
    for flag, value in (("--num-layers-per-virtual-pipeline-stage", split.layers_per_virtual_stage),
                        ("--num-virtual-stages-per-pipeline-rank", split.virtual_stages_per_rank),
                        ("--decoder-first-pipeline-num-layers", split.first),
                        ("--decoder-last-pipeline-num-layers", split.last),
                        ("--pipeline-model-parallel-layout", split.layout)):
        if value is not None:
            flags += [flag, str(value)]
    flags += [flag for flag, on in (("--account-for-embedding-in-pipeline-split", split.account_for_embedding),
                                    ("--account-for-loss-in-pipeline-split", split.account_for_loss)) if on]
    if layout.schedule != "1f1b":
        flags += ["--pipeline-schedule", layout.schedule]
    if layout.cp > 1:
        flags += ["--context-parallel-size", str(layout.cp)]
    if layout.ep > 1:
        flags += ["--expert-model-parallel-size", str(layout.ep)]
    if layout.etp is not None:
        flags += ["--expert-tensor-parallel-size", str(layout.etp)]
    flags += ["--micro-batch-size", str(layout.micro_batch_size), "--global-batch-size", str(workload.global_batch_size)]
    if layout.recompute == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif layout.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    if layout.sharding == "optim":
        flags.append("--use-distributed-optimizer")
    elif layout.sharding != "no_shard":
        flags += ["--data-parallel-sharding-strategy", layout.sharding]
    if layout.instances > 1:
        flags += ["--num-distributed-optimizer-instances", str(layout.instances)]
    if layout.shards > 1 and layout.overlap_grad_reduce:
        flags.append("--overlap-grad-reduce")
    if layout.shards > 1 and layout.sharding != "no_shard" and layout.overlap_param_gather:
        flags.append("--overlap-param-gather")
    if workload.fp8_param_gather:
        flags.append("--fp8-param-gather")
    if workload.precision != "fp32":
        flags.append(f"--{workload.precision}")
    if workload.optimizer != "adam":
        flags += ["--optimizer", workload.optimizer]
    return flags


def model_from_args(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    """The ModelConfig pretrain_gpt.py builds from its parsed flags ``args`` (megatron_cli.model_config,
    checked by the same rules), with the tokenizer's ``vocab_size`` unpadded. Recomputation is the
    layout's, so the model carries none."""
    model = dataclasses.replace(megatron_cli.model_config(args), vocab_size=vocab_size, padded_vocab_size=vocab_size,
                                recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    rules.check_model(model)
    rules.check_moe(model)
    return model


def model_from_flags(num_layers: int, hidden_size: int, num_attention_heads: int, vocab_size: int,
                     seq_length: int, **flags) -> ModelConfig:
    """model_from_args for model flags given by their config field names, every other flag at
    pretrain_gpt.py's default (``num_query_groups`` implies --group-query-attention)."""
    args = megatron_cli.build_parser().parse_args([])
    vars(args).update(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                      seq_length=seq_length, group_query_attention=flags.get("num_query_groups") is not None, **flags)
    return model_from_args(args, vocab_size)


def workload_and_layout(config: MegaliteConfig) -> tuple[Workload, Layout]:
    """The planner's view of a parsed pretrain_gpt.py command line (train/command_line.py: parse_args)."""
    opt, par, train = config.optimizer, config.parallel, config.training
    precision = "bf16" if opt.bf16 else "fp16" if opt.fp16 else "fp32"
    split = SplitFlags.of(par)
    chunks = len(virtual_stage_layers(config.model.num_layers, par.pipeline_model_parallel_size, split)) \
        // par.pipeline_model_parallel_size
    split = dataclasses.replace(split, layers_per_virtual_stage=None,          # (the layout's vpp says it)
                                virtual_stages_per_rank=None)
    # megatron_cli.py has padded the vocabulary for this TP size already: keep it as it is (pad to 1)
    model = dataclasses.replace(config.model, vocab_size=config.model.padded_vocab_size)
    workload = Workload(model, train.global_batch_size, precision, make_vocab_size_divisible_by=1,
                        optimizer=opt.optimizer, muon=opt, fp8_param_gather=par.fp8_param_gather)
    sharding, dp = par.data_parallel_sharding_strategy, par.data_parallel_size
    etp = par.expert_tensor_parallel_size
    layout = Layout(par.tensor_model_parallel_size, par.pipeline_model_parallel_size, dp, chunks,
                    train.micro_batch_size, config.model.recompute_granularity or "none", sharding,
                    sequence_parallel=par.sequence_parallel or par.tensor_model_parallel_size == 1,   # (moot at TP=1)
                    overlap_grad_reduce=par.overlap_grad_reduce or dp * par.context_parallel_size == 1,  # (moot)
                    overlap_param_gather=par.overlap_param_gather or dp * par.context_parallel_size == 1
                    or sharding == "no_shard",
                    cp=par.context_parallel_size, schedule=par.pipeline_schedule, split=split,
                    ep=par.expert_model_parallel_size, etp=None if etp == par.tensor_model_parallel_size else etp,
                    instances=par.num_distributed_optimizer_instances)
    return workload, layout


def muon_settings(args: argparse.Namespace) -> MuonFields:
    """The --muon-* settings of parsed pretrain_gpt.py flags ``args``."""
    return MuonFields(**{f.name: vars(args)[f.name] for f in dataclasses.fields(MuonFields)})


def model_from_hf_config(config, seq_length: int) -> ModelConfig:
    """A ModelConfig from a Hugging Face config (checkpoint/hf_config.py's mapping, every family it
    converts), trained at ``seq_length``, with the model's own dropout; the vocabulary unpadded."""
    fields = model_fields(config)
    return ModelConfig(**{**fields, "seq_length": seq_length, "padded_vocab_size": fields["vocab_size"],
                          **dropout_fields(config)})
