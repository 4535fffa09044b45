"""Megatron-LM's pretrain_gpt.py command line, mapped onto megalite's config dataclasses.

Flag names, defaults and meanings follow Megatron (REFERENCE.md §5) so users' launch scripts carry
over. Every mistake becomes a ``UserError`` with one line naming the flag and the fix.
"""
from __future__ import annotations

import argparse
import math
import os

from megalite.config.schema import (PIPELINE_SCHEDULES, SHARDING_STRATEGIES, DataConfig, MegaliteConfig, ModelConfig, OptimizerConfig,
                             ParallelConfig, TrainingConfig, padded_vocab_size)
from megalite.errors import UserError
from megalite.parallel.launch_env import read_launch_env


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag raises UserError (one line) instead of printing usage and exiting 2.
    The tools/ command lines use it too, so every entry point reports mistakes the same way."""

    def error(self, message: str):
        raise UserError(f"{' '.join(message.split())} (see python {self.prog} --help)")


_Parser = OneLineArgumentParser


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    """A finite number: nan and inf would slip through every later range check (nan > 0 is False)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt.py", description="megalite: Megatron-style GPT/Llama pretraining",
                allow_abbrev=False)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=_positive_int)
    g.add_argument("--hidden-size", type=_positive_int)
    g.add_argument("--ffn-hidden-size", type=_positive_int, help="default 4*hidden, or Megatron's 2/3 rule with --swiglu")
    g.add_argument("--num-attention-heads", type=_positive_int)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=_positive_int, help="KV heads, with --group-query-attention")
    g.add_argument("--kv-channels", type=_positive_int, help="head dimension; default hidden/heads")
    g.add_argument("--seq-length", type=_positive_int)
    g.add_argument("--max-position-embeddings", type=_positive_int, help="default --seq-length")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--rotary-base", type=_float, default=10000.0)
    g.add_argument("--rotary-percent", type=_float, default=1.0,
                   help="RoPE on this fraction of each head's dimensions, the rest pass through (partial rotary)")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=_float, default=1e-5)
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="zero-centred norm weights: the norm scales by (weight + 1), weights start at 0")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--openai-gelu", action="store_true", help="tanh-approximated GELU (GPT-2)")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--add-qkv-bias", action="store_true", help="q/k/v biases even with --disable-bias-linear (Qwen2)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--init-method-std", type=_float, default=0.02)
    g.add_argument("--attention-dropout", type=_float, default=0.1)
    g.add_argument("--hidden-dropout", type=_float, default=0.1)
    g.add_argument("--make-vocab-size-divisible-by", type=_positive_int, default=128)
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="chunked vocabulary-parallel cross-entropy: fp32 logits of a chunk of tokens at a time")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=_positive_int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=_positive_int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=_positive_int)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=_positive_int,
                   help="model chunks per pipeline rank (the way to interleave with uneven first/last stages)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int,
                   help="transformer layers on the first pipeline stage; the middle stages split the rest evenly")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int,
                   help="transformer layers on the last pipeline stage; the middle stages split the rest evenly")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as one layer when splitting layers over pipeline stages")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the output layer and loss as one layer when splitting layers over pipeline stages")
    g.add_argument("--pipeline-model-parallel-layout",
                   help='Megatron\'s layout string, e.g. "Et*3|(tt|)*2,t|L": stages split by |, E embedding, '
                        "t transformer layer, L loss; pp x vpp stages")
    g.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES, default="1f1b",
                   help="pipeline schedule (1f1b becomes interleaved 1F1B whenever virtual stages are used)")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--context-parallel-size", type=_positive_int, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--data-parallel-sharding-strategy", choices=SHARDING_STRATEGIES,
                   help="ZeRO stage: optim = 1 (= --use-distributed-optimizer), optim_grads = 2, "
                        "optim_grads_params = 3; default no_shard")
    g.add_argument("--ddp-bucket-size", type=_positive_int,
                   help="elements per data-parallel gradient bucket (default max(40M, 1M x data-parallel size) with "
                        "--overlap-grad-reduce, else one bucket)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="data-parallel gradient reductions in bf16 (gradient accumulation stays fp32)")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                   help="compute each linear's weight gradient on its own and add it into the fp32 main_grad after; "
                        "by default the matmul adds it in place (fp32 weights; bf16/fp16 on CUDA)")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="PyTorch FSDP2 (fully_shard per layer) instead of megalite's own data parallelism; ZeRO-3 "
                        "by default, --data-parallel-sharding-strategy optim_grads keeps parameters gathered "
                        "from forward to backward")

    g = p.add_argument_group("batch and optimizer")
    g.add_argument("--micro-batch-size", type=_positive_int)
    g.add_argument("--global-batch-size", type=_positive_int, help="default micro-batch-size x data-parallel size")
    g.add_argument("--train-iters", type=_positive_int)
    g.add_argument("--train-samples", type=_positive_int)
    g.add_argument("--rampup-batch-size", nargs=3, type=_non_negative_int, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="grow the global batch from START by INCREMENT over SAMPLES samples to --global-batch-size")
    g.add_argument("--step-batch-size-schedule",
                   help='global batch size by tokens consumed, "THRESHOLD:BATCH ..." (K/M/B/T suffixes), e.g. '
                        '"0:16 2.4B:320"; the last batch is the global batch size')
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="loss = sum over every token of the global batch / their count (not a mean of "
                        "micro-batch means)")
    g.add_argument("--optimizer", choices=["adam"], default="adam", help="AdamW (decoupled weight decay)")
    g.add_argument("--lr", type=_float)
    g.add_argument("--min-lr", type=_float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   default="linear")
    g.add_argument("--lr-decay-iters", type=_positive_int)
    g.add_argument("--lr-decay-samples", type=_positive_int)
    g.add_argument("--lr-warmup-iters", type=_non_negative_int, default=0)
    g.add_argument("--lr-warmup-samples", type=_non_negative_int, default=0)
    g.add_argument("--lr-warmup-fraction", type=_float)
    g.add_argument("--lr-warmup-init", type=_float, default=0.0)
    g.add_argument("--decoupled-lr", type=_positive_float,
                   help="learning rate of the input embedding and output layer (the rest use --lr)")
    g.add_argument("--decoupled-min-lr", type=_float,
                   help="minimum learning rate of the input embedding and output layer (with --decoupled-lr)")
    g.add_argument("--lr-wsd-decay-style", choices=["exponential", "linear", "cosine", "minus_sqrt"],
                   default="exponential")
    g.add_argument("--lr-wsd-decay-iters", type=_positive_int)
    g.add_argument("--lr-wsd-decay-samples", type=_positive_int)
    g.add_argument("--weight-decay", type=_float, default=0.01)
    g.add_argument("--adam-beta1", type=_float, default=0.9)
    g.add_argument("--adam-beta2", type=_float, default=0.999)
    g.add_argument("--adam-eps", type=_float, default=1e-8)
    g.add_argument("--clip-grad", type=_float, default=1.0)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=_float, help="static fp16 loss scale; dynamic when absent")
    g.add_argument("--initial-loss-scale", type=_float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=_float, default=1.0)
    g.add_argument("--loss-scale-window", type=_positive_int, default=1000)
    g.add_argument("--hysteresis", type=_positive_int, default=2)
    g.add_argument("--seed", type=_int, default=1234)

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=[], help='PREFIX, or "W1 PREFIX1 W2 PREFIX2 ..."')
    g.add_argument("--train-data-path", nargs="*", default=[])
    g.add_argument("--valid-data-path", nargs="*", default=[])
    g.add_argument("--test-data-path", nargs="*", default=[])
    g.add_argument("--split", default=None, help='train,valid,test weights, default "969, 30, 1"')
    g.add_argument("--data-cache-path")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--tokenizer-type", choices=["GPT2BPETokenizer", "SentencePieceTokenizer",
                                                "HuggingFaceTokenizer", "NullTokenizer"])
    g.add_argument("--tokenizer-model")
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    g.add_argument("--vocab-size", type=_positive_int, help="vocabulary of NullTokenizer (eod is one past it)")
    g.add_argument("--num-workers", type=_non_negative_int, default=2)
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                   help="read each .bin file into memory instead of memory-mapping it")
    g.add_argument("--tiktoken-pattern", choices=["v1", "v2"],
                   help="pre-tokenisation pattern of Megatron's TikTokenizer; no other tokenizer uses it")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save")
    g.add_argument("--load")
    g.add_argument("--save-interval", type=_positive_int)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--use-checkpoint-args", action="store_true")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM/SIGINT finish the iteration, save a checkpoint (with --save) and exit 0")
    g.add_argument("--exit-duration-in-mins", type=_positive_float,
                   help="stop (saving a checkpoint with --save) once training has run this long")
    g.add_argument("--exit-interval", type=_positive_int,
                   help="stop (saving a checkpoint with --save) at the first iteration that is a multiple of this")
    g.add_argument("--ckpt-format", choices=CKPT_FORMATS,
                   help="Megatron's checkpoint formats; megalite writes its own reshardable format whatever this says")
    g.add_argument("--skip-nan-iterations", action="store_true",
                   help="a NaN/Inf loss or gradient norm skips that update and training goes on (default: stop)")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=_positive_int, default=100)
    g.add_argument("--eval-interval", type=_positive_int, default=1000)
    g.add_argument("--eval-iters", type=_non_negative_int, default=100)
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--peak-flops", type=_positive_float,
                   help="one device's peak FLOP/s (e.g. 989e12 for an H100 in bf16), for the MFU in the log; "
                        "default: a table of known GPUs; MFU is left out on CPUs without it")
    g.add_argument("--tensorboard-dir")
    g.add_argument("--wandb-project")
    g.add_argument("--wandb-exp-name")
    g.add_argument("--wandb-save-dir")
    g.add_argument("--metrics-file", help="JSON-lines metrics; default metrics.jsonl in --save/--tensorboard-dir/--wandb-save-dir")
    g.add_argument("--timing-log-level", type=_int, choices=[0, 1, 2], default=0)
    g.add_argument("--log-params-norm", action="store_true", help="log the L2 norm of all parameters")
    g.add_argument("--log-num-zeros-in-grad", action="store_true", help="log the number of zero gradient elements")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="timers and Megatron's iteration-time also to tensorboard and wandb (they are always in the JSONL)")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations [--profile-step-start, --profile-step-end) on --profile-ranks")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="with --profile on GPUs: torch.profiler traces (default: an nsys capture range); CPUs always "
                        "use torch.profiler")
    g.add_argument("--profile-step-start", type=_non_negative_int, default=10)
    g.add_argument("--profile-step-end", type=_non_negative_int, default=12)
    g.add_argument("--profile-ranks", nargs="+", type=_non_negative_int, default=[0])
    g.add_argument("--distributed-timeout-minutes", type=_positive_float, default=10,
                   help="a collective waiting longer than this (a rank died or hung) ends the run with an error")

    g = p.add_argument_group("memory")
    g.add_argument("--manual-gc", action="store_true",
                   help="Python's garbage collector runs only at --manual-gc-interval iterations and around evaluation")
    g.add_argument("--manual-gc-interval", type=_non_negative_int, default=0,
                   help="with --manual-gc: collect every N iterations (0: not between training steps)")
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="with --manual-gc: no collection before and after evaluation")
    g.add_argument("--empty-unused-memory-level", type=_int, choices=[0, 1, 2], default=0,
                   help="free the CUDA caching allocator's unused memory: 1 after forward-backward, 2 also after the "
                        "optimizer step (no effect on CPUs)")

    g = p.add_argument_group("compilation and GPU kernels")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer layer (regional; eager numerics); layouts it cannot "
                        "handle say so at start-up and run eager")
    g.add_argument("--no-tf32", action="store_false", dest="tf32",
                   help="fp32 matmuls and convolutions in full fp32 (default: TF32 on Ampere and newer GPUs)")

    g = p.add_argument_group("activation recomputation")
    g.add_argument("--recompute-granularity", choices=["full", "selective"])
    g.add_argument("--recompute-method", choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=_positive_int)

    g = p.add_argument_group("accepted for script compatibility (kernel choices megalite makes itself)")
    for flag in COMPAT_NO_EFFECT:
        g.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], help=argparse.SUPPRESS)
    g.add_argument("--attention-backend", choices=["flash", "fused", "unfused", "local", "auto"], help=argparse.SUPPRESS)
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader", help=argparse.SUPPRESS)
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], help=argparse.SUPPRESS)
    g.add_argument("--fp8-amax-history-len", type=_positive_int, help=argparse.SUPPRESS)
    g.add_argument("--fp8-amax-compute-algo", choices=["most_recent", "max"], help=argparse.SUPPRESS)
    g.add_argument("--fp8-param-gather", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], help=argparse.SUPPRESS)
    return p


