#!/usr/bin/env python
"""Single-process training speed: megalite vs transformers' LlamaForCausalLM, same config and batch.

Both sides train with AdamW (same betas, eps, weight decay) and gradient clipping at 1.0 on random
tokens; transformers runs bf16 the usual way (fp32 weights under autocast), megalite with its --bf16
(bf16 weights, fp32 master weights and gradient accumulation). Each side lives in its own process
(so neither inherits the other's allocator or thread state); steps are interleaved in rounds so
machine noise hits both alike. The figure is HF ms / megalite ms per iteration (>1: megalite faster),
from medians. Model FLOP/s is reported as a share of a matmul peak measured in the same run.

    python bench/bench_vs_hf.py                  # fp32 and bf16, writes a section of bench/RESULTS.md
    python bench/bench_vs_hf.py --dtypes bf16 --rounds 2 --steps 2
    python bench/bench_vs_hf.py --quick          # smoke test: 2 layers, seq 256, one timed step per side
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_flags import llama_argv  # noqa: E402
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@dataclass(frozen=True)
class Shape:
    layers: int = 8
    hidden: int = 512
    ffn: int = 1408
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 8192
    seq: int = 512
    mbs: int = 8

    def describe(self) -> str:
        return (f"Llama {self.layers} layers, hidden {self.hidden}, {self.heads} heads / {self.kv_heads} KV heads, "
                f"SwiGLU {self.ffn}, vocab {self.vocab}, seq {self.seq}, micro-batch {self.mbs}")


FULL = Shape()
QUICK = replace(FULL, layers=2, seq=256, mbs=4)


def megalite_args(shape: Shape) -> list[str]:
    return llama_argv(shape, shape.mbs, shape.mbs) + ["--adam-beta1", "0.9", "--adam-beta2", "0.95"]


def random_batches(shape: Shape):
    import torch
    while True:
        x = torch.randint(0, shape.vocab, (shape.mbs, shape.seq + 1))
        yield {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(shape.mbs, shape.seq),
               "position_ids": torch.arange(shape.seq).expand(shape.mbs, shape.seq)}


def megalite_stepper(shape: Shape, dtype: str):
    from megalite.arguments import parse_args
    from megalite.training import build_trainer, train_step
    argv = megalite_args(shape) + (["--bf16"] if dtype == "bf16" else [])
    trainer = build_trainer(parse_args(argv, world_size=1))
    batches = random_batches(shape)
    return lambda: train_step(trainer, batches)


def hf_stepper(shape: Shape, dtype: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.seq,
                         tie_word_embeddings=False, attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    batches = random_batches(shape)

    def step():
        batch = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = model(input_ids=batch["tokens"], labels=batch["tokens"]).loss   # HF shifts labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def worker(kind: str, shape: Shape, dtype: str, conn) -> None:
    step = (megalite_stepper if kind == "megalite" else hf_stepper)(shape, dtype)
    conn.send("ready")
    while (n := conn.recv()) > 0:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        conn.send(times)


def matmul_peak_flops(dtype: str) -> float:
    """Best FLOP/s of a large square matmul in this dtype: the denominator of the utilisation share."""
    import torch
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    a = torch.randn(2048, 2048, dtype=torch_dtype)
    b = torch.randn(2048, 2048, dtype=torch_dtype)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * 2048 ** 3 / best


def model_flops_per_step(shape: Shape) -> float:
    from megalite.arguments import parse_args
    from megalite.logging import flops_per_iteration
    config = parse_args(megalite_args(shape), world_size=1)
    return flops_per_iteration(config.model, shape.mbs)


def compare(shape: Shape, dtype: str, rounds: int, steps: int, warmup: int) -> dict:
    ctx = mp.get_context("spawn")
    pipes, procs = {}, []
    for kind in ("megalite", "hf"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(kind, shape, dtype, child), daemon=True)
        proc.start()
        pipes[kind] = parent
        procs.append(proc)
    for kind, pipe in pipes.items():
        assert pipe.recv() == "ready"
        pipe.send(warmup)
        pipe.recv()
    times = {"megalite": [], "hf": []}
    for _ in range(rounds):
        for kind, pipe in pipes.items():          # one side at a time: they never share the cores
            pipe.send(steps)
            times[kind] += pipe.recv()
    for pipe in pipes.values():
        pipe.send(0)
    for proc in procs:
        proc.join()
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    peak = matmul_peak_flops(dtype)
    flops = model_flops_per_step(shape)
    return {"dtype": dtype, "megalite_ms": ms["megalite"], "hf_ms": ms["hf"], "ratio": ms["hf"] / ms["megalite"],
            "megalite_util": flops / (ms["megalite"] / 1000) / peak, "hf_util": flops / (ms["hf"] / 1000) / peak,
            "peak_tflops": peak / 1e12, "samples": len(times["megalite"])}


def table_row(r: dict) -> str:
    return (f"| {r['dtype']} | {r['hf_ms']:.0f} | {r['megalite_ms']:.0f} | **{r['ratio']:.2f}x** | "
            f"{100 * r['megalite_util']:.0f}% | {100 * r['hf_util']:.0f}% | {r['peak_tflops']:.2f} | {r['samples']} |")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--rounds", type=int, help="rounds of interleaved steps (default 4; 1 with --quick)")
    parser.add_argument("--steps", type=int, help="steps per side per round (default 2; 1 with --quick)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per side (default 2; 1 with --quick)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    rounds, steps, warmup = (args.rounds or (1 if args.quick else 4), args.steps or (1 if args.quick else 2),
                             args.warmup or (1 if args.quick else 2))
    command = command_line("bench_vs_hf.py", argv)
    results, rows = [], []
    for dtype in args.dtypes.split(","):
        results.append(compare(shape, dtype, rounds, steps, warmup))
        rows.append(table_row(results[-1]))
        print(rows[-1], flush=True)
    headlines = [Headline(f"megalite vs transformers, single-process training, {r['dtype']}",
                          "transformers LlamaForCausalLM, same model, batch and optimizer",
                          f"{r['ratio']:.2f}x faster (HF ms / megalite ms)", command) for r in results]
    body = [f"{shape.describe()}; AdamW + clip 1.0. Ratio = HF ms / megalite ms (median per iteration of "
            f"{rounds * steps} steps per side after {warmup} warm-up, interleaved in {rounds} rounds).",
            "", "| dtype | HF ms | megalite ms | ratio | megalite FLOP/s share of matmul peak | HF share | "
            "peak TFLOP/s | steps |", "|---|---|---|---|---|---|---|---|", *rows]
    publish(args, "bench_vs_hf", "megalite vs transformers, single-process training", command, headlines, body)


if __name__ == "__main__":
    main(sys.argv[1:])
