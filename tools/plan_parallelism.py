#!/usr/bin/env python
"""Plan a parallel layout: the fastest TP x PP x DP layouts that fit in device memory, with the
pretrain_gpt.py flags to run them.

It reads pretrain_gpt.py's own command line (the same parser), so a training command pastes in as it
is, with the planner's flags added:

    # a pretrain_gpt.py command (Llama-3 8B): the flags that shape memory and time are read, the rest
    # (learning rate, data, checkpointing, logging) ignored
    python tools/plan_parallelism.py --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 \
        --num-attention-heads 32 --group-query-attention --num-query-groups 8 --seq-length 8192 \
        --max-position-embeddings 8192 --position-embedding-type rope --rotary-base 500000 \
        --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights \
        --global-batch-size 128 --train-iters 1000 --lr 3e-4 --bf16 --tokenizer-type NullTokenizer \
        --vocab-size 128256 --mock-data --num-gpus 64 --gpu-memory-gb 80
    # a Hugging Face config (Llama / Mistral / Qwen2/3 / Phi-3 / GPT-2 / Mixtral /
    # Qwen2-MoE / Qwen3-MoE config.json, or a model directory) in place of the model flags
    python tools/plan_parallelism.py --hf-config llama-3-8b/config.json --num-gpus 8 --gpu-memory-gb 80 \
        --seq-length 8192 --global-batch-size 128
    # a Mixture of Experts (Mixtral 8x7B's shape): the search adds expert parallelism (EP) and ETP
    python tools/plan_parallelism.py --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 \
        --num-attention-heads 32 --group-query-attention --num-query-groups 8 --swiglu \
        --untie-embeddings-and-output-weights --position-embedding-type rope --normalization RMSNorm \
        --disable-bias-linear --vocab-size 32000 --num-experts 8 --moe-router-topk 2 \
        --moe-token-dispatcher-type alltoall --num-gpus 64 --gpu-memory-gb 80 --seq-length 4096 \
        --global-batch-size 512
    # evaluate one layout: pin any of --tensor-model-parallel-size, --pipeline-model-parallel-size,
    # --num-layers-per-virtual-pipeline-stage, --micro-batch-size, --recompute-granularity,
    # --data-parallel-sharding-strategy / --use-distributed-optimizer, --expert-model-parallel-size,
    # --expert-tensor-parallel-size, --num-distributed-optimizer-instances

The parallel flags of a pasted command (PINS below, --micro-batch-size among them) pin that part of
the layout; leave them out to search it. The vocabulary is the tokenizer's, as pretrain_gpt.py builds it
(NullTokenizer: --vocab-size plus its end-of-document id); without --tokenizer-type, --vocab-size is it.
K is --num-distributed-optimizer-instances (hybrid sharding: ZeRO within DP/K ranks, all-reduce across K).
It tries every layout megalite accepts (TP within a node with sequence parallelism, PP dividing the
layers, interleaved virtual stages, DP the rest, every micro-batch size, recomputation none /
selective / full, ZeRO sharding no_shard / optim / optim_grads / optim_grads_params; for an MoE model EP
dividing the experts and ETP 1 or TP), estimates the
memory of the fullest device and the step time (megalite/planning/memory.py and time.py explain them), drops what does
not fit in --usable-memory-fraction of --gpu-memory-gb, and prints the fastest --top layouts.
GB means 2^30 bytes. Defaults describe H100 SXM nodes: 8 GPUs, 989 dense bf16 TFLOP/s (67 fp32),
NVLink 360 GB/s and InfiniBand 40 GB/s achieved per GPU. Precision defaults to --bf16 (--fp16, --fp32).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.checkpoint.hf_config import read_hf_config_file  # noqa: E402
from megalite.config.pipeline_split import SplitFlags  # noqa: E402
from megalite.data.builder import parse_data_path  # noqa: E402
from megalite.planning import flags as plan_flags  # noqa: E402
from megalite.planning import inputs, search, verify  # noqa: E402
from megalite.planning.attention import corpus_document_lengths, model_attended_fraction  # noqa: E402
from megalite.config import megatron_cli  # noqa: E402
from megalite.config.cli import OneLineArgumentParser, one_line_errors, positive_float, positive_int  # noqa: E402
from megalite.config import validate as checks  # noqa: E402
from megalite.config.fields import FLAG  # noqa: E402
from megalite.config.schema import ModelConfig  # noqa: E402
from megalite.errors import UserError  # noqa: E402

MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")
# pretrain_gpt.py's flags that pin part of the layout; absent, the search chooses (pretrain_gpt.py's
# defaults do not apply)
PINS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
        "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank", "micro_batch_size",
        "recompute_granularity", "data_parallel_sharding_strategy", "pipeline_schedule", "expert_model_parallel_size",
        "expert_tensor_parallel_size", "num_distributed_optimizer_instances")
# the model's fields that are the layout's (recomputation) rather than the architecture's
LAYOUT_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers")


def build_parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's parser (every flag it takes, one home), with the planner's own flags added."""
    p = OneLineArgumentParser(prog="tools/plan_parallelism.py", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
                              parents=[megatron_cli.build_parser()], conflict_handler="resolve")
    p.set_defaults(**dict.fromkeys(PINS))
    g = p.add_argument_group("the planner's own flags")
    g.add_argument("--hf-config", help="config.json of a model whose family checkpoint/hf_config.py converts "
                   "(Llama, Mixtral, Qwen2-MoE, ...), or its directory: the model in place of the model flags, "
                   "which when given override the config's")
    g.add_argument("--fp32", action="store_true", help="plan fp32 training (default --bf16)")
    g.add_argument("--recompute-granularity", choices=["none", "selective", "full"],
                   help="pin the recomputation (none: no recomputation); searched when absent")
    g.add_argument("--moe-imbalance-margin", type=positive_float, default=inputs.MOE_IMBALANCE_MARGIN,
                   help="dropless routing: the busiest expert rank's rows over the mean, for its dispatched rows, "
                        f"expert activations and expert compute (default {inputs.MOE_IMBALANCE_MARGIN}: the "
                        "headroom capacity-factor recipes leave a balanced router)")
    g.add_argument("--document-length", type=positive_int, help=(
        "with --reset-attention-mask: the corpus's mean document length in tokens, for the attention FLOPs "
        "of document masks (default: the length histogram of --data-path's corpus)"))
    g.add_argument("--top", type=positive_int, default=5, help="how many layouts to print (default 5)")
    g.add_argument("--verify", action="store_true", help=(
        "run pretrain_gpt.py's dry run (--fake-process-group --no-storage) for one rank of each distinct role of "
        "every printed layout, and print its measured memory beside the estimate"))

    g = p.add_argument_group("hardware (defaults: H100 SXM)")
    g.add_argument("--num-gpus", type=positive_int, required=True, help="the world the layouts fill")
    g.add_argument("--gpu-memory-gb", type=positive_float, required=True)
    g.add_argument("--gpus-per-node", type=positive_int, help="default min(8, --num-gpus)")
    g.add_argument("--peak-tflops", type=positive_float, help="dense TFLOP/s per GPU; default 989 (bf16/fp16), 67 (fp32)")
    g.add_argument("--compute-efficiency", type=positive_float, default=0.55,
                   help="share of peak the compute reaches, communication and bubble aside (default 0.55)")
    g.add_argument("--intra-node-bandwidth", type=positive_float, default=360.0, help="GB/s per GPU, NVLink (default 360)")
    g.add_argument("--inter-node-bandwidth", type=positive_float, default=40.0, help="GB/s per GPU, InfiniBand (default 40)")
    g.add_argument("--usable-memory-fraction", type=positive_float, default=0.9,
                   help="of --gpu-memory-gb, the rest for the CUDA context, NCCL and fragmentation (default 0.9)")
    return p


