#!/usr/bin/env python
"""Tokenize a text corpus into Megatron .bin/.idx files (one document per JSON line / row).

    python tools/preprocess_data.py --input 'data/*.jsonl' --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/sp.model --append-eod --workers 2

Inputs: JSON lines (any extension except the ones below), Parquet (.parquet), Arrow IPC (.arrow)
and ``datasets.save_to_disk`` folders; several files by repeating --input or by glob. Output per
--json-keys key: ``{output_prefix}_{key}_document.bin/.idx``, byte-compatible with Megatron-LM.

Nothing is overwritten unless --overwrite; outputs are written under temporary names and renamed
into place at the end, so an error or Ctrl-C leaves no partial dataset. A malformed JSON line or a
line without the key stops the run with its file and line number, unless --skip-bad-lines.
"""
from __future__ import annotations

import collections
import glob
import itertools
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from megalite.config.cli import OneLineArgumentParser, one_line_errors  # noqa: E402
from megalite.config.schema import DataConfig  # noqa: E402
from megalite.data.indexed_dataset import (DTYPE_NAMES, IndexedDatasetBuilder, best_dtype,  # noqa: E402
                                           check_vocab_fits, data_file_path, index_file_path)
from megalite.data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from megalite.errors import UserError  # noqa: E402

BATCH_BYTES = 1 << 18      # a worker task is about this much text ...
BATCH_DOCS = 256           # ... or this many documents
RECORD_FORMATS = {".parquet": "parquet", ".arrow": "arrow"}


# ------------------------------------------------------------------------------------------ input
def expand_inputs(patterns: list[str]) -> list[str]:
    files: list[str] = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            if not _is_saved_dataset(pattern):
                raise UserError(f"--input {pattern} is a folder but not a datasets.save_to_disk folder; "
                                f"pass files or a glob like '{os.path.join(pattern, '*.jsonl')}'")
            files.append(pattern)
            continue
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else (
            [pattern] if os.path.exists(pattern) else [])
        if not matches:
            raise UserError(f"--input {pattern}: no such file" + (" (the glob matches nothing)"
                                                                   if glob.has_magic(pattern) else ""))
        files.extend(matches)
    return list(dict.fromkeys(files))


