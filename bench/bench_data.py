#!/usr/bin/env python
"""Data-pipeline benchmarks, measured side by side in one run; writes a section of bench/RESULTS.md.

1. Preprocessing throughput vs the bare tokenizer on the same text (the Python standard library as
   JSONL, a SentencePiece BPE tokenizer): tools/preprocess_data.py with 1 and 2 workers against
   ``tokenize_batch`` over the same documents already in memory. Goal: pipeline overhead <= 15% with
   one worker, near-linear scaling in workers.
2. GPT index building (document/sample/shuffle indices) for a synthetic dataset of 1e9 tokens in
   1e7 documents (only the document lengths are needed, so nothing is written to disk). Goal: seconds.
3. Blending indices per sample, and GPTDataset item reads per second on the tokenized corpus.

    python bench/bench_data.py [--repeats 3] [--docs 1e7] [--tokens 1e9] [--no-write]
    python bench/bench_data.py --quick    # smoke test: 3 MB corpus, 1e8 tokens / 1e6 documents, best of 1
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import numpy as np  # noqa: E402

import preprocess_data  # noqa: E402
import stdlib_corpus  # noqa: E402
import train_tokenizer  # noqa: E402
from megalite.config.schema import DataConfig  # noqa: E402
from megalite.data.blended_dataset import build_blending_indices  # noqa: E402
from megalite.data.gpt_dataset import (GPTDataset, build_document_index, build_sample_index,  # noqa: E402
                                       build_shuffle_index)
from megalite.data.indexed_dataset import IndexedDataset  # noqa: E402
from megalite.data.tokenizers import build_tokenizer  # noqa: E402


def best_of(repeats: int, fn):
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (worker processes)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def bench_preprocess(workdir: str, repeats: int, corpus_mb: float) -> dict:
    corpus = os.path.join(workdir, "stdlib.jsonl")
    stdlib_corpus.write_corpus(corpus, max_mb=corpus_mb, include_tests=False)
    tok_prefix = os.path.join(workdir, "sp")
    with open(os.devnull, "w") as devnull:
        stdout, sys.stdout = sys.stdout, devnull
        try:
            train_tokenizer.main(["--input", corpus, "--vocab-size", "4096", "--output-prefix", tok_prefix])
        finally:
            sys.stdout = stdout
    model = tok_prefix + ".model"
    tokenizer = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model))
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    mbytes = os.path.getsize(corpus) / 1e6

    def bare():
        return sum(len(ids) for ids in tokenizer.tokenize_batch(texts))

    t_bare, n_tokens = best_of(repeats, bare)
    out = {"corpus_docs": len(texts), "corpus_mb": mbytes, "tokens": n_tokens, "bare_s": t_bare}
    for workers in (1, 2):
        def run(w=workers):
            args = preprocess_data.get_args([
                "--input", corpus, "--output-prefix", os.path.join(workdir, f"w{w}"), "--tokenizer-type",
                "SentencePieceTokenizer", "--tokenizer-model", model, "--append-eod", "--workers", str(w),
                "--overwrite", "--log-interval", str(10 ** 9)])
            stdout, sys.stdout = sys.stdout, open(os.devnull, "w")
            try:
                return preprocess_data.preprocess(args)
            finally:
                sys.stdout.close()
                sys.stdout = stdout
        c0 = cpu_seconds()
        out[f"pipeline_{workers}w_s"], _ = best_of(repeats, run)
        out[f"pipeline_{workers}w_cpu_s"] = (cpu_seconds() - c0) / repeats
    out["prefix"] = os.path.join(workdir, "w1_text_document")
    return out


def bench_indices(num_docs: int, num_tokens: int, seq_length: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    mean = num_tokens / num_docs
    sizes = rng.integers(1, int(2 * mean), size=num_docs, dtype=np.int32)  # mean ~ num_tokens / num_docs
    docs = np.arange(num_docs, dtype=np.int32)
    total = int(sizes.sum(dtype=np.int64))
    out = {"docs": num_docs, "tokens": total, "seq_length": seq_length}

    def stages():
        r = np.random.RandomState(1234)
        t0 = time.perf_counter()
        doc_idx = build_document_index(docs, 1, r, False)
        t1 = time.perf_counter()
        sample_idx = build_sample_index(sizes, doc_idx, seq_length)
        t2 = time.perf_counter()
        shuffle_idx = build_shuffle_index(len(sample_idx) - 1, len(sample_idx) - 1, r)
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, len(shuffle_idx)

    best = None
    for _ in range(repeats):
        s = stages()
        best = s if best is None or sum(s[:3]) < sum(best[:3]) else best
    out.update(document_index_s=best[0], sample_index_s=best[1], shuffle_index_s=best[2], samples=best[3])
    return out


def bench_blend(size: int) -> dict:
    t, _ = best_of(1, lambda: build_blending_indices([0.2, 0.3, 0.5], size))
    return {"blend_samples": size, "blend_s": t}


def bench_reads(prefix: str, n: int, seq_length: int = 1024) -> dict:
    ds = IndexedDataset(prefix)
    gpt = GPTDataset(ds, (0, len(ds)), None, seq_length, 1234, 2, cache_dir=False, verbose=False)
    n = min(n, len(gpt))
    t0 = time.perf_counter()
    for i in range(n):
        gpt[i]
    return {"reads": n, "read_seq_length": seq_length, "reads_per_s": n / (time.perf_counter() - t0)}


def report_lines(pre: dict, idx: dict, blend: dict, reads: dict) -> list[str]:
    ovh1 = pre["pipeline_1w_s"] / pre["bare_s"] - 1
    speedup2 = pre["pipeline_1w_s"] / pre["pipeline_2w_s"]
    cpu_eff2 = pre["pipeline_1w_cpu_s"] / pre["pipeline_2w_cpu_s"]
    idx_total = idx["document_index_s"] + idx["sample_index_s"] + idx["shuffle_index_s"]
    return [
        f"| preprocess: bare tokenizer (tokenize_batch, 1 thread) | {pre['bare_s']:.2f} s "
        f"({pre['corpus_mb'] / pre['bare_s']:.2f} MB/s, {pre['tokens'] / pre['bare_s'] / 1e6:.2f} M tokens/s) |",
        f"| preprocess_data.py --workers 1 | {pre['pipeline_1w_s']:.2f} s "
        f"({pre['corpus_mb'] / pre['pipeline_1w_s']:.2f} MB/s); overhead vs bare tokenizer **{100 * ovh1:+.1f}%** "
        "(goal <= 15%) |",
        f"| preprocess_data.py --workers 2 | {pre['pipeline_2w_s']:.2f} s "
        f"({pre['corpus_mb'] / pre['pipeline_2w_s']:.2f} MB/s); speed-up vs 1 worker **{speedup2:.2f}x** (ideal 2x); "
        f"CPU {pre['pipeline_2w_cpu_s']:.2f} s vs {pre['pipeline_1w_cpu_s']:.2f} s with 1 worker (parallel "
        f"efficiency {100 * cpu_eff2:.0f}%: the speed-up an idle {os.cpu_count()}-core machine allows is "
        f"~{min(2, os.cpu_count() or 1) * cpu_eff2:.2f}x) |",
        f"| GPT indices, {idx['tokens'] / 1e9:.2f}e9 tokens / {idx['docs'] / 1e6:.0f}e6 documents, seq "
        f"{idx['seq_length']} ({idx['samples']:,} samples) | **{idx_total:.2f} s**: document_index "
        f"{idx['document_index_s']:.2f} s, sample_index {idx['sample_index_s']:.2f} s, shuffle_index "
        f"{idx['shuffle_index_s']:.2f} s |",
        f"| blending indices, 3 datasets, {blend['blend_samples']:,} samples | {blend['blend_s']:.2f} s "
        f"({1e6 * blend['blend_s'] / blend['blend_samples']:.2f} us/sample) |",
        f"| GPTDataset reads (seq {reads['read_seq_length']}, shuffled) | {reads['reads_per_s']:,.0f} samples/s |",
    ]


def headlines(pre: dict, idx: dict, command: str) -> list[Headline]:
    idx_total = idx["document_index_s"] + idx["sample_index_s"] + idx["shuffle_index_s"]
    return [
        Headline("preprocess_data.py --workers 1 throughput", "the bare tokenizer (tokenize_batch) on the same text",
                 f"{pre['bare_s'] / pre['pipeline_1w_s']:.2f}x (overhead {100 * (pre['pipeline_1w_s'] / pre['bare_s'] - 1):+.1f}%, "
                 "goal <= 15%)", command),
        Headline("preprocess_data.py --workers 2 throughput", "--workers 1",
                 f"{pre['pipeline_1w_s'] / pre['pipeline_2w_s']:.2f}x (ideal 2x on an idle machine)", command),
        Headline(f"GPT index building, {idx['tokens'] / 1e9:.2f}e9 tokens / {idx['docs'] / 1e6:.0f}e6 documents",
                 "none (goal: seconds)", f"{idx_total:.2f} s", command),
    ]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="megalite data pipeline benchmarks")
    p.add_argument("--repeats", type=int, help="best of N for each timing (default 3; 1 with --quick)")
    p.add_argument("--docs", type=float, help="documents for the index benchmark (default 1e7; 1e6 with --quick)")
    p.add_argument("--tokens", type=float, help="tokens for the index benchmark (default 1e9; 1e8 with --quick)")
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--blend-samples", type=int, help="default 1,000,000 (100,000 with --quick)")
    p.add_argument("--no-write", action="store_true", help="print only; leave the results file alone")
    add_common_args(p)
    args = p.parse_args(argv)
    quick = args.quick
    repeats = args.repeats or (1 if quick else 3)
    docs, tokens = int(args.docs or (1e6 if quick else 1e7)), int(args.tokens or (1e8 if quick else 1e9))
    blend_samples = args.blend_samples or (100_000 if quick else 1_000_000)

    with tempfile.TemporaryDirectory() as work:
        pre = bench_preprocess(work, repeats, corpus_mb=3 if quick else 20)
        reads = bench_reads(pre["prefix"], n=2000 if quick else 20000)
    idx = bench_indices(docs, tokens, args.seq_length, repeats)
    blend = bench_blend(blend_samples)

    command = command_line("bench_data.py", argv)
    body = [f"Corpus: Python stdlib as JSONL, {pre['corpus_docs']} documents, {pre['corpus_mb']:.1f} MB, "
            f"{pre['tokens']:,} tokens (SentencePiece BPE 4096); best of {repeats}; numpy {np.__version__}.", "",
            "| what | result |", "|---|---|", *report_lines(pre, idx, blend, reads)]
    print("\n".join(body), flush=True)
    publish(args, "bench_data", "Data pipeline: preprocessing, indices, blending, reads", command,
            headlines(pre, idx, command), body)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