# ---- flags -> planner inputs ------------------------------------------------------------------------
def flag_name(dest: str) -> str:
    return f"--{dest.replace('_', '-')}"


def given(args, names) -> dict:
    """Those of ``names`` whose flag the command line sets away from its default."""
    parser = build_parser()
    return {name: vars(args)[name] for name in names if vars(args)[name] != parser.get_default(name)}


def model_config(args):
    if args.hf_config:
        model = hf_model(args)
    else:
        tokenizer = megatron_cli.data_config(args).tokenizer_type
        missing = [flag_name(name) for name in MODEL_FLAGS
                   if vars(args)[name] is None and not (name == "vocab_size" and tokenizer)]
        if missing:
            raise UserError(f"give --hf-config PATH or the model flags; missing {', '.join(missing)}")
        model = plan_flags.model_from_args(args, vocabulary(args))
    moe = given(args, [f.name for f in dataclasses.fields(ModelConfig) if f.name.startswith("moe_")])
    if moe and not model.num_experts:
        raise UserError(f"{flag_name(next(iter(moe)))} applies to MoE layers; add --num-experts N")
    return model


def hf_model(args):
    """The model of --hf-config, trained at --seq-length, with the model flags given over the config's."""
    exclusive = [flag_name(name) for name in MODEL_FLAGS if vars(args)[name] is not None]
    if exclusive:
        raise UserError(f"--hf-config and {exclusive[0]} are exclusive: the model comes from the config; "
                        "remove the model flags")
    model = plan_flags.model_from_hf_config(read_hf_config_file(args.hf_config), args.seq_length)
    architecture = [f.name for f in dataclasses.fields(ModelConfig) if FLAG in f.metadata and f.name not in LAYOUT_FIELDS]
    model = dataclasses.replace(model, **given(args, architecture))
    checks.check_moe(model)
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(model, name) < 1.0:
            raise UserError(f"{flag_name(name)} must be in [0, 1), got {getattr(model, name)}")
    if not model.use_rope and args.seq_length > model.max_position_embeddings:
        raise UserError(f"--seq-length {args.seq_length} exceeds the model's {model.max_position_embeddings} learned "
                        "positions; shorten --seq-length")
    return model