# Megatron flags that only pick fused kernels or legacy code paths; megalite accepts them so existing
# scripts run, and says once at start-up that they change nothing.
COMPAT_NO_EFFECT = ["--use-mcore-models", "--use-flash-attn", "--no-masked-softmax-fusion",
                    "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
                    "--no-rope-fusion", "--attention-softmax-in-fp32",
                    "--accumulate-allreduce-grads-in-fp32", "--use-rotary-position-embeddings"]

CKPT_FORMATS = ["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"]


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
    fp8 = [f for f in ("--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather")
           if f in argv]
    if fp8:
        notes.append(f"{' '.join(fp8)}: megalite has no FP8 (Transformer Engine) kernels; matrix multiplies run in "
                     f"{'bf16' if args.bf16 else 'fp16' if args.fp16 else 'fp32'}")
    if "--tokenizer-type" not in argv and args.vocab_file and args.merge_file:
        notes.append("no --tokenizer-type: --vocab-file and --merge-file are read as GPT2BPETokenizer")
    if args.tiktoken_pattern is not None and args.tokenizer_type != "TikTokenizer":
        notes.append(f"--tiktoken-pattern {args.tiktoken_pattern}: only Megatron's TikTokenizer uses it; "
                     f"--tokenizer-type {args.tokenizer_type} does not")
    return notes


