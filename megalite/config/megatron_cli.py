"""Megatron-LM's pretrain_gpt.py command line, mapped onto megalite's config dataclasses.

Flag names, defaults and meanings follow Megatron's ``arguments.py`` so users' launch scripts carry over.
Each config field's flag is declared once, on the field (schema.py); this module adds the Megatron
inputs that have no field of their own (``MEGATRON_INPUTS``: alternative units, schedules that become
fields) and the flags accepted for compatibility (``COMPAT_FLAGS``). The rules on those inputs live
here, where they exist; every rule between config fields lives in validate.py. Every mistake becomes a
``UserError`` with one line naming the flag and the fix. What the flags alone do not give (the launched
world size, a --use-checkpoint-args checkpoint, the tokenizer's vocabulary) train/command_line.py reads
around ``config_from_args`` and ``with_vocabulary``.
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields, replace

from megalite.config import validate as rules
from megalite.config.batch_schedule import parse_step_schedule, rampup_schedule, train_iters_for_samples
from megalite.config.cli import OneLineArgumentParser, non_negative_int, number, positive_int
from megalite.config.fields import FIELD_DEFAULT, FLAG
from megalite.config.fp8_fields import HIGH_PRECISION_GATHER_REASON, PARAM_GATHER_RECIPES
from megalite.config.schema import (CONFIG_SECTIONS, DataConfig, MegaliteConfig, ModelConfig, OptimizerConfig,
                                    ParallelConfig, TrainingConfig, default_ffn_hidden_size, default_kv_channels,
                                    padded_vocab_size)
from megalite.errors import UserError

SECTION_TITLES = {ModelConfig: "model", ParallelConfig: "parallelism", OptimizerConfig: "optimizer and learning rate",
                  DataConfig: "data", TrainingConfig: "training, checkpointing, logging and profiling"}

# --recompute-modules' choices (Megatron's names)
RECOMPUTE_MODULES = ["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"]
# Megatron inputs with no config field of their own: (flag, argparse keywords)
MEGATRON_INPUTS = [
    ("--group-query-attention", dict(action="store_true", help="KV heads shared by groups (--num-query-groups)")),
    ("--make-vocab-size-divisible-by", dict(type=positive_int, default=128,
                                            help="pad the vocabulary to a multiple of this x TP size")),
    ("--train-samples", dict(type=positive_int, help="train for this many samples instead of --train-iters")),
    ("--rampup-batch-size", dict(nargs=3, type=non_negative_int, metavar=("START", "INCREMENT", "SAMPLES"), help=(
        "grow the global batch from START by INCREMENT over SAMPLES samples to --global-batch-size"))),
    ("--step-batch-size-schedule", dict(help=(
        'global batch size by tokens consumed, "THRESHOLD:BATCH ..." (K/M/B/T suffixes), e.g. "0:16 2.4B:320"; the '
        "last batch is the global batch size"))),
    ("--lr-decay-samples", dict(type=positive_int, help="--lr-decay-iters in samples")),
    ("--lr-warmup-samples", dict(type=non_negative_int, default=0, help="--lr-warmup-iters in samples")),
    ("--lr-warmup-fraction", dict(type=number, help="warm-up as a fraction of the decay")),
    ("--lr-wsd-decay-samples", dict(type=positive_int, help="--lr-wsd-decay-iters in samples")),
    ("--tiktoken-pattern", dict(choices=["v1", "v2"], help=(
        "pre-tokenisation pattern of Megatron's TikTokenizer; no other tokenizer uses it"))),
    ("--ckpt-format", dict(choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"], help=(
        "Megatron's checkpoint formats; megalite writes its own reshardable format whatever this says"))),
    ("--no-check-for-nan-in-loss-and-grad", dict(action="store_true", help=(
        "go on past a NaN/Inf loss or gradient norm (= --skip-nan-iterations: that step's update is skipped)"))),
]

# Megatron flags that only pick fused kernels or legacy code paths; megalite accepts them so existing
# scripts run, and says once at start-up that they change nothing. --no-position-embedding is the legacy
# model's switch, which Megatron's core models ignore too: --position-embedding-type decides.
COMPAT_NO_EFFECT = ["--use-mcore-models", "--use-flash-attn", "--no-masked-softmax-fusion",
                    "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
                    "--no-rope-fusion", "--attention-softmax-in-fp32",
                    "--accumulate-allreduce-grads-in-fp32", "--use-rotary-position-embeddings",
                    "--no-position-embedding", "--moe-permute-fusion"]
COMPAT_FLAGS = [(name, dict(action="store_true")) for name in COMPAT_NO_EFFECT] + [
    ("--transformer-impl", dict(choices=["local", "transformer_engine"])),
    ("--attention-backend", dict(choices=["flash", "fused", "unfused", "local", "auto"])),
    ("--no-create-attention-mask-in-dataloader", dict(action="store_false",
                                                      dest="create_attention_mask_in_dataloader")),
    ("--distributed-backend", dict(choices=["nccl", "gloo"])),
    ("--cross-entropy-fusion-impl", dict(choices=["native", "te"])),
] + [(name, dict(action="store_true")) for name in ("--auto-detect-ckpt-format", "--enable-experimental",
                                                     "--log-memory-to-tensorboard")] + [
    ("--dist-ckpt-strictness", dict(choices=["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
                                             "raise_all", "return_unexpected", "return_all", "ignore_all"])),
    ("--logging-level", dict(type=int)),
    ("--save-retain-interval", dict(type=positive_int)),
    ("--recompute-modules", dict(nargs="*", choices=RECOMPUTE_MODULES)),
]
# What megalite does where Megatron's flag (the key) chooses among things megalite decides for itself: one
# start-up line each (``startup_notes``).
DECIDED_HERE = {
    "--cross-entropy-fusion-impl": "megalite's own vocabulary-parallel cross-entropy (chunked with "
                                   "--cross-entropy-loss-fusion) whatever the implementation named",
    "--auto-detect-ckpt-format": "--load reads megalite's own format, the only one it writes, so there is nothing "
                                 "to detect",
    "--dist-ckpt-strictness": "--load stops with one line naming a tensor the model needs that the checkpoint "
                              "lacks or holds in another shape, whatever the strictness named",
    "--enable-experimental": "megalite has no experimental switch: every feature is on when its own flag is given",
    "--log-memory-to-tensorboard": "memory is always among the metrics every sink gets (JSONL, tensorboard, wandb)",
    "--logging-level": "megalite prints its log lines whatever the level (Python's logging level of Megatron's "
                       "own loggers)",
    "--save-retain-interval": "megalite keeps every checkpoint --save-interval writes (Megatron deletes those "
                              "between the retained ones); remove old ones yourself",
    "--recompute-modules": "megalite's --recompute-granularity selective recomputes core attention (core_attn) "
                           "only, and keeps the other modules' activations (plan their memory with "
                           "tools/plan_parallelism.py)",
}


def field_flags(section) -> list[tuple[str, dict]]:
    """(flag, argparse keywords) of every field of ``section`` that a flag sets."""
    flags = []
    for f in fields(section):
        spec = f.metadata.get(FLAG)
        if spec is None:
            continue
        if spec.cli_default is not FIELD_DEFAULT:
            default = spec.cli_default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = None if f.default is MISSING else f.default     # no default: required, or derived when absent
        keywords = dict(dest=f.name, help=spec.help)
        if f.type == "bool":       # a switch: --x sets a False default, --no-x / --disable-x clears a True one
            keywords.update(action="store_false" if default else "store_true")
        else:
            keywords.update(default=default, type=spec.type, choices=spec.choices, nargs=spec.nargs)
        flags.append((spec.name, {k: v for k, v in keywords.items() if v is not None or k == "default"}))
    return flags


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="pretrain_gpt.py", description="megalite: Megatron-style GPT/Llama pretraining",
                              allow_abbrev=False)
    for section in CONFIG_SECTIONS:
        group = p.add_argument_group(SECTION_TITLES[section])
        for name, keywords in field_flags(section):
            group.add_argument(name, **keywords)
    group = p.add_argument_group("Megatron inputs converted into the fields above")
    for name, keywords in MEGATRON_INPUTS:
        group.add_argument(name, **keywords)
    group = p.add_argument_group("accepted for script compatibility (kernel choices megalite makes itself)")
    for name, keywords in COMPAT_FLAGS:
        group.add_argument(name, help=argparse.SUPPRESS, **keywords)
    return p


def compat_flags_used(argv: list[str]) -> list[str]:
    return [f for f in COMPAT_NO_EFFECT if f in argv]


def startup_notes(argv: list[str]) -> list[str]:
    """One line per group of Megatron flags that megalite accepts but decides for itself (kernels,
    formats), saying what it does instead; printed once at start-up."""
    args = build_parser().parse_args(argv)
    notes = []
    ignored = compat_flags_used(argv)
    if ignored:
        notes.append(f"accepted with no effect (megalite chooses its kernels itself): {' '.join(ignored)}")
    if args.attention_backend is not None or not args.create_attention_mask_in_dataloader:
        given = " ".join(f for f in ("--attention-backend", "--no-create-attention-mask-in-dataloader") if f in argv)
        notes.append(f"{given}: megalite uses torch's scaled_dot_product_attention (flash/memory-efficient kernels "
                     "where the device has them) with a causal flag, and its data loader never builds an attention "
                     "mask")
    if args.ckpt_format is not None:
        notes.append(f"--ckpt-format {args.ckpt_format}: megalite writes its own reshardable format (safetensors + "
                     "metadata.json, loadable at any layout) whatever the format named")
    if args.fp8_param_gather and args.fp8_recipe not in PARAM_GATHER_RECIPES:
        notes.append(f"--fp8-param-gather: --fp8-recipe {args.fp8_recipe}'s weights are gathered in their own dtype "
                     f"({'bf16' if args.bf16 else 'fp16' if args.fp16 else 'fp32'}): {HIGH_PRECISION_GATHER_REASON}; FP8 "
                     f"gathers take --fp8-recipe {' or '.join(PARAM_GATHER_RECIPES)}")
    if "--tokenizer-type" not in argv and args.vocab_file and args.merge_file:
        notes.append("no --tokenizer-type: --vocab-file and --merge-file are read as GPT2BPETokenizer")
    unused = [f for f, v in (("--no-load-optim", args.no_load_optim), ("--no-load-rng", args.no_load_rng)) if v]
    if unused and not args.load:         # Megatron's example scripts pass them with --load commented out
        notes.append(f"{' '.join(unused)}: no --load, so nothing is loaded; they apply once --load DIR is given")
    notes += [f"{flag}: {note}" for flag, note in DECIDED_HERE.items() if flag in argv]
    if args.no_check_for_nan_in_loss_and_grad:
        notes.append("--no-check-for-nan-in-loss-and-grad: training goes on past a NaN/Inf loss or gradient norm, "
                     "and megalite skips that step's update (--skip-nan-iterations) rather than apply it")
    if args.tiktoken_pattern is not None and args.tokenizer_type != "TikTokenizer":
        notes.append(f"--tiktoken-pattern {args.tiktoken_pattern}: only Megatron's TikTokenizer uses it; "
                     f"--tokenizer-type {args.tokenizer_type} does not")
    return notes


# ---- building the configs --------------------------------------------------------------------------
def config_from_args(args: argparse.Namespace, world_size: int) -> MegaliteConfig:
    """The parsed flags ``args`` of a run on ``world_size`` processes as a MegaliteConfig that passed every
    rule, without its vocabulary (``with_vocabulary`` adds it once the tokenizer is known)."""
    _check_inputs(args)
    model, parallel = model_config(args), _parallel_config(args, world_size)
    rules.check_model(model)                        # the layout's rules before the batch sizes that depend on it
    rules.check_tensor_parallel(model, parallel)
    rules.check_world_size(world_size, parallel)
    training = _training_config(args, parallel)
    config = MegaliteConfig(model=model, parallel=parallel, optimizer=_optimizer_config(args, training),
                            data=data_config(args), training=training)
    rules.validate(config, world_size)
    rules.check_paths(config.training)
    return config


def with_vocabulary(config: MegaliteConfig, true_vocab_size: int, divisible_by: int) -> MegaliteConfig:
    """``config`` with the tokenizer's vocabulary size and the embedding rows padded to a multiple of
    ``divisible_by`` (--make-vocab-size-divisible-by) x the tensor-parallel size."""
    padded = padded_vocab_size(true_vocab_size, divisible_by, config.parallel.tensor_model_parallel_size)
    return replace(config, model=replace(config.model, vocab_size=true_vocab_size, padded_vocab_size=padded))


def _check_inputs(args: argparse.Namespace) -> None:
    """Rules on the command line itself: required flags, and flags that are alternatives of each other
    or only make sense together (they have no config field to check later)."""
    for flag, value in (("--num-layers", args.num_layers), ("--hidden-size", args.hidden_size),
                        ("--num-attention-heads", args.num_attention_heads), ("--seq-length", args.seq_length),
                        ("--micro-batch-size", args.micro_batch_size), ("--lr", args.lr)):
        if value is None:
            raise UserError(f"{flag} is required")
    if args.train_iters is None and args.train_samples is None:
        raise UserError("give --train-iters N or --train-samples N")
    if args.train_iters is not None and args.train_samples is not None:
        raise UserError("--train-iters and --train-samples are exclusive; give one")
    if args.rampup_batch_size and args.step_batch_size_schedule:
        raise UserError("--rampup-batch-size and --step-batch-size-schedule are exclusive; give one")
    warmups = [f for f, v in (("--lr-warmup-iters", args.lr_warmup_iters), ("--lr-warmup-samples", args.lr_warmup_samples),
                              ("--lr-warmup-fraction", args.lr_warmup_fraction)) if v]
    if len(warmups) > 1:
        raise UserError(f"{' and '.join(warmups)} are exclusive; give one warm-up")
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction <= 1.0:
        raise UserError(f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
    if args.decoupled_lr is not None and not 0 <= (args.decoupled_min_lr or 0.0) <= args.decoupled_lr:
        raise UserError(f"--decoupled-min-lr {args.decoupled_min_lr} must be in [0, --decoupled-lr {args.decoupled_lr}]")
    if args.use_distributed_optimizer and args.use_torch_fsdp2:
        raise UserError("--use-torch-fsdp2 shards the optimizer state itself; drop --use-distributed-optimizer "
                        "(megalite's own ZeRO-1)")
    if args.use_layer_wise_distributed_optimizer and (args.use_torch_fsdp2 or not args.use_distributed_optimizer
                                                      and args.data_parallel_sharding_strategy in (None, "no_shard")):
        raise UserError("--use-layer-wise-distributed-optimizer lays out megalite's ZeRO shards: add "
                        "--use-distributed-optimizer or --data-parallel-sharding-strategy optim|optim_grads|"
                        "optim_grads_params, without --use-torch-fsdp2")
    if args.use_distributed_optimizer and args.data_parallel_sharding_strategy == "no_shard":
        raise UserError("--use-distributed-optimizer shards the optimizer state but --data-parallel-sharding-strategy "
                        "no_shard asks for none; drop one of them")


def _from_flags(section, args: argparse.Namespace, **computed):
    """``section`` with every field a flag sets taken from ``args``, and the others from ``computed``."""
    values = vars(args)
    given = {f.name: values[f.name] for f in fields(section) if FLAG in f.metadata}
    return section(**{**given, **computed})


def model_config(args) -> ModelConfig:
    """The model without its vocabulary (parse_args adds it once the tokenizer is known); a planner
    reads it from the same flags without launching anything."""
    if args.num_query_groups is not None and not args.group_query_attention:
        raise UserError("--num-query-groups needs --group-query-attention")
    if args.group_query_attention and args.num_query_groups is None:
        raise UserError("--group-query-attention needs --num-query-groups N")
    return _from_flags(
        ModelConfig, args, padded_vocab_size=0, vocab_size=0,
        ffn_hidden_size=args.ffn_hidden_size or default_ffn_hidden_size(args.hidden_size, args.swiglu),
        kv_channels=args.kv_channels or default_kv_channels(args.hidden_size, args.num_attention_heads),
        num_query_groups=args.num_query_groups if args.group_query_attention else args.num_attention_heads,
        max_position_embeddings=args.max_position_embeddings or args.seq_length,
        params_dtype="bfloat16" if args.bf16 else "float16" if args.fp16 else "float32",
        reset_position_ids=args.reset_position_ids)


def _parallel_config(args, world_size: int) -> ParallelConfig:
    strategy = args.data_parallel_sharding_strategy
    if strategy is None:       # FSDP2's default reshards after forward; --use-distributed-optimizer makes "optim"
        strategy = "optim_grads_params" if args.use_torch_fsdp2 else "no_shard"
    # Muon orthogonalises whole matrices: its ZeRO takes the whole-parameter layout (as Megatron's does)
    whole = args.use_layer_wise_distributed_optimizer or (args.optimizer == "muon" and not args.use_torch_fsdp2 and (
        args.use_distributed_optimizer or strategy != "no_shard"))
    return _from_flags(ParallelConfig, args, world_size=world_size, data_parallel_sharding_strategy=strategy,
                       use_layer_wise_distributed_optimizer=whole)


def _training_config(args, parallel: ParallelConfig) -> TrainingConfig:
    gbs, schedule = _batch_sizes(args, parallel.data_parallel_size)
    first_batch = schedule[0][1] if schedule else gbs
    if args.train_samples is not None and args.train_samples < first_batch:
        raise UserError(f"--train-samples {args.train_samples} is less than one global batch ({first_batch}); "
                        "train for at least one iteration")
    train_iters = args.train_iters
    if train_iters is None:
        train_iters = train_iters_for_samples(args.train_samples, gbs, schedule)
    return _from_flags(TrainingConfig, args, global_batch_size=gbs, train_iters=train_iters,
                       batch_size_schedule=schedule, profile_ranks=list(args.profile_ranks),
                       skip_nan_iterations=args.skip_nan_iterations or args.no_check_for_nan_in_loss_and_grad)


def _batch_sizes(args, dp: int) -> tuple[int, list[tuple[int, int]]]:
    """The final global batch size and the schedule towards it ([] without --rampup-batch-size or
    --step-batch-size-schedule). Every size must split into micro-batches over the data-parallel ranks."""
    unit = args.micro_batch_size * dp
    gbs = args.global_batch_size if args.global_batch_size is not None else unit
    rules.check_batch(args.micro_batch_size, gbs, dp)
    if args.rampup_batch_size:
        flag, schedule = "--rampup-batch-size", rampup_schedule(args.rampup_batch_size, gbs)
    elif args.step_batch_size_schedule:
        flag, schedule = "--step-batch-size-schedule", parse_step_schedule(args.step_batch_size_schedule,
                                                                           args.seq_length)
        final = schedule[-1][1]
        if gbs != final and gbs != unit:
            raise UserError(f"--global-batch-size {gbs} differs from the last batch size {final} "
                            "of --step-batch-size-schedule; drop --global-batch-size or make them equal")
        gbs = final
    else:
        return gbs, []
    for start, batch in schedule:
        if batch % unit:
            raise UserError(f"{flag}: the global batch size {batch} (from sample {start}) is not divisible by "
                            f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}; choose sizes "
                            f"that are multiples of {unit}")
    return gbs, schedule


def _iters(samples: int | None, iters: int | None, global_batch_size: int) -> float | None:
    """Megatron counts schedules in samples when --*-samples flags are used; megalite in iterations."""
    if samples:
        return samples / global_batch_size
    return iters


def _optimizer_config(args, training: TrainingConfig) -> OptimizerConfig:
    gbs = training.global_batch_size
    decay_iters = _iters(args.lr_decay_samples, args.lr_decay_iters, gbs) or training.train_iters
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay_iters
    else:
        warmup = _iters(args.lr_warmup_samples, args.lr_warmup_iters, gbs) or 0
    # a run shorter than its warm-up (a smoke test: --train-iters 1) just never finishes warming up;
    # only an explicit decay length that the warm-up overruns is a contradiction
    if warmup > decay_iters and (args.lr_decay_iters or args.lr_decay_samples):
        raise UserError(f"the warm-up ({warmup:g} iterations) is longer than the decay ({decay_iters:g} iterations); "
                        "shorten --lr-warmup-iters or lengthen --lr-decay-iters")
    decoupled_min_lr = args.decoupled_min_lr
    if decoupled_min_lr is None and args.decoupled_lr is not None:
        decoupled_min_lr = args.min_lr
    return _from_flags(OptimizerConfig, args, lr_decay_iters=decay_iters, lr_warmup_iters=warmup,
                       lr_wsd_decay_iters=_iters(args.lr_wsd_decay_samples, args.lr_wsd_decay_iters, gbs),
                       decoupled_min_lr=decoupled_min_lr)


def data_config(args) -> DataConfig:
    tokenizer_type = args.tokenizer_type
    if tokenizer_type is None and args.vocab_file and args.merge_file:
        # a vocab.json with merges.txt is GPT-2's BPE (Megatron's GPT-3 example gives only the two files)
        tokenizer_type = "GPT2BPETokenizer"
    # a job script's "--split '99,1,0'" reaches us with its quotes when word-split unquoted (Megatron
    # reads only the numbers of the string, so it accepts them too)
    split = "969, 30, 1" if args.split is None else args.split.strip().strip("'\"")
    return _from_flags(DataConfig, args, tokenizer_type=tokenizer_type, split=split, seq_length=args.seq_length)