def _is_saved_dataset(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json"))


def input_format(path: str) -> str:
    if os.path.isdir(path):
        return "saved"
    return RECORD_FORMATS.get(os.path.splitext(path)[1].lower(), "jsonl")


def _jsonl_batches(path: str):
    batch, size = [], 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            batch.append((lineno, line))
            size += len(line)
            if size >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
                yield ("jsonl", path, batch, size)
                batch, size = [], 0
    if batch:
        yield ("jsonl", path, batch, size)


def _record_batches(path: str, fmt: str, keys: list[str]):
    """Batches of (row number, {key: value}) from Parquet, Arrow or a saved datasets folder."""
    if fmt == "saved":
        import datasets

        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            raise UserError(f"--input {path} holds several splits ({', '.join(ds)}); pass one, "
                            f"e.g. {os.path.join(path, next(iter(ds)))}")
        columns = ds.column_names
        batches = (b for b in ds.select_columns([k for k in keys if k in columns]).iter(batch_size=BATCH_DOCS))
    else:
        import pyarrow as pa

        if fmt == "parquet":
            import pyarrow.parquet as pq

            try:
                pf = pq.ParquetFile(path)
            except Exception as e:
                raise UserError(f"--input {path}: not a readable Parquet file ({e})")
            columns = pf.schema_arrow.names
            batches = (b.to_pydict() for b in pf.iter_batches(batch_size=BATCH_DOCS,
                                                                columns=[k for k in keys if k in columns]))
        else:
            reader = None
            for opener in (pa.ipc.open_file, pa.ipc.open_stream):
                try:
                    reader = opener(path)
                    break
                except Exception:
                    continue
            if reader is None:
                raise UserError(f"--input {path}: not an Arrow IPC file or stream")
            columns = reader.schema.names
            if isinstance(reader, pa.ipc.RecordBatchFileReader):
                record_batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                record_batches = iter(reader)
            batches = (b.select([k for k in keys if k in columns]).to_pydict() for b in record_batches)
    missing = [k for k in keys if k not in columns]
    if missing:
        raise UserError(f"--input {path} has no column {missing[0]!r} (columns: {', '.join(columns)}); "
                        "choose the text column with --json-keys")
    row = 0
    for b in batches:
        n = len(b[keys[0]])
        items = [(row + i + 1, {k: b[k][i] for k in keys}) for i in range(n)]
        row += n
        size = sum(len(v) for _, rec in items for v in rec.values() if isinstance(v, str))
        yield ("records", path, items, size)


def read_batches(files: list[str], keys: list[str]):
    for path in files:
        fmt = input_format(path)
        if fmt == "jsonl":
            yield from _jsonl_batches(path)
        else:
            yield from _record_batches(path, fmt, keys)


def total_input_bytes(files: list[str]):
    if all(input_format(f) == "jsonl" for f in files):
        return sum(os.path.getsize(f) for f in files)
    return None


# ----------------------------------------------------------------------------------------- worker
class Encoder:
    """Turns one batch of raw lines/records into token arrays (runs in a worker process)."""

    def __init__(self, tokenizer, keys: list[str], append_eod: bool, dtype):
        self.tokenizer = tokenizer
        self.keys = keys
        self.append_eod = append_eod
        self.dtype = np.dtype(dtype)
        self.vocab_size = tokenizer.vocab_size
        self.eod = tokenizer.eod

    def _tokenize(self, texts: list[str], path: str, linenos: list[int]) -> list[list[int]]:
        try:
            return self.tokenizer.tokenize_batch(texts)
        except (ValueError, TypeError) as batch_error:   # e.g. NullTokenizer given words instead of ids
            where, error = path, batch_error
            for text, lineno in zip(texts, linenos):      # the first document that fails, for the message
                try:
                    self.tokenizer.tokenize(text)
                except (ValueError, TypeError) as e:
                    where, error = f"{path}:{lineno}", e
                    break
            reason = " ".join(str(error).split())[:200]
            raise UserError(f"{where}: {type(self.tokenizer).__name__} cannot tokenize this text ({reason}); "
                            "is --tokenizer-type right for this input?") from None

    def encode(self, batch):
        kind, path, items, nbytes = batch
        texts = {k: [] for k in self.keys}
        errors, docs, linenos = [], 0, []
        for lineno, raw in items:
            if kind == "jsonl":
                try:
                    record = json.loads(raw)
                except ValueError as e:
                    errors.append((path, lineno, f"malformed JSON ({e})"))
                    continue
                if not isinstance(record, dict):
                    errors.append((path, lineno, f"expected a JSON object, found {type(record).__name__}"))
                    continue
            else:
                record = raw
            bad = None
            for k in self.keys:
                value = record.get(k)
                if value is None and k in record:
                    bad = f"value of {k!r} is null, not a string"
                elif value is None:
                    present = ", ".join(list(record)[:8]) or "none"
                    bad = f"no key {k!r} (keys present: {present}); choose the text key with --json-keys"
                elif not isinstance(value, str):
                    bad = f"value of {k!r} is {type(value).__name__}, not a string"
                if bad:
                    break
            if bad:
                errors.append((path, lineno, bad))
                continue
            for k in self.keys:
                texts[k].append(record[k])
            linenos.append(lineno)
            docs += 1
        out, tokens, empty = {}, 0, 0
        for k in self.keys:
            ids = [d for d in self._tokenize(texts[k], path, linenos) if len(d)] if texts[k] else []
            empty += len(texts[k]) - len(ids)
            if self.append_eod:
                for d in ids:
                    d.append(self.eod)
            lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
            if flat.size:
                hi, lo = int(flat.max()), int(flat.min())
                if hi >= self.vocab_size or lo < 0:
                    raise UserError(f"the tokenizer produced id {hi if hi >= self.vocab_size else lo} outside "
                                    f"its vocabulary of {self.vocab_size}; check the tokenizer files")
                if hi > np.iinfo(self.dtype).max:
                    raise UserError(f"token id {hi} does not fit in dtype {self.dtype.name}: vocab too large for "
                                    "the dtype; use --dtype int32")
            out[k] = (flat.astype(self.dtype), lengths)
            tokens += flat.size
        return {"arrays": out, "docs": docs, "bytes": nbytes, "tokens": tokens, "errors": errors, "empty": empty}


_ENCODER: Encoder | None = None


def _init_worker(config: DataConfig, keys, append_eod, dtype_name):
    global _ENCODER
    _ENCODER = Encoder(build_tokenizer(config), keys, append_eod, dtype_name)


def _encode_in_worker(batch):
    try:
        return _ENCODER.encode(batch)
    except UserError as e:
        return {"fatal": str(e)}


def ordered_results(batches, workers: int, encoder: Encoder, init_args):
    """Encoded batches in input order; at most 4 tasks per worker in flight (bounded memory)."""
    if workers <= 1:
        for b in batches:
            yield encoder.encode(b)
        return
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    pool = ctx.Pool(workers, initializer=_init_worker, initargs=init_args)
    try:
        pending = collections.deque()
        for b in batches:
            pending.append(pool.apply_async(_encode_in_worker, (b,)))
            while len(pending) >= 4 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
    finally:
        pool.terminate()
        pool.join()


# --------------------------------------------------------------------------------------- progress
class Progress:
    """tqdm bar on a terminal; otherwise a line per --log-interval documents (at most one a second)."""

    def __init__(self, total_bytes, log_interval: int):
        self.start = self.last_print = time.time()
        self.docs = self.bytes = self.tokens = self.last_docs = 0
        self.log_interval = log_interval
        self.total = total_bytes
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing",
                                dynamic_ncols=True)
            except ImportError:
                pass

    def rates(self) -> str:
        dt = max(time.time() - self.start, 1e-9)
        return (f"{self.docs / dt:,.0f} docs/s, {self.bytes / dt / 1e6:.2f} MB/s, "
                f"{self.tokens / dt:,.0f} tokens/s")

    def update(self, docs: int, nbytes: int, tokens: int) -> None:
        self.docs += docs
        self.bytes += nbytes
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(nbytes)
            dt = max(time.time() - self.start, 1e-9)
            self.bar.set_postfix_str(f"{self.docs:,} docs, {self.docs / dt:,.0f} docs/s, "
                                     f"{self.tokens / dt:,.0f} tokens/s", refresh=False)
        elif self.docs - self.last_docs >= self.log_interval and time.time() - self.last_print >= 1.0:
            pct = f" ({100 * self.bytes / self.total:.0f}%)" if self.total else ""
            print(f"processed {self.docs:,} documents{pct}: {self.rates()}", flush=True)
            self.last_docs, self.last_print = self.docs, time.time()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------------------------- main
