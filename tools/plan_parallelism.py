#!/usr/bin/env python
"""Plan a parallel layout: the fastest TP x PP x DP layouts that fit in device memory, with the
pretrain_gpt.py flags to run them.

    # a Hugging Face config (Llama / Mistral / Qwen2/3 / Phi-3 / GPT-2 / Mixtral /
    # Qwen2-MoE / Qwen3-MoE config.json, or a model directory)
    python tools/plan_parallelism.py --hf-config llama-3-8b/config.json --num-gpus 8 --gpu-memory-gb 80 \\
        --seq-length 8192 --global-batch-size 128
    # or Megatron's model flags
    python tools/plan_parallelism.py --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 \\
        --num-attention-heads 64 --group-query-attention --num-query-groups 8 --swiglu \\
        --untie-embeddings-and-output-weights --position-embedding-type rope --normalization RMSNorm \\
        --disable-bias-linear --vocab-size 128256 --num-gpus 64 --gpu-memory-gb 80 --seq-length 4096 \\
        --global-batch-size 1024 --top 3
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.checkpoint.hf_config import read_hf_config_file  # noqa: E402
from megalite.config.pipeline_split import SplitFlags  # noqa: E402
from megalite.planning import flags as plan_flags  # noqa: E402
from megalite.planning import inputs, search, verify  # noqa: E402
from megalite.config.cli import OneLineArgumentParser, moe_layer_pattern, positive_float, positive_int  # noqa: E402
from megalite.config import validate as checks  # noqa: E402
from megalite.config.schema import PIPELINE_SCHEDULES, SHARDING_STRATEGIES  # noqa: E402
from megalite.errors import UserError  # noqa: E402

MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="tools/plan_parallelism.py", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    g = p.add_argument_group("model: a Hugging Face config, or Megatron's model flags")
    g.add_argument("--hf-config", help="config.json of a model whose family checkpoint/hf_config.py converts "
                   "(Llama, Mixtral, Qwen2-MoE, ...), or its directory")
    g.add_argument("--num-layers", type=positive_int)
    g.add_argument("--hidden-size", type=positive_int)
    g.add_argument("--ffn-hidden-size", type=positive_int, help="default 4*hidden, or Megatron's 2/3 rule with --swiglu")
    g.add_argument("--num-attention-heads", type=positive_int)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=positive_int)
    g.add_argument("--kv-channels", type=positive_int)
    g.add_argument("--max-position-embeddings", type=positive_int)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--vocab-size", type=positive_int, help="the tokenizer's vocabulary")
    g.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128)
    g.add_argument("--hidden-dropout", type=float, help="default 0.1 (pretrain_gpt.py), or the HF config's")
    g.add_argument("--attention-dropout", type=float, help="default 0.1 (pretrain_gpt.py), or the HF config's")

    g = p.add_argument_group("Mixture of Experts (pretrain_gpt.py's flags; absent --num-experts: a dense model)")
    g.add_argument("--num-experts", type=positive_int)
    g.add_argument("--moe-router-topk", type=positive_int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=positive_int, help="each expert's hidden size (default --ffn-hidden-size)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=positive_int)
    g.add_argument("--moe-shared-expert-gate", action="store_true")
    g.add_argument("--moe-layer-freq", type=moe_layer_pattern, default=1,
                   help='every N-th layer is MoE, or a 0/1 list such as "([0]*3+[1]*29)" (default 1: all)')
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default="allgather")
    g.add_argument("--moe-expert-capacity-factor", type=positive_float,
                   help="drop beyond this multiple of the mean rows per expert (default: dropless)")
    g.add_argument("--moe-z-loss-coeff", type=positive_float)
    g.add_argument("--moe-imbalance-margin", type=positive_float, default=inputs.MOE_IMBALANCE_MARGIN,
                   help="dropless routing: the busiest expert rank's rows over the mean, for its dispatched rows, "
                        f"expert activations and expert compute (default {inputs.MOE_IMBALANCE_MARGIN}: the "
                        "headroom capacity-factor recipes leave a balanced router)")

    g = p.add_argument_group("training")
    g.add_argument("--seq-length", type=positive_int, required=True)
    g.add_argument("--global-batch-size", type=positive_int, required=True)
    precision = g.add_mutually_exclusive_group()
    precision.add_argument("--bf16", dest="precision", action="store_const", const="bf16")
    precision.add_argument("--fp16", dest="precision", action="store_const", const="fp16")
    precision.add_argument("--fp32", dest="precision", action="store_const", const="fp32")

    g = p.add_argument_group("hardware (defaults: H100 SXM)")
    g.add_argument("--num-gpus", type=positive_int, required=True)
    g.add_argument("--gpu-memory-gb", type=positive_float, required=True)
    g.add_argument("--gpus-per-node", type=positive_int, help="default min(8, --num-gpus)")
    g.add_argument("--peak-tflops", type=positive_float, help="dense TFLOP/s per GPU; default 989 (bf16/fp16), 67 (fp32)")
    g.add_argument("--compute-efficiency", type=positive_float, default=0.55,
                   help="share of peak the compute reaches, communication and bubble aside (default 0.55)")
    g.add_argument("--intra-node-bandwidth", type=positive_float, default=360.0, help="GB/s per GPU, NVLink (default 360)")
    g.add_argument("--inter-node-bandwidth", type=positive_float, default=40.0, help="GB/s per GPU, InfiniBand (default 40)")
    g.add_argument("--usable-memory-fraction", type=positive_float, default=0.9,
                   help="of --gpu-memory-gb, the rest for the CUDA context, NCCL and fragmentation (default 0.9)")

    g = p.add_argument_group("pin part of the layout (pretrain_gpt.py names)")
    g.add_argument("--tensor-model-parallel-size", type=positive_int)
    g.add_argument("--pipeline-model-parallel-size", type=positive_int)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=positive_int)
    g.add_argument("--micro-batch-size", type=positive_int)
    g.add_argument("--recompute-granularity", choices=["none", "selective", "full"])
    g.add_argument("--data-parallel-sharding-strategy", choices=SHARDING_STRATEGIES)
    g.add_argument("--use-distributed-optimizer", action="store_true", help="= --data-parallel-sharding-strategy optim")
    g.add_argument("--context-parallel-size", type=positive_int, help="default 1 (context parallelism is not searched)")
    g.add_argument("--expert-model-parallel-size", type=positive_int)
    g.add_argument("--expert-tensor-parallel-size", type=positive_int, help="searched: 1 or the TP size")
    g.add_argument("--num-distributed-optimizer-instances", type=positive_int,
                   help="hybrid sharding; searched: 1, and where the data-parallel ranks span nodes the fewest "
                        "instances whose ZeRO shard group fits in one node")
    g.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES, help="default 1f1b (interleaved with virtual stages)")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=positive_int)
    g.add_argument("--decoder-first-pipeline-num-layers", type=positive_int)
    g.add_argument("--decoder-last-pipeline-num-layers", type=positive_int)
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    g.add_argument("--pipeline-model-parallel-layout", help="Megatron's layout string (pins --pipeline-model-parallel-size "
                                                            "too: give it)")
    g.add_argument("--top", type=positive_int, default=5, help="how many layouts to print (default 5)")
    g.add_argument("--verify", action="store_true", help=(
        "run pretrain_gpt.py's dry run (--fake-process-group --no-storage) for one rank of each distinct role of "
        "every printed layout, and print its measured memory beside the estimate"))
    return p


# ---- flags -> planner inputs ------------------------------------------------------------------------
def model_config(args):
    given = [f"--{name.replace('_', '-')}" for name in MODEL_FLAGS if vars(args)[name] is not None]
    if args.hf_config:
        if given:
            raise UserError(f"--hf-config and {given[0]} are exclusive: the model comes from the config; remove the model flags")
        model = plan_flags.model_from_hf_config(read_hf_config_file(args.hf_config), args.seq_length)
    else:
        missing = [f"--{name.replace('_', '-')}" for name in MODEL_FLAGS if vars(args)[name] is None]
        if missing:
            raise UserError(f"give --hf-config PATH or the model flags; missing {', '.join(missing)}")
        if args.num_query_groups is not None and not args.group_query_attention:
            raise UserError("--num-query-groups needs --group-query-attention")
        if args.group_query_attention and args.num_query_groups is None:
            raise UserError("--group-query-attention needs --num-query-groups N")
        model = plan_flags.model_from_flags(
            args.num_layers, args.hidden_size, args.num_attention_heads, args.vocab_size, args.seq_length,
            ffn_hidden_size=args.ffn_hidden_size, num_query_groups=args.num_query_groups,
            kv_channels=args.kv_channels, swiglu=args.swiglu, max_position_embeddings=args.max_position_embeddings,
            position_embedding_type=args.position_embedding_type, normalization=args.normalization,
            add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias,
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights)
    model = dataclasses.replace(model, **moe_fields(args, model))
    dropout = {name: value for name, value in (("hidden_dropout", args.hidden_dropout),
                                               ("attention_dropout", args.attention_dropout)) if value is not None}
    for name, value in dropout.items():
        if not 0.0 <= value < 1.0:
            raise UserError(f"--{name.replace('_', '-')} must be in [0, 1), got {value}")
    if not model.use_rope and args.seq_length > model.max_position_embeddings:
        raise UserError(f"--seq-length {args.seq_length} exceeds the model's {model.max_position_embeddings} learned "
                        "positions; shorten --seq-length")
    return dataclasses.replace(model, **dropout)


MOE_FLAGS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
             "moe_shared_expert_gate", "moe_layer_freq", "moe_token_dispatcher_type", "moe_expert_capacity_factor",
             "moe_z_loss_coeff")


def moe_fields(args, model) -> dict:
    """The MoE fields of the model: the MoE flags given on the command line, over a Hugging Face config's
    own; checked as pretrain_gpt.py checks them (config/validate.py's check_moe)."""
    parser = build_parser()
    given = {name: vars(args)[name] for name in MOE_FLAGS if vars(args)[name] != parser.get_default(name)}
    if not (given.get("num_experts") or model.num_experts):
        if given:
            raise UserError(f"--{next(iter(given)).replace('_', '-')} applies to MoE layers; add --num-experts N")
        return {}
    fields = given if model.num_experts else {name: vars(args)[name] for name in MOE_FLAGS}
    checks.check_moe(dataclasses.replace(model, **fields))
    return fields


def planner_inputs(args):
    if args.moe_imbalance_margin < 1:
        raise UserError(f"--moe-imbalance-margin is the busiest rank's rows over the mean, at least 1; got "
                        f"{args.moe_imbalance_margin}")
    workload = inputs.Workload(model_config(args), args.global_batch_size, args.precision or "bf16",
                                 args.make_vocab_size_divisible_by, args.moe_imbalance_margin)
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


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        planned = plan(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    print("\n".join(describe(*planned)), flush=True)
    return verify_layouts(*planned) if args.verify else 0


if __name__ == "__main__":
    sys.exit(main())
