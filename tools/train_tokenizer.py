#!/usr/bin/env python
"""Train a SentencePiece tokenizer (BPE by default) on JSONL or plain-text files.

    python tools/train_tokenizer.py --input data/stdlib.jsonl --vocab-size 4096 --output-prefix data/stdlib_sp

writes ``data/stdlib_sp.model`` (use it with ``--tokenizer-type SentencePieceTokenizer
--tokenizer-model data/stdlib_sp.model``) and ``data/stdlib_sp.vocab``.

The model keeps text byte-exact (identity normalisation, whitespace kept, byte fallback), which
suits source code: detokenize(tokenize(text)) == text. Documents are cut into paragraphs (at blank
lines, so pieces may span a newline and indentation) and at most --max-sentences of them, sampled
at random by SentencePiece, train the model; that keeps training to seconds on large inputs.
Special ids: unk 0, bos 1, eos 2 (the end-of-document id), no pad.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config.cli import OneLineArgumentParser, one_line_errors  # noqa: E402
from megalite.errors import UserError  # noqa: E402


def iter_texts(files: list[str], keys: list[str]):
    """Texts of JSONL files (the --json-keys values) or of plain text files (whole file)."""
    for path in files:
        if path.endswith((".jsonl", ".json")):
            with open(path, "rb") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as e:
                        raise UserError(f"{path}:{lineno}: malformed JSON ({e})")
                    if not isinstance(record, dict):
                        raise UserError(f"{path}:{lineno}: expected a JSON object")
                    for k in keys:
                        value = record.get(k)
                        if not isinstance(value, str):
                            raise UserError(f"{path}:{lineno}: no string under key {k!r}; choose it with --json-keys")
                        yield value
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()


def paragraphs(texts, max_bytes: int):
    """Blank-line separated chunks, long ones cut at line boundaries to at most ``max_bytes``."""
    for text in texts:
        for para in text.split("\n\n"):
            if not para.strip():
                continue
            para += "\n"
            if len(para.encode("utf-8")) <= max_bytes:
                yield para
                continue
            chunk = ""
            for line in para.splitlines(keepends=True):
                if chunk and len((chunk + line).encode("utf-8")) > max_bytes:
                    yield chunk
                    chunk = ""
                chunk += line[: max_bytes // 4] if len(line.encode("utf-8")) > max_bytes else line
            if chunk.strip():
                yield chunk


def train(args) -> str:
    import glob

    import sentencepiece as spm

    files = []
    for pattern in args.input:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else (
            [pattern] if os.path.isfile(pattern) else [])
        if not matches:
            raise UserError(f"--input {pattern}: no such file")
        files += matches
    outputs = [args.output_prefix + ext for ext in (".model", ".vocab")]
    if any(os.path.exists(p) for p in outputs) and not args.overwrite:
        raise UserError(f"{outputs[0]} already exists; pass --overwrite to replace it")
    if args.vocab_size < 260:
        raise UserError(f"--vocab-size {args.vocab_size} is too small: byte fallback alone needs 259 ids")
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)

    counted = {"n": 0, "bytes": 0}

    def sentences():
        for p in paragraphs(iter_texts(files, args.json_keys), args.max_sentence_length):
            counted["n"] += 1
            counted["bytes"] += len(p)
            yield p

    start = time.time()
    print(f"training a SentencePiece {args.model_type} tokenizer, vocab {args.vocab_size}, on {len(files)} file(s) "
          f"(sampling at most {args.max_sentences:,} paragraphs)", flush=True)
    tmp_prefix = f"{args.output_prefix}.tmp{os.getpid()}"
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(), model_prefix=tmp_prefix, vocab_size=args.vocab_size,
            model_type=args.model_type, input_sentence_size=args.max_sentences, shuffle_input_sentence=True,
            num_threads=args.threads, character_coverage=args.character_coverage, byte_fallback=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
            split_digits=True, max_sentence_length=args.max_sentence_length, unk_id=0, bos_id=1, eos_id=2,
            pad_id=-1, minloglevel=2)
    except RuntimeError as e:
        for ext in (".model", ".vocab"):
            if os.path.exists(tmp_prefix + ext):
                os.remove(tmp_prefix + ext)
        msg = " ".join(str(e).split()) or "no reason given"
        if "] " in msg:  # drop SentencePiece's source location / assertion text
            msg = msg.rsplit("] ", 1)[1]
        if counted["n"] == 0:
            raise UserError(f"--input {' '.join(args.input)}: no text to train on (empty input)")
        hint = " (try a smaller --vocab-size or more input text)" if "too high" in msg.lower() else ""
        raise UserError(f"SentencePiece training failed: {msg}{hint}".replace("--character_coverage",
                                                                               "--character-coverage"))
    if counted["n"] == 0:
        raise UserError(f"--input {' '.join(args.input)}: no text to train on (empty input)")
    for ext in (".model", ".vocab"):
        os.replace(tmp_prefix + ext, args.output_prefix + ext)
    print(f"wrote {outputs[0]} and {outputs[1]} from {counted['n']:,} paragraphs ({counted['bytes'] / 1e6:.1f} MB) "
          f"in {time.time() - start:.1f} s; use --tokenizer-type SentencePieceTokenizer --tokenizer-model {outputs[0]}",
          flush=True)
    return outputs[0]


@one_line_errors
def main(argv=None) -> int:
    p = OneLineArgumentParser(
        prog="tools/train_tokenizer.py",
        description="Train a SentencePiece tokenizer for --tokenizer-type SentencePieceTokenizer.")
    p.add_argument("--input", nargs="+", required=True, help="JSONL (.jsonl/.json) or plain text files, globs allowed")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSONL keys holding the text (default: text)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--max-sentences", type=int, default=200_000,
                   help="paragraphs sampled for training (default 200000)")
    p.add_argument("--max-sentence-length", type=int, default=8192, help="longest paragraph in bytes")
    p.add_argument("--character-coverage", type=float, default=0.9999)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.model/.vocab")
    train(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