def get_args(argv=None):
    p = OneLineArgumentParser(prog="tools/preprocess_data.py",
                              description="Tokenize JSONL/Parquet/Arrow text into Megatron .bin/.idx files.")
    g = p.add_argument_group("input")
    g.add_argument("--input", nargs="+", required=True,
                   help="files, globs or datasets.save_to_disk folders (JSONL unless .parquet/.arrow)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys/columns to tokenize (default: text)")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed JSON lines and records without a --json-keys string (counted and reported)")
    g.add_argument("--split-sentences", action="store_true", help="not supported by megalite")
    g.add_argument("--keep-newlines", action="store_true", help="accepted for compatibility (no effect)")
    g.add_argument("--lang", default="english", help="accepted for compatibility (no effect)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece .model, or a local Hugging Face folder")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document id to every document")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True,
                   help="writes {prefix}_{key}_document.bin/.idx for every --json-keys key")
    g.add_argument("--dtype", default="auto", choices=["auto"] + sorted(DTYPE_NAMES),
                   help="token dtype (auto: uint16 below 65500 ids, else int32, as Megatron)")
    g.add_argument("--overwrite", action="store_true", help="replace existing output files")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (1: tokenize in this process)")
    g.add_argument("--partitions", type=int, default=1, help="accepted for compatibility (no effect)")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="accepted for compatibility (documents always keep their input order)")
    g.add_argument("--log-interval", type=int, default=100, help="documents between progress lines")
    return p.parse_args(argv)


def output_prefix_for(prefix: str, key: str) -> str:
    return f"{prefix}_{key}_document"


