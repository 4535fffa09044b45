#!/usr/bin/env python
"""Join several Megatron .bin/.idx datasets into one, in the given order.

    python tools/merge_datasets.py --input data/part_a_text_document data/part_b_text_document \\
        --output-prefix data/all_text_document
    python tools/merge_datasets.py --input data/parts/ --output-prefix data/all_text_document

--input takes prefixes, or (as Megatron's tool) one folder whose every PREFIX.bin/.idx pair is
merged in sorted order. All inputs must share one token dtype. Existing outputs are kept unless
--overwrite; the output appears only once it is complete.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder, data_file_path,  # noqa: E402
                                           index_file_path, normalize_prefix)
from megalite.config.cli import OneLineArgumentParser, one_line_errors  # noqa: E402
from megalite.errors import UserError  # noqa: E402


def input_prefixes(inputs: list[str]) -> list[str]:
    prefixes = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(item, f[:-4]) for f in os.listdir(item) if f.endswith(".idx"))
            if not found:
                raise UserError(f"--input {item}: the folder holds no .idx files")
            prefixes += found
        else:
            prefixes.append(normalize_prefix(item))
    return prefixes


def merge(inputs: list[str], output_prefix: str, overwrite: bool = False) -> IndexedDatasetBuilder:
    prefixes = input_prefixes(inputs)
    if os.path.abspath(output_prefix) in {os.path.abspath(p) for p in prefixes}:
        raise UserError(f"--output-prefix {output_prefix} is also an input; choose a new prefix")
    existing = [p for p in (data_file_path(output_prefix), index_file_path(output_prefix)) if os.path.exists(p)]
    if existing and not overwrite:
        raise UserError(f"{existing[0]} already exists; pass --overwrite to replace it")
    datasets = [IndexedDataset(p) for p in prefixes]  # validates every input before writing
    dtypes = {d.dtype for d in datasets}
    if len(dtypes) > 1:
        raise UserError("inputs have different token dtypes (" + ", ".join(f"{d.prefix}: {d.dtype.name}"
                                                                            for d in datasets) +
                        "); re-tokenize them with one tokenizer")
    builder = IndexedDatasetBuilder(output_prefix, datasets[0].dtype)
    try:
        for d in datasets:
            builder.add_index(d.prefix)
        builder.finalize()
    except BaseException:
        builder.abort()
        raise
    return builder


@one_line_errors
def main(argv=None) -> int:
    p = OneLineArgumentParser(prog="tools/merge_datasets.py", description="Merge Megatron .bin/.idx datasets into one.")
    p.add_argument("--input", nargs="+", required=True, help="dataset prefixes, or one folder of them")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    start = time.time()
    args = p.parse_args(argv)
    builder = merge(args.input, args.output_prefix, args.overwrite)
    print(f"wrote {args.output_prefix}.bin / .idx: {builder.num_documents:,} documents, {builder.num_tokens:,} "
          f"tokens from {len(input_prefixes(args.input))} inputs in {time.time() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