# ---- derived values and validation ----------------------------------------------------------------
def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """4h, or with SwiGLU Megatron's 2/3 of 4h rounded down to a multiple of 64."""
    if swiglu:
        return int((4 * hidden_size * 2 / 3) / 64) * 64
    return 4 * hidden_size


def _require(args, *names: str) -> None:
    for name in names:
        if getattr(args, name.lstrip("-").replace("-", "_")) is None:
            raise UserError(f"{name} is required")


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Cross-flag checks; each failure is one line naming the flags and the fix."""
    _require(args, "--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
             "--micro-batch-size", "--lr")
    if args.train_iters is None and args.train_samples is None:
        raise UserError("give --train-iters N or --train-samples N")
    if args.train_iters is not None and args.train_samples is not None:
        raise UserError("--train-iters and --train-samples are exclusive; give one")
    if args.bf16 and args.fp16:
        raise UserError("--bf16 and --fp16 are exclusive; pick one")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise UserError(f"--hidden-size {args.hidden_size} must be divisible by --num-attention-heads "
                        f"{args.num_attention_heads} (or give --kv-channels)")
    if args.num_query_groups is not None and not args.group_query_attention:
        raise UserError("--num-query-groups needs --group-query-attention")
    if args.group_query_attention:
        if args.num_query_groups is None:
            raise UserError("--group-query-attention needs --num-query-groups N")
        if args.num_attention_heads % args.num_query_groups:
            raise UserError(f"--num-attention-heads {args.num_attention_heads} must be divisible by "
                            f"--num-query-groups {args.num_query_groups}")
    head_dim = args.kv_channels or args.hidden_size // args.num_attention_heads
    if args.position_embedding_type == "rope" and head_dim % 2:
        raise UserError(f"rope needs an even head dimension, got {head_dim} (--kv-channels or --hidden-size/--num-attention-heads)")
    _validate_rotary_percent(args, head_dim)
    if args.max_position_embeddings is not None and args.max_position_embeddings < args.seq_length:
        raise UserError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                        f"{args.max_position_embeddings}; raise --max-position-embeddings")
    for flag in ("attention_dropout", "hidden_dropout"):
        if not 0.0 <= getattr(args, flag) < 1.0:
            raise UserError(f"--{flag.replace('_', '-')} must be in [0, 1), got {getattr(args, flag)}")
    if args.init_method_std <= 0:
        raise UserError(f"--init-method-std must be > 0, got {args.init_method_std}")
    _validate_ranges(args)
    _validate_tensor_parallel(args)
    _validate_recompute(args)
    _validate_batch(args, world_size)
    _validate_data_parallel(args)
    _validate_lr(args)
    _validate_data(args)
    _validate_checkpointing(args)
    _validate_logging(args)
    _validate_output_paths(args)


# flag -> (smallest allowed value, is the bound itself allowed?); every other number flag is range-checked
# where it is used. These would otherwise fail deep inside torch/numpy, or silently train nonsense.
NUMBER_RANGES = {
    "--norm-epsilon": (0.0, False), "--rotary-base": (0.0, False), "--weight-decay": (0.0, True),
    "--adam-eps": (0.0, False), "--clip-grad": (0.0, True), "--lr-warmup-init": (0.0, True),
    "--initial-loss-scale": (0.0, False), "--min-loss-scale": (0.0, False), "--seed": (0, True),
}
MAX_SEED = 2 ** 32 - 1           # numpy's seeding range


def _validate_ranges(args) -> None:
    for flag, (low, inclusive) in NUMBER_RANGES.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value < low or (value == low and not inclusive):
            raise UserError(f"{flag} must be {'>=' if inclusive else '>'} {low:g}, got {value:g}")
    if args.seed > MAX_SEED:
        raise UserError(f"--seed must be in [0, {MAX_SEED}], got {args.seed}")


def rotary_dim(head_dim: int, rotary_percent: float) -> int:
    """Dimensions of each head that RoPE rotates (Megatron: int(kv_channels * rotary_percent))."""
    return int(head_dim * rotary_percent)


def _validate_rotary_percent(args, head_dim: int) -> None:
    if not 0.0 < args.rotary_percent <= 1.0:
        raise UserError(f"--rotary-percent must be in (0, 1], got {args.rotary_percent:g}")
    if args.rotary_percent == 1.0:
        return
    if args.position_embedding_type != "rope":
        raise UserError(f"--rotary-percent {args.rotary_percent:g} needs --position-embedding-type rope")
    dim = rotary_dim(head_dim, args.rotary_percent)
    if dim < 2 or dim % 2:
        raise UserError(f"--rotary-percent {args.rotary_percent:g} rotates {dim} of the head's {head_dim} dimensions; "
                        "RoPE needs an even number >= 2: choose a percent giving an even count")


def _validate_tensor_parallel(args) -> None:
    tp = args.tensor_model_parallel_size
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    ffn = args.ffn_hidden_size or default_ffn_hidden_size(args.hidden_size, args.swiglu)
    if args.num_attention_heads % tp:
        raise UserError(f"--num-attention-heads {args.num_attention_heads} must be divisible by "
                        f"--tensor-model-parallel-size {tp}")
    if tp <= groups and groups % tp:
        raise UserError(f"--num-query-groups {groups} must be divisible by --tensor-model-parallel-size {tp}")
    if tp > groups and tp % groups:
        raise UserError(f"--tensor-model-parallel-size {tp} must be a multiple of --num-query-groups {groups} "
                        "(KV heads are then replicated)")
    if ffn % tp:
        raise UserError(f"--ffn-hidden-size {ffn} must be divisible by --tensor-model-parallel-size {tp}")
    if args.sequence_parallel and tp > 1 and args.seq_length % tp:
        raise UserError(f"--sequence-parallel needs --seq-length {args.seq_length} divisible by "
                        f"--tensor-model-parallel-size {tp}")
    cp = args.context_parallel_size
    if cp > 1:
        split = 2 * cp * (tp if args.sequence_parallel and tp > 1 else 1)
        if args.seq_length % split:
            raise UserError(f"--context-parallel-size {cp} needs --seq-length {args.seq_length} divisible by {split} "
                            f"(2 x cp chunks{' x --tensor-model-parallel-size with --sequence-parallel' if split > 2 * cp else ''})")
        if args.attention_dropout > 0:
            raise UserError(f"--context-parallel-size {cp} needs --attention-dropout 0 (ring attention has no "
                            f"attention dropout; got {args.attention_dropout})")


def _validate_recompute(args) -> None:
    if args.recompute_granularity == "full" and args.recompute_method is None:
        raise UserError("--recompute-granularity full needs --recompute-method uniform or block")
    if args.recompute_granularity != "full" and (args.recompute_method or args.recompute_num_layers):
        raise UserError("--recompute-method and --recompute-num-layers apply only to --recompute-granularity full")


def sharding_strategy(args) -> str:
    """--data-parallel-sharding-strategy, or optim (ZeRO-1) for --use-distributed-optimizer."""
    if getattr(args, "use_torch_fsdp2", False) and not args.data_parallel_sharding_strategy:
        return "optim_grads_params"          # FSDP2's default: reshard after forward
    return args.data_parallel_sharding_strategy or ("optim" if args.use_distributed_optimizer else "no_shard")


def _validate_torch_fsdp2(args) -> None:
    """What PyTorch's FSDP2 backend (distributed/fsdp2.py) cannot combine with, one line each."""
    if args.use_distributed_optimizer:
        raise UserError("--use-torch-fsdp2 shards the optimizer state itself; drop --use-distributed-optimizer "
                        "(megalite's own ZeRO-1)")
    if args.data_parallel_sharding_strategy in ("no_shard", "optim"):
        raise UserError(f"--use-torch-fsdp2 always shards parameters, gradients and optimizer state, not "
                        f"--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy}: use "
                        "optim_grads_params (ZeRO-3, the default) or optim_grads (no reshard after forward)")
    if args.ddp_bucket_size:
        raise UserError("--ddp-bucket-size does not apply to --use-torch-fsdp2, which reduces one transformer layer "
                        "at a time; drop it")
    if args.pipeline_schedule not in ("1f1b", "gpipe"):
        raise UserError(f"--use-torch-fsdp2 works with --pipeline-schedule 1f1b or gpipe, not "
                        f"{args.pipeline_schedule} (FSDP2 reduces a layer's gradients when its whole backward has "
                        "run and keeps one copy of the weights)")


