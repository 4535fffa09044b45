#!/usr/bin/env python
"""Convert checkpoints between Hugging Face and megalite, both ways: Llama, Mistral, Qwen2, Qwen3, Phi-3,
GPT-2 and the Mixture-of-Experts Mixtral, Qwen2-MoE, Qwen3-MoE and GPT-OSS (sinks, alternating windows,
YaRN, biases, clamped quick-GEGLU experts; unquantised weights).

    python tools/convert_checkpoint.py --from hf --to megalite --input HF_DIR --output CKPT_DIR
    python tools/convert_checkpoint.py --from megalite --to hf --input CKPT_DIR --output HF_DIR \\
        [--model-type llama|...|deepseek_v3|glm4_moe] [--export-fp8-blocks] [--overwrite]

HF -> megalite writes CKPT_DIR/iter_0000000 and its tracker file, with the tokenizer files (when the
model directory has them) in iter_0000000/tokenizer; train from it with
``pretrain_gpt.py --load CKPT_DIR --finetune --use-checkpoint-args``.

Block-scaled FP8 weights (DeepSeek-V3's release: float8_e4m3fn with a float32 weight_scale_inv per 128x128
block) are dequantised on import; --export-fp8-blocks writes that form on export.

megalite -> HF writes config.json, model.safetensors and the checkpoint's tokenizer files; the
checkpoint may be a save directory (its latest iteration) or an iter_N directory. --model-type
defaults to the family the checkpoint was converted from, else the one its architecture implies.

The conversion is exact (tensors are renamed, transposed, fused or split, never rounded). Anything
megalite cannot represent (scaled RoPE other than GPT-OSS's YaRN, Llama o_proj/MLP biases, ...) is refused before writing, and
so is an export to a family that cannot hold the checkpoint (an MoE checkpoint as a dense family, a
dense one as an MoE family).
Nothing is overwritten without --overwrite.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.checkpoint.hf_config import SUPPORTED_MODEL_TYPES  # noqa: E402
from megalite.config.cli import OneLineArgumentParser, one_line_errors  # noqa: E402
from megalite.errors import UserError  # noqa: E402

FORMATS = ("hf", "megalite")
MODEL_TYPES = SUPPORTED_MODEL_TYPES


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="tools/convert_checkpoint.py", description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", required=True, choices=FORMATS, help="format of --input")
    parser.add_argument("--to", dest="target", required=True, choices=FORMATS, help="format of --output")
    parser.add_argument("--input", required=True, help="Hugging Face model directory or megalite checkpoint directory")
    parser.add_argument("--output", required=True, help="directory to write")
    parser.add_argument("--model-type", choices=MODEL_TYPES, default=None,
                        help="Hugging Face family to export as (--to hf only); default: the checkpoint's source family")
    parser.add_argument("--export-fp8-blocks", action="store_true", help=(
        "--to hf only: write the layers' linear projections as float8_e4m3fn with a float32 weight_scale_inv "
        "per 128x128 block (DeepSeek-V3's released form); default: the checkpoint's dtype"))
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint or model already in --output")
    return parser


def run(args: argparse.Namespace) -> str:
    if args.source == args.target:
        raise UserError(f"--from {args.source} --to {args.target}: nothing to convert; use --from hf --to megalite "
                        "or --from megalite --to hf")
    if args.model_type is not None and args.target != "hf":
        raise UserError("--model-type applies to --to hf only (the HF family to export as)")
    if args.export_fp8_blocks and args.target != "hf":
        raise UserError("--export-fp8-blocks applies to --to hf only (FP8 checkpoints are read without a flag)")
    if os.path.abspath(args.input) == os.path.abspath(args.output):
        raise UserError(f"--output {args.output} is the --input directory; choose another directory")
    from megalite.checkpoint.hf import hf_to_megalite, megalite_to_hf
    if args.target == "megalite":
        return hf_to_megalite(args.input, args.output, overwrite=args.overwrite)
    return megalite_to_hf(args.input, args.output, model_type=args.model_type, overwrite=args.overwrite,
                          fp8_blocks=args.export_fp8_blocks)


@one_line_errors
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        written = run(args)
    except KeyboardInterrupt:
        print("interrupted: the output may be incomplete; run again with --overwrite", file=sys.stderr, flush=True)
        return 1
    print(f" > converted {args.source} {args.input} -> {args.target} {written}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