def vocabulary(args) -> int:
    """The tokenizer's vocabulary as pretrain_gpt.py gets it: the tokenizer the flags name, built; without
    --tokenizer-type (nor GPT-2's --vocab-file and --merge-file), --vocab-size."""
    data = megatron_cli.data_config(args)
    if data.tokenizer_type is None:
        return args.vocab_size
    from megalite.data.tokenizers import build_tokenizer
    try:
        return build_tokenizer(data).vocab_size
    except UserError as e:
        raise UserError(f"{e}; or plan without the tokenizer: drop --tokenizer-type and give its vocabulary as "
                        "--vocab-size N") from None


def precision(args) -> str:
    chosen = [name for name in ("bf16", "fp16", "fp32") if vars(args)[name]]
    if len(chosen) > 1:
        raise UserError(f"--{chosen[0]} and --{chosen[1]} are exclusive; pick one")
    return chosen[0] if chosen else "bf16"


def required(args) -> None:
    """The planner's required flags that pretrain_gpt.py's parser leaves optional."""
    missing = [flag_name(name) for name in ("seq_length", "global_batch_size") if vars(args)[name] is None]
    if missing:
        raise UserError(f"the planner requires {' and '.join(missing)}: it plans one sequence length and batch")


def planner_inputs(args):
    required(args)
    if args.moe_imbalance_margin < 1:
        raise UserError(f"--moe-imbalance-margin is the busiest rank's rows over the mean, at least 1; got "
                        f"{args.moe_imbalance_margin}")
    model = model_config(args)
    sizes = args.hierarchical_context_parallel_sizes
    workload = inputs.Workload(model, args.global_batch_size, precision(args), args.make_vocab_size_divisible_by,
                               args.moe_imbalance_margin, model_attended_fraction(model, document_lengths(args)),
                               tuple(args.cp_comm_type), sizes[0] if sizes else None, args.optimizer,
                               plan_flags.muon_settings(args), args.fp8_param_gather)
    for flag in ("usable_memory_fraction", "compute_efficiency"):
        if vars(args)[flag] > 1:
            raise UserError(f"--{flag.replace('_', '-')} is a fraction in (0, 1], got {vars(args)[flag]}")
    hardware = inputs.Hardware(
        args.num_gpus, args.gpu_memory_gb, args.gpus_per_node or min(8, args.num_gpus), args.peak_tflops,
        args.compute_efficiency, args.intra_node_bandwidth, args.inter_node_bandwidth, args.usable_memory_fraction)
    if args.use_distributed_optimizer and args.data_parallel_sharding_strategy not in (None, "optim"):
        raise UserError(f"--use-distributed-optimizer is --data-parallel-sharding-strategy optim, not "
                        f"{args.data_parallel_sharding_strategy}; drop one of them")
    split = SplitFlags(first=args.decoder_first_pipeline_num_layers, last=args.decoder_last_pipeline_num_layers,
                       account_for_embedding=args.account_for_embedding_in_pipeline_split,
                       account_for_loss=args.account_for_loss_in_pipeline_split,
                       layout=args.pipeline_model_parallel_layout)
    pinned_split = split != SplitFlags()
    if pinned_split and args.pipeline_model_parallel_size is None:
        raise UserError(f"{split.given()[0]} needs --pipeline-model-parallel-size: the split is for one pipeline size")
    if pinned_split and args.num_layers_per_virtual_pipeline_stage is not None:
        raise UserError("with an uneven split give the virtual stages as --num-virtual-stages-per-pipeline-rank")
    pins = search.Pins(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                         args.num_layers_per_virtual_pipeline_stage, args.micro_batch_size, args.recompute_granularity,
                         "optim" if args.use_distributed_optimizer else args.data_parallel_sharding_strategy,
                         args.context_parallel_size, args.pipeline_schedule, args.num_virtual_stages_per_pipeline_rank,
                         split if pinned_split else None, args.expert_model_parallel_size,
                         args.expert_tensor_parallel_size, args.num_distributed_optimizer_instances)
    return workload, hardware, pins