def _validate_data_parallel(args) -> None:
    if args.use_torch_fsdp2:
        _validate_torch_fsdp2(args)
    if args.use_distributed_optimizer and args.data_parallel_sharding_strategy == "no_shard":
        raise UserError("--use-distributed-optimizer shards the optimizer state but --data-parallel-sharding-strategy "
                        "no_shard asks for none; drop one of them")
    if args.overlap_param_gather and sharding_strategy(args) == "no_shard":
        raise UserError("--overlap-param-gather needs --use-distributed-optimizer (or --data-parallel-sharding-strategy "
                        "optim/optim_grads/optim_grads_params): without sharding there is no parameter all-gather")


def _validate_batch(args, world_size: int) -> None:
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    if world_size % model_parallel:
        raise UserError(f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                        f"{args.tensor_model_parallel_size} x --pipeline-model-parallel-size "
                        f"{args.pipeline_model_parallel_size} x --context-parallel-size {args.context_parallel_size}; "
                        f"launch a multiple of {model_parallel} processes")
    dp = world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                        * args.context_parallel_size)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size < args.micro_batch_size * dp:
        raise UserError(f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp} exceeds "
                        f"--global-batch-size {args.global_batch_size}; lower --micro-batch-size or raise "
                        "--global-batch-size")
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise UserError(f"--global-batch-size {args.global_batch_size} must be divisible by --micro-batch-size "
                        f"{args.micro_batch_size} x data-parallel size {dp}")
    args.batch_size_schedule = batch_size_schedule(args, dp)
    first_batch = args.batch_size_schedule[0][1] if args.batch_size_schedule else args.global_batch_size
    if args.train_samples is not None and args.train_samples < first_batch:
        raise UserError(f"--train-samples {args.train_samples} is less than one global batch ({first_batch}); "
                        "train for at least one iteration")
    from megalite.parallel.pipeline.stages import SplitFlags, check_pipeline_split
    from megalite.parallel.pipeline.zero_bubble import check_zero_bubble, schedule_split
    check_zero_bubble(args, args, dp)
    for batch in sorted({args.global_batch_size, *(b for _, b in args.batch_size_schedule)}):
        check_pipeline_split(args.num_layers, args.pipeline_model_parallel_size,
                             args.num_layers_per_virtual_pipeline_stage, batch // (args.micro_batch_size * dp),
                             schedule_split(SplitFlags.of(args), args.pipeline_schedule))


