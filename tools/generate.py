#!/usr/bin/env python
"""Generate text from a megalite checkpoint (one process, KV cache), printing prompt + completion.

    python tools/generate.py --load runs/llama/checkpoints --prompt "Once upon a time" --max-new-tokens 64
    python tools/generate.py --load ckpt --prompt "def main(" --temperature 0.8 --top-k 50 --top-p 0.95 --seed 1
    python tools/generate.py --load ckpt --prompt "1 2 3" --greedy

--load is a save directory (its latest iteration) or one iter_N directory, written by training or by
the Hugging Face converter. The tokenizer is the one recorded in the checkpoint's metadata.json
(relative paths are relative to the iteration directory); --tokenizer-type and its file flags
replace it. Generation stops after --max-new-tokens or at the tokenizer's end-of-document token
(unless --ignore-eod).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite.config.cli import OneLineArgumentParser, one_line_errors  # noqa: E402
from megalite.config.schema import DataConfig  # noqa: E402
from megalite.data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from megalite.errors import UserError  # noqa: E402
from megalite.model.generation import check_sampling, generate  # noqa: E402


def get_args(argv=None) -> argparse.Namespace:
    p = OneLineArgumentParser(prog="tools/generate.py", description="Generate text from a megalite checkpoint.")
    p.add_argument("--load", required=True, help="checkpoint save directory or iter_N directory")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="at most this many new tokens (default 64)")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token (no sampling)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, > 0 (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1: all)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible output")
    p.add_argument("--ignore-eod", action="store_true", help="do not stop at the end-of-document token")
    p.add_argument("--device", default="cpu", help="torch device to run on (default cpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="compute dtype (default float32)")
    t = p.add_argument_group("tokenizer (default: the one recorded in the checkpoint)")
    t.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    t.add_argument("--tokenizer-model", default=None)
    t.add_argument("--vocab-file", default=None)
    t.add_argument("--merge-file", default=None)
    t.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    return p.parse_args(argv)


def tokenizer_config(args: argparse.Namespace, metadata: dict, iteration_dir: str) -> DataConfig:
    """The command line's tokenizer when --tokenizer-type is given, else the checkpoint's."""
    recorded = metadata.get("tokenizer") or {}
    if args.tokenizer_type is not None:
        vocab_size = args.vocab_size if args.vocab_size is not None else recorded.get("vocab_size")
        return DataConfig(tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                          vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=vocab_size)
    if not recorded.get("tokenizer_type"):
        raise UserError(f"checkpoint {iteration_dir} records no tokenizer; pass --tokenizer-type (and its "
                        "--tokenizer-model / --vocab-file / --merge-file / --vocab-size)")

    def resolve(path):
        return os.path.join(iteration_dir, path) if path and not os.path.isabs(path) else path
    return DataConfig(tokenizer_type=recorded["tokenizer_type"], tokenizer_model=resolve(recorded.get("tokenizer_model")),
                      vocab_file=resolve(recorded.get("vocab_file")), merge_file=resolve(recorded.get("merge_file")),
                      vocab_size=recorded.get("vocab_size"))


def completion_text(tokenizer, prompt: str, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The prompt as typed plus the completion's text (decoded in context, so a leading space or a
    character split across tokens comes out right)."""
    before, after = tokenizer.detokenize(prompt_ids), tokenizer.detokenize(prompt_ids + new_ids)
    completion = after[len(before):] if after.startswith(before) else tokenizer.detokenize(new_ids)
    return prompt + completion


def run(args: argparse.Namespace) -> str:
    from megalite.checkpoint.sharded import load_model

    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} must be >= 0")
    check_sampling(args.temperature, args.top_k, args.top_p, args.greedy)
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise UserError(f"--device {args.device}: {str(e).splitlines()[0]}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}: CUDA is not available here; use --device cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model = load_model(args.load, dtype=dtype, device=device)
    tokenizer = build_tokenizer(tokenizer_config(args, model.checkpoint_metadata, model.checkpoint_dir))
    try:
        prompt_ids = tokenizer.tokenize(args.prompt)
    except ValueError as e:
        raise UserError(f"--prompt cannot be tokenized by {type(tokenizer).__name__} ({e})") from None
    new_ids = generate(model, prompt_ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, greedy=args.greedy, eos_id=None if args.ignore_eod else tokenizer.eod,
                       seed=args.seed)
    return completion_text(tokenizer, args.prompt, prompt_ids, new_ids)


@one_line_errors
def main(argv=None) -> int:
    args = get_args(argv)
    try:
        text = run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return 130
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