def document_lengths(args):
    """The document lengths that --reset-attention-mask masks by: --document-length's, else the length
    histogram of the first documents of each --data-path corpus; None without document masks."""
    if not args.reset_attention_mask:
        return None
    if args.document_length:
        return [args.document_length] * (64 * args.seq_length // args.document_length + 1)   # 64 samples
    prefixes, _ = parse_data_path(args.data_path)
    if not prefixes:
        raise UserError("--reset-attention-mask: the planner counts the attended pairs from the corpus's document "
                        "lengths; give --data-path, or --document-length N (the mean document length)")
    return np.concatenate([corpus_document_lengths(p) for p in prefixes])


# ---- output ----------------------------------------------------------------------------------------
def describe_model(workload) -> str:
    m = workload.model
    attention = f"{m.num_attention_heads} heads" + (f" / {m.num_query_groups} KV groups"
                                                     if m.num_query_groups != m.num_attention_heads else "")
    mlp = f"SwiGLU {m.ffn_hidden_size}" if m.swiglu else f"MLP {m.ffn_hidden_size}"
    if m.num_experts:
        moe_layers = sum(m.is_moe_layer(n) for n in range(1, m.num_layers + 1))
        shared = f" + shared {m.moe_shared_expert_intermediate_size}" if m.moe_shared_expert_intermediate_size else ""
        mlp = (f"{mlp}; MoE in {moe_layers} layers: {m.num_experts} experts of {m.expert_ffn_hidden_size}, "
               f"top-{m.moe_router_topk}{shared}, {m.moe_token_dispatcher_type} dispatch")
    return (f"{inputs.count_parameters(workload) / 1e9:.2f}B parameters: {m.num_layers} layers, hidden {m.hidden_size}, "
            f"{attention}, {mlp}, vocabulary {m.vocab_size}"
            + ("" if m.untie_embeddings_and_output_weights else " (tied)"))


def format_table(estimates, workload, hardware) -> list[str]:
    GiB = inputs.GiB
    header = (f"{'#':>3} {'TP':>3} {'CP':>3} {'PP':>3} {'VPP':>3} {'DP':>4} {'K':>2} {'EP':>3} {'ETP':>3} {'MBS':>3} {'m':>4}  "
              f"{'schedule':13} "
              f"{'split':17} {'recompute':9}  {'sharding':18} "
              f"{'weights':>7} {'grads':>6} {'optim':>6} {'activ':>6} {'total':>6} GB  {'step s':>7} {'MFU':>4} "
              f"{'bubble':>6} {'imbal':>6} {'comm s':>6}")
    lines = [header]
    for i, e in enumerate(estimates, 1):
        lay, mem, t = e.layout, e.memory, e.time
        m = lay.num_microbatches(workload.global_batch_size)
        comm = t.communication
        lines.append(
            f"{i:>3} {lay.tp:>3} {lay.cp:>3} {lay.pp:>3} {lay.vpp if lay.vpp > 1 else '-':>3} {lay.dp:>4} {lay.instances:>2} "
            f"{lay.ep:>3} {lay.expert_tp:>3} {lay.micro_batch_size:>3} {m:>4}  {lay.schedule:13} "
            f"{inputs.split_name(lay.split)[:17]:17} "
            f"{lay.recompute:9}  {lay.sharding:18} {mem.weights / GiB:7.1f} {mem.grads / GiB:6.1f} "
            f"{mem.optimizer / GiB:6.1f} {mem.activations / GiB:6.1f} {mem.total / GiB:6.1f}     {t.total:7.2f} "
            f"{100 * e.mfu(workload, hardware):3.0f}% {100 * t.bubble / t.total:5.1f}% "
            f"{100 * t.imbalance / t.total:5.1f}% {comm:6.2f}")
    return lines


def plan(args):
    """(workload, hardware, the fastest --top layouts' estimates)."""
    workload, hardware, pins = planner_inputs(args)
    try:
        return workload, hardware, search.plan(workload, hardware, pins, top=args.top)
    except UserError as e:
        if args.verify:
            raise UserError(f"--verify dry-runs the layouts the planner accepts, and it accepts none: {e}") from None
        raise


def describe(workload, hardware, estimates) -> list[str]:
    lines = [f"model: {describe_model(workload)}",
             f"training: seq {workload.model.seq_length}, global batch {workload.global_batch_size}, {workload.precision}; "
             f"{hardware.num_gpus} x {hardware.gpu_memory_gb:g} GB ({hardware.gpus_per_node} per node, "
             f"{hardware.usable_bytes / inputs.GiB:.1f} GB usable)",
             "memory of the fullest device (GB = 2^30 bytes); step time = compute + bubble + exposed communication", ""]
    lines += format_table(estimates, workload, hardware)
    lines += ["", "pretrain_gpt.py flags:"]
    for i, e in enumerate(estimates, 1):
        lines.append(f"  #{i}: {' '.join(plan_flags.pretrain_flags(workload, e.layout))}")
    return lines


def verify_layouts(workload, hardware, estimates) -> int:
    """--verify: each printed layout's roles dry-run beside the estimate; 1 when an estimate is off."""
    off = 0
    for i, e in enumerate(estimates, 1):
        print(f"\nlayout #{i} verified by dry runs (peak memory per role, GB = 2^30 bytes):", flush=True)
        checks = verify.verify(workload, e.layout, log=lambda line: print(line, flush=True))
        print("\n".join(verify.format_checks(checks, hardware.usable_bytes)), flush=True)
        off += sum(c.off for c in checks)
    if off:
        print(f"\n{off} role(s) where the estimate is off by more than {100 * verify.TOLERANCE:.0f}% of the dry run",
              flush=True)
    return 1 if off else 0


@one_line_errors
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    planned = plan(args)
    print("\n".join(describe(*planned)), flush=True)
    return verify_layouts(*planned) if args.verify else 0


if __name__ == "__main__":
    sys.exit(main())