def batch_size_schedule(args, dp: int) -> list[tuple[int, int]]:
    """[(consumed samples from which it applies, global batch size), ...] for --rampup-batch-size or
    --step-batch-size-schedule (empty without one); sets args.global_batch_size to the final size.
    Every size must split into micro-batches over the data-parallel ranks."""
    if args.rampup_batch_size and args.step_batch_size_schedule:
        raise UserError("--rampup-batch-size and --step-batch-size-schedule are exclusive; give one")
    if args.rampup_batch_size:
        schedule = _rampup_schedule(args)
    elif args.step_batch_size_schedule:
        schedule = _parse_step_schedule(args.step_batch_size_schedule, args.seq_length)
        final = schedule[-1][1]
        if args.global_batch_size != final and args.global_batch_size != args.micro_batch_size * dp:
            raise UserError(f"--global-batch-size {args.global_batch_size} differs from the last batch size {final} "
                            "of --step-batch-size-schedule; drop --global-batch-size or make them equal")
        args.global_batch_size = final
    else:
        return []
    unit = args.micro_batch_size * dp
    for start, batch in schedule:
        if batch % unit:
            flag = "--rampup-batch-size" if args.rampup_batch_size else "--step-batch-size-schedule"
            raise UserError(f"{flag}: the global batch size {batch} (from sample {start}) is not divisible by "
                            f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}; choose sizes "
                            f"that are multiples of {unit}")
    return schedule