def preprocess(args) -> dict:
    if args.split_sentences:
        raise UserError("--split-sentences is not supported by megalite (GPT training uses whole documents); "
                        "drop the flag")
    if args.workers < 1:
        raise UserError(f"--workers {args.workers} must be at least 1")
    keys = list(dict.fromkeys(args.json_keys))
    outputs = {k: output_prefix_for(args.output_prefix, k) for k in keys}
    existing = [path for prefix in outputs.values() for path in (data_file_path(prefix), index_file_path(prefix))
                if os.path.exists(path)]
    if existing and not args.overwrite:
        raise UserError(f"{existing[0]} already exists; pass --overwrite to replace it, or choose another "
                        "--output-prefix")
    files = expand_inputs(args.input)
    config = DataConfig(tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                        vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size)
    tokenizer = build_tokenizer(config)
    if args.dtype == "auto":
        dtype = np.dtype(best_dtype(tokenizer.vocab_size))
    else:
        dtype = np.dtype(DTYPE_NAMES[args.dtype])
        if dtype.kind not in "iu":
            raise UserError(f"--dtype {args.dtype}: token ids need an integer dtype")
        check_vocab_fits(tokenizer.vocab_size, dtype, f"--tokenizer-type {args.tokenizer_type}")
    if args.workers > 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"tokenizing {len(files)} input(s) with {args.tokenizer_type} (vocab {tokenizer.vocab_size}, eod "
          f"{tokenizer.eod}) into {', '.join(p + '.{bin,idx}' for p in outputs.values())} as {dtype.name}, "
          f"{args.workers} worker(s)", flush=True)

    builders = {k: IndexedDatasetBuilder(p, dtype) for k, p in outputs.items()}
    encoder = Encoder(tokenizer, keys, args.append_eod, dtype)
    progress = Progress(total_input_bytes(files), args.log_interval)
    skipped, empty, first_skip = 0, 0, None
    try:
        init_args = (config, keys, args.append_eod, dtype.name)
        for result in ordered_results(read_batches(files, keys), args.workers, encoder, init_args):
            if "fatal" in result:
                raise UserError(result["fatal"])
            if result["errors"]:
                if not args.skip_bad_lines:
                    path, lineno, msg = result["errors"][0]
                    raise UserError(f"{path}:{lineno}: {msg}; fix the line or pass --skip-bad-lines")
                skipped += len(result["errors"])
                first_skip = first_skip or result["errors"][0]
            empty += result["empty"]
            for k, (flat, lengths) in result["arrays"].items():
                builders[k].add_documents(flat, lengths)
            progress.update(result["docs"], result["bytes"], result["tokens"])
        progress.close()
        if progress.docs == 0 or all(b.num_documents == 0 for b in builders.values()):
            what = f" ({skipped} bad lines skipped)" if skipped else ""
            raise UserError(f"no documents found in --input {' '.join(args.input)}{what}: the input is empty")
        for b in builders.values():
            b.finalize()
    except BaseException:
        progress.close()
        for b in builders.values():
            b.abort()
        raise
    elapsed = time.time() - progress.start
    print(f"done: {progress.docs:,} documents, {progress.tokens:,} tokens, {progress.bytes / 1e6:.1f} MB in "
          f"{elapsed:.1f} s ({progress.rates()})", flush=True)
    if skipped:
        path, lineno, msg = first_skip
        print(f"skipped {skipped} bad line(s) (--skip-bad-lines); first: {path}:{lineno}: {msg}", flush=True)
    if empty:
        print(f"skipped {empty} empty document(s) (no tokens)", flush=True)
    for k, p in outputs.items():
        print(f"wrote {p}.bin / {p}.idx: {builders[k].num_documents:,} documents, {builders[k].num_tokens:,} "
              f"tokens; train with --data-path {p}", flush=True)
    return {"docs": progress.docs, "tokens": progress.tokens, "bytes": progress.bytes, "seconds": elapsed,
            "skipped": skipped, "empty": empty, "outputs": outputs}


@one_line_errors
def main(argv=None) -> int:
    args = get_args(argv)
    try:
        preprocess(args)
    except KeyboardInterrupt:
        print("interrupted: no output written", file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
