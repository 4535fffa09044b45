"""pretrain_gpt.py's command line to a MegaliteConfig, with what the flags alone do not give: the world
size from the launcher's environment (or the world a rank without peers plays), the model flags of a --load
checkpoint under --use-checkpoint-args, a check that --load is a readable checkpoint, and the tokenizer's
vocabulary size. config/megatron_cli.py maps the flags and checks them; this module reads the outside
world around it. It imports no torch (the flags are checked before torch loads); the checkpoint and
tokenizer modules load only when a flag needs them.
"""
from __future__ import annotations

import argparse
import os

from megalite.config.megatron_cli import build_parser, config_from_args, with_vocabulary
from megalite.config.schema import MegaliteConfig, TrainingConfig
from megalite.errors import UserError
from megalite.parallel.launch_env import launched_world_size, read_launch_env

# the architecture fields --use-checkpoint-args does not take as they are (files.ARCHITECTURE_FIELDS has the
# rest): the vocabulary comes with the tokenizer, GQA through its two flags, and --seq-length only when absent
NOT_CHECKPOINT_MODEL_ARGS = ("vocab_size", "num_query_groups", "seq_length")


def parse_args(argv: list[str] | None = None, world_size: int | None = None,
               true_vocab_size: int | None = None) -> MegaliteConfig:
    """argv -> MegaliteConfig. ``true_vocab_size`` (the tokenizer's) sizes the padded vocabulary;
    without it the tokenizer named by the flags is built to find it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if world_size is None:
        world_size = launched_world_size(args, world_size_from_env)
    checkpoint_vocab_size = apply_checkpoint_args(args, parser)
    config = config_from_args(args, world_size)
    check_load_dir(config.training)
    if true_vocab_size is None:
        from megalite.data.tokenizers import build_tokenizer
        true_vocab_size = build_tokenizer(config.data).vocab_size
    if checkpoint_vocab_size is not None:
        # a converted model may have more embedding rows than its tokenizer has ids (Qwen2: 151936 for
        # 151646); keep the checkpoint's, the extra ids are simply never seen
        true_vocab_size = max(true_vocab_size, checkpoint_vocab_size)
    return with_vocabulary(config, true_vocab_size, args.make_vocab_size_divisible_by)


def world_size_from_env(env=None) -> int:
    """WORLD_SIZE as torchrun sets it (the step's number of tasks under srun), 1 for a plain ``python
    pretrain_gpt.py``, also one inside a SLURM allocation that srun did not start."""
    return read_launch_env(env).world_size


def apply_checkpoint_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int | None:
    """Take the model's architecture (and, when not given, --seq-length and the tokenizer) from the
    --load checkpoint; returns the checkpoint's vocabulary size (None without --use-checkpoint-args). A
    model flag given on the command line that contradicts it is an error."""
    if not args.use_checkpoint_args:
        return None
    if not args.load:
        raise UserError("--use-checkpoint-args needs --load DIR (the checkpoint whose model flags to use)")
    from megalite.checkpoint.files import ARCHITECTURE_DEFAULTS, ARCHITECTURE_FIELDS, CheckpointReader
    reader = CheckpointReader(args.load)
    model = reader.metadata["model"]
    saved = {name: model.get(name, ARCHITECTURE_DEFAULTS.get(name)) for name in ARCHITECTURE_FIELDS
             if name not in NOT_CHECKPOINT_MODEL_ARGS}
    gqa = model["num_query_groups"] != model["num_attention_heads"]
    saved.update(group_query_attention=gqa, num_query_groups=model["num_query_groups"] if gqa else None)
    values = vars(args)
    for dest, value in saved.items():
        given = values[dest]
        if given != parser.get_default(dest) and given != value:
            raise UserError(f"--{dest.replace('_', '-')} {given} contradicts the checkpoint's {value} "
                            f"(--use-checkpoint-args takes model flags from {reader.directory}); remove the flag")
        values[dest] = value
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
    return model["vocab_size"]


def check_load_dir(t: TrainingConfig) -> None:
    """--load names a readable megalite checkpoint (or is the --save directory of a run that has not
    saved yet): known before a process group or a model is built. Reads metadata.json only (JSON;
    nothing is unpickled). With --use-checkpoint-args the command line has read it already."""
    if not t.load or t.use_checkpoint_args:
        return
    from megalite.checkpoint.files import METADATA, TRACKER, CheckpointReader
    fresh = not any(os.path.isfile(os.path.join(t.load, name)) for name in (TRACKER, METADATA))
    if fresh and t.save and os.path.abspath(t.load) == os.path.abspath(t.save):
        return
    CheckpointReader(t.load)