def _rampup_schedule(args) -> list[tuple[int, int]]:
    """Megatron's ramp-up: the batch is START + k * INCREMENT once int(consumed / (SAMPLES / n)) >= k, for
    n = (global batch - START) / INCREMENT increments; the smallest such consumed count is ceil(k * SAMPLES / n)
    (exact integer arithmetic)."""
    start, increment, samples = args.rampup_batch_size
    gbs = args.global_batch_size
    if start < 1 or increment < 1:
        raise UserError(f"--rampup-batch-size {start} {increment} {samples}: the start size and the increment must "
                        "be >= 1")
    if start > gbs or (gbs - start) % increment:
        raise UserError(f"--rampup-batch-size {start} {increment} {samples}: --global-batch-size {gbs} must be START "
                        "plus a whole number of INCREMENTs")
    n = (gbs - start) // increment
    if n == 0:
        return [(0, gbs)]
    return [(-(-k * samples // n), start + k * increment) for k in range(n + 1)]


_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def _parse_step_schedule(text: str, seq_length: int) -> list[tuple[int, int]]:
    """Megatron's "THRESHOLD:BATCH ..." (thresholds in tokens, converted to samples by seq_length)."""
    def number(part: str) -> int:
        part = part.strip().upper()
        scale = _SUFFIXES.get(part[-1:], 1)
        return int(float(part[:-1] if scale > 1 else part) * scale)

    schedule = []
    for entry in text.replace(",", " ").split():
        try:
            threshold, batch = entry.split(":", 1)
            schedule.append((number(threshold) // seq_length, number(batch)))
        except ValueError:
            raise UserError(f"--step-batch-size-schedule: {entry!r} is not THRESHOLD:BATCH (e.g. 2.4B:320)") from None
    schedule.sort()
    if not schedule or schedule[0][0] != 0:
        raise UserError("--step-batch-size-schedule must start with a batch size at threshold 0 (e.g. \"0:16 ...\")")
    if any(b[0] == a[0] for a, b in zip(schedule, schedule[1:])) or any(batch < 1 for _, batch in schedule):
        raise UserError(f"--step-batch-size-schedule {text!r}: thresholds must be distinct (in samples of "
                        f"--seq-length {seq_length} tokens) and batch sizes >= 1")
    return schedule


def _validate_lr(args) -> None:
    if args.lr <= 0:
        raise UserError(f"--lr must be > 0, got {args.lr}")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise UserError("--decoupled-min-lr needs --decoupled-lr (the embedding and output layer's peak learning rate)")
    if args.decoupled_lr is not None and not 0 <= (args.decoupled_min_lr or 0.0) <= args.decoupled_lr:
        raise UserError(f"--decoupled-min-lr {args.decoupled_min_lr} must be in [0, --decoupled-lr {args.decoupled_lr}]")
    if args.min_lr < 0 or args.min_lr > args.lr:
        raise UserError(f"--min-lr {args.min_lr} must be in [0, --lr {args.lr}]")
    warmups = [f for f, v in (("--lr-warmup-iters", args.lr_warmup_iters), ("--lr-warmup-samples", args.lr_warmup_samples),
                              ("--lr-warmup-fraction", args.lr_warmup_fraction)) if v]
    if len(warmups) > 1:
        raise UserError(f"{' and '.join(warmups)} are exclusive; give one warm-up")
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction <= 1.0:
        raise UserError(f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None and args.lr_wsd_decay_samples is None:
        raise UserError("--lr-decay-style WSD needs --lr-wsd-decay-iters N (or --lr-wsd-decay-samples N)")
    if args.fp16 and args.loss_scale is not None and args.loss_scale <= 0:
        raise UserError(f"--loss-scale must be > 0, got {args.loss_scale}")
    for beta in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(args, beta) < 1.0:
            raise UserError(f"--{beta.replace('_', '-')} must be in [0, 1), got {getattr(args, beta)}")


def _validate_data(args) -> None:
    has_paths = bool(args.data_path or args.train_data_path)
    if args.mock_data and has_paths:
        raise UserError("--mock-data and --data-path/--train-data-path are exclusive; give one")
    if not args.mock_data and not has_paths:
        raise UserError("no training data: give --data-path PREFIX (made by tools/preprocess_data.py) or --mock-data")
    if args.data_path and args.train_data_path:
        raise UserError("--data-path and --train-data-path are exclusive; give one")
    if args.tokenizer_type is None and args.vocab_file and args.merge_file:
        # a vocab.json with merges.txt is GPT-2's BPE (Megatron's GPT-3 example gives only the two files)
        args.tokenizer_type = "GPT2BPETokenizer"
    if args.tokenizer_type is None:
        raise UserError("--tokenizer-type is required (GPT2BPETokenizer, SentencePieceTokenizer, "
                        "HuggingFaceTokenizer or NullTokenizer)")
    if args.vocab_size is not None and args.tokenizer_type != "NullTokenizer":
        raise UserError(f"--vocab-size only applies to --tokenizer-type NullTokenizer (the {args.tokenizer_type} "
                        "vocabulary comes from its files); remove it")
    if args.split is not None:
        # a job script's "--split '99,1,0'" reaches us with its quotes when word-split unquoted (Megatron
        # reads only the numbers of the string, so it accepts them too)
        args.split = args.split.strip().strip("'\"")
        parts = [x.strip() for x in args.split.replace("/", ",").split(",")]
        try:
            weights = [float(x) for x in parts]
        except ValueError:
            weights = []
        if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise UserError(f'--split {args.split!r} must be up to 3 non-negative weights like "969,30,1"')


def _validate_logging(args) -> None:
    if args.profile and args.profile_step_end <= args.profile_step_start:
        raise UserError(f"--profile-step-end {args.profile_step_end} must be after --profile-step-start "
                        f"{args.profile_step_start}")
    if args.manual_gc_interval and not args.manual_gc:
        raise UserError("--manual-gc-interval needs --manual-gc (without it Python collects on its own schedule)")


def _validate_checkpointing(args) -> None:
    if args.save_interval is not None and not args.save:
        raise UserError("--save-interval needs --save DIR (where to write the checkpoints)")
    for flag, value in (("--finetune", args.finetune), ("--no-load-optim", args.no_load_optim),
                        ("--no-load-rng", args.no_load_rng)):
        if value and not args.load:
            raise UserError(f"{flag} needs --load DIR (the checkpoint to start from)")


def _validate_output_paths(args) -> None:
    """Folders the run will write (checkpoints, logs, metrics) can be written, known before any time is
    spent: a path through an existing file, or below a folder we may not write, is refused. Nothing is
    created here."""
    folders = [("--save", args.save), ("--tensorboard-dir", args.tensorboard_dir),
               ("--wandb-save-dir", args.wandb_save_dir)]
    for flag, path in folders + [("--metrics-file", args.metrics_file)]:
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


# ---- --use-checkpoint-args ----------------------------------------------------------------------------
# model flags (argparse dests) that --use-checkpoint-args takes from the checkpoint's metadata["model"]
CHECKPOINT_MODEL_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
                         "max_position_embeddings", "position_embedding_type", "rotary_base", "normalization",
                         "norm_epsilon", "swiglu", "openai_gelu", "add_bias_linear", "add_qkv_bias",
                         "untie_embeddings_and_output_weights", "rotary_percent", "apply_layernorm_1p")


def apply_checkpoint_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Take the model's architecture (and, when not given, --seq-length and the tokenizer) from the
    --load checkpoint. A model flag given on the command line that contradicts it is an error."""
    if not args.use_checkpoint_args:
        return
    if not args.load:
        raise UserError("--use-checkpoint-args needs --load DIR (the checkpoint whose model flags to use)")
    from megalite.checkpoint.files import ARCHITECTURE_DEFAULTS, CheckpointReader
    reader = CheckpointReader(args.load)
    model = reader.metadata["model"]
    saved = {name: model.get(name, ARCHITECTURE_DEFAULTS.get(name)) for name in CHECKPOINT_MODEL_ARGS}
    gqa = model["num_query_groups"] != model["num_attention_heads"]
    saved.update(group_query_attention=gqa, num_query_groups=model["num_query_groups"] if gqa else None)
    for dest, value in saved.items():
        given = getattr(args, dest)
        if given != parser.get_default(dest) and given != value:
            raise UserError(f"--{dest.replace('_', '-')} {given} contradicts the checkpoint's {value} "
                            f"(--use-checkpoint-args takes model flags from {reader.directory}); remove the flag")
        setattr(args, dest, value)
    args.checkpoint_vocab_size = model["vocab_size"]
    if args.seq_length is None:
        args.seq_length = model["seq_length"]
    tokenizer = reader.metadata.get("tokenizer")
    if args.tokenizer_type is None and tokenizer:
        in_checkpoint = lambda p: p if p is None else os.path.join(reader.directory, p)   # noqa: E731
        args.tokenizer_type = tokenizer["tokenizer_type"]
        args.tokenizer_model = in_checkpoint(tokenizer.get("tokenizer_model"))
        args.vocab_file = in_checkpoint(tokenizer.get("vocab_file"))
        args.merge_file = in_checkpoint(tokenizer.get("merge_file"))
        args.vocab_size = args.vocab_size if args.vocab_size is not None else tokenizer.get("vocab_size")


def check_load_dir(args: argparse.Namespace) -> None:
    """--load names a readable megalite checkpoint (or is the --save directory of a run that has not
    saved yet): known before a process group or a model is built. Reads metadata.json only (JSON;
    nothing is unpickled)."""
    if not args.load or args.use_checkpoint_args:        # apply_checkpoint_args has read it already
        return
    from megalite.checkpoint.files import METADATA, TRACKER, CheckpointReader
    fresh = not any(os.path.isfile(os.path.join(args.load, name)) for name in (TRACKER, METADATA))
    if fresh and args.save and os.path.abspath(args.load) == os.path.abspath(args.save):
        return
    CheckpointReader(args.load)


def _iters(samples: int | None, iters: int | None, global_batch_size: int) -> float | None:
    """Megatron counts schedules in samples when --*-samples flags are used; megalite in iterations."""
    if samples:
        return samples / global_batch_size
    return iters


def world_size_from_env(env=None) -> int:
    """WORLD_SIZE as torchrun sets it (the step's number of tasks under srun), 1 for a plain ``python
    pretrain_gpt.py``, also one inside a SLURM allocation that srun did not start."""
    return read_launch_env(env).world_size


# ---- building the configs --------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None, world_size: int | None = None,
               true_vocab_size: int | None = None) -> MegaliteConfig:
    """argv -> MegaliteConfig. ``true_vocab_size`` (the tokenizer's) sizes the padded vocabulary;
    without it the tokenizer named by the flags is built to find it."""
    world_size = world_size if world_size is not None else world_size_from_env()
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_checkpoint_args(args, parser)
    validate(args, world_size)
    check_load_dir(args)
    data = _data_config(args)
    if true_vocab_size is None:
        from megalite.data.tokenizers import build_tokenizer
        true_vocab_size = build_tokenizer(data).vocab_size
    if args.use_checkpoint_args:
        # a converted model may have more embedding rows than its tokenizer has ids (Qwen2: 151936 for
        # 151646); keep the checkpoint's, the extra ids are simply never seen
        true_vocab_size = max(true_vocab_size, args.checkpoint_vocab_size)
    return MegaliteConfig(model=_model_config(args, true_vocab_size), parallel=_parallel_config(args, world_size),
                          optimizer=_optimizer_config(args), data=data, training=_training_config(args))


def _model_config(args, true_vocab_size: int) -> ModelConfig:
    head_dim = args.kv_channels or args.hidden_size // args.num_attention_heads
    return ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size or default_ffn_hidden_size(args.hidden_size, args.swiglu),
        kv_channels=head_dim,
        num_query_groups=args.num_query_groups if args.group_query_attention else args.num_attention_heads,
        seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings or args.seq_length,
        padded_vocab_size=padded_vocab_size(true_vocab_size, args.make_vocab_size_divisible_by,
                                            args.tensor_model_parallel_size),
        vocab_size=true_vocab_size, position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base, normalization=args.normalization, norm_epsilon=args.norm_epsilon,
        swiglu=args.swiglu, openai_gelu=args.openai_gelu, add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias, untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        init_method_std=args.init_method_std, attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        params_dtype="bfloat16" if args.bf16 else "float16" if args.fp16 else "float32",
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers, rotary_percent=args.rotary_percent,
        apply_layernorm_1p=args.apply_layernorm_1p, cross_entropy_loss_fusion=args.cross_entropy_loss_fusion)


def _parallel_config(args, world_size: int) -> ParallelConfig:
    return ParallelConfig(
        world_size=world_size, tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
        num_virtual_stages_per_pipeline_rank=args.num_virtual_stages_per_pipeline_rank,
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        sequence_parallel=args.sequence_parallel, pipeline_schedule=args.pipeline_schedule,
        use_distributed_optimizer=sharding_strategy(args) != "no_shard",
        overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather,
        data_parallel_sharding_strategy=sharding_strategy(args), ddp_bucket_size=args.ddp_bucket_size,
        grad_reduce_in_bf16=args.grad_reduce_in_bf16, use_torch_fsdp2=args.use_torch_fsdp2,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion)


def train_iters_of(args) -> int:
    """--train-iters, or the whole global batches that fit in --train-samples (following the batch-size
    schedule; a last partial batch is dropped, as Megatron does at constant batch size)."""
    if args.train_iters is not None:
        return args.train_iters
    schedule = getattr(args, "batch_size_schedule", None)
    if not schedule:
        return args.train_samples // args.global_batch_size
    iterations = consumed = 0
    for i, (start, batch) in enumerate(schedule):
        end = schedule[i + 1][0] if i + 1 < len(schedule) else args.train_samples
        while consumed < end and consumed + batch <= args.train_samples:
            consumed += batch
            iterations += 1
    return iterations


def _optimizer_config(args) -> OptimizerConfig:
    gbs = args.global_batch_size
    train_iters = train_iters_of(args)
    decay_iters = _iters(args.lr_decay_samples, args.lr_decay_iters, gbs) or train_iters
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay_iters
    else:
        warmup = _iters(args.lr_warmup_samples, args.lr_warmup_iters, gbs) or 0
    # a run shorter than its warm-up (a smoke test: --train-iters 1) just never finishes warming up;
    # only an explicit decay length that the warm-up overruns is a contradiction
    if warmup > decay_iters and (args.lr_decay_iters or args.lr_decay_samples):
        raise UserError(f"the warm-up ({warmup:g} iterations) is longer than the decay ({decay_iters:g} iterations); "
                        "shorten --lr-warmup-iters or lengthen --lr-decay-iters")
    wsd = _iters(args.lr_wsd_decay_samples, args.lr_wsd_decay_iters, gbs)
    if wsd is not None and wsd > decay_iters:
        raise UserError(f"--lr-wsd-decay-iters ({wsd:g}) exceeds the decay length ({decay_iters:g} iterations)")
    return OptimizerConfig(
        lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad, bf16=args.bf16,
        fp16=args.fp16, loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        lr_decay_style=args.lr_decay_style, lr_decay_iters=decay_iters, lr_warmup_iters=warmup,
        lr_warmup_init=args.lr_warmup_init, lr_wsd_decay_style=args.lr_wsd_decay_style, lr_wsd_decay_iters=wsd,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr if args.decoupled_min_lr is not None else
        (args.min_lr if args.decoupled_lr is not None else None))


def _data_config(args) -> DataConfig:
    return DataConfig(
        data_path=args.data_path, train_data_path=args.train_data_path, valid_data_path=args.valid_data_path,
        test_data_path=args.test_data_path, split=args.split or "969, 30, 1", data_cache_path=args.data_cache_path,
        mock_data=args.mock_data, tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size,
        num_workers=args.num_workers, eod_mask_loss=args.eod_mask_loss, seq_length=args.seq_length,
        mmap_bin_files=args.mmap_bin_files)


def _training_config(args) -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=train_iters_of(args), seed=args.seed, log_interval=args.log_interval,
        eval_interval=args.eval_interval, eval_iters=args.eval_iters, log_throughput=args.log_throughput,
        timing_log_level=args.timing_log_level, tensorboard_dir=args.tensorboard_dir,
        wandb_project=args.wandb_project, wandb_exp_name=args.wandb_exp_name, wandb_save_dir=args.wandb_save_dir,
        metrics_file=args.metrics_file, save=args.save, load=args.load, save_interval=args.save_interval,
        no_load_optim=args.no_load_optim, no_load_rng=args.no_load_rng, finetune=args.finetune,
        use_checkpoint_args=args.use_checkpoint_args, exit_signal_handler=args.exit_signal_handler,
        exit_duration_in_mins=args.exit_duration_in_mins, exit_interval=args.exit_interval,
        skip_nan_iterations=args.skip_nan_iterations, peak_flops=args.peak_flops,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        batch_size_schedule=args.batch_size_schedule, calculate_per_token_loss=args.calculate_per_token_loss,
        log_params_norm=args.log_params_norm, log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        log_timers_to_tensorboard=args.log_timers_to_tensorboard, manual_gc=args.manual_gc,
        manual_gc_interval=args.manual_gc_interval, manual_gc_eval=args.manual_gc_eval,
        empty_unused_memory_level=args.empty_unused_memory_level, profile=args.profile,
        profile_step_start=args.profile_step_start, profile_step_end=args.profile_step_end,
        profile_ranks=list(args.profile_ranks), use_pytorch_profiler=args.use_pytorch_profiler,
        compile=args.compile, tf32=args.tf32)


def compat_flags_used(argv: list[str]) -> list[str]:
    return [f for f in COMPAT_NO_EFFECT if f in argv]
