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
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import replace_section  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, SEQ, MBS = 8, 512, 1408, 8, 2, 8192, 512, 8

MEGALITE_ARGS = [
    "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--ffn-hidden-size", str(FFN),
    "--num-attention-heads", str(HEADS), "--group-query-attention", "--num-query-groups", str(KV_HEADS),
    "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--position-embedding-type", "rope",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--micro-batch-size", str(MBS),
    "--global-batch-size", str(MBS), "--lr", "1e-4", "--weight-decay", "0.1", "--adam-beta1", "0.9",
    "--adam-beta2", "0.95", "--clip-grad", "1.0", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", str(VOCAB - 1), "--train-iters", "1000", "--eval-iters", "0"]


def random_batches():
    import torch
    while True:
        x = torch.randint(0, VOCAB, (MBS, SEQ + 1))
        yield {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(MBS, SEQ),
               "position_ids": torch.arange(SEQ).expand(MBS, SEQ)}


def megalite_stepper(dtype: str):
    from megalite.arguments import parse_args
    from megalite.training import build_trainer, train_step
    argv = MEGALITE_ARGS + (["--bf16"] if dtype == "bf16" else [])
    trainer = build_trainer(parse_args(argv, world_size=1))
    batches = random_batches()
    return lambda: train_step(trainer, batches)


def hf_stepper(dtype: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
                         tie_word_embeddings=False, attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    batches = random_batches()

    def step():
        batch = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = model(input_ids=batch["tokens"], labels=batch["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def worker(kind: str, dtype: str, conn) -> None:
    step = (megalite_stepper if kind == "megalite" else hf_stepper)(dtype)
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


def model_flops_per_step() -> float:
    from megalite.arguments import parse_args
    from megalite.logging import flops_per_iteration
    config = parse_args(MEGALITE_ARGS, world_size=1)
    return flops_per_iteration(config.model, MBS)


def compare(dtype: str, rounds: int, steps: int, warmup: int) -> dict:
    ctx = mp.get_context("spawn")
    pipes, procs = {}, []
    for kind in ("megalite", "hf"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(kind, dtype, child), daemon=True)
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
    flops = model_flops_per_step()
    return {"dtype": dtype, "megalite_ms": ms["megalite"], "hf_ms": ms["hf"], "ratio": ms["hf"] / ms["megalite"],
            "megalite_util": flops / (ms["megalite"] / 1000) / peak, "hf_util": flops / (ms["hf"] / 1000) / peak,
            "peak_tflops": peak / 1e12, "samples": len(times["megalite"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="steps per side per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--results", default=os.path.join(ROOT, "bench", "RESULTS.md"))
    args = parser.parse_args()
    lines = []
    for dtype in args.dtypes.split(","):
        r = compare(dtype, args.rounds, args.steps, args.warmup)
        line = (f"| {dtype} | {r['hf_ms']:.0f} | {r['megalite_ms']:.0f} | **{r['ratio']:.2f}x** | "
                f"{100 * r['megalite_util']:.0f}% | {100 * r['hf_util']:.0f}% | {r['peak_tflops']:.2f} | {r['samples']} |")
        print(line, flush=True)
        lines.append(line)
    write_results(args.results, lines)


def write_results(path: str, lines: list[str]) -> None:
    """Replace this benchmark's section of RESULTS.md, keeping the others."""
    replace_section("bench_vs_hf", [
        "## megalite vs transformers, single-process training",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()}; "
        f"{time.strftime('%Y-%m-%d')}. Command: `python bench/bench_vs_hf.py`.",
        f"Llama {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads / {KV_HEADS} KV heads, SwiGLU {FFN}, vocab {VOCAB}, "
        f"seq {SEQ}, micro-batch {MBS}; AdamW + clip 1.0. Ratio = HF ms / megalite ms (median per iteration).",
        "", "| dtype | HF ms | megalite ms | ratio | megalite FLOP/s share of matmul peak | HF share | peak TFLOP/s | steps |",
        "|---|---|---|---|---|---|---|---|", *lines], path)


if __name__ == "__main__":
    main()
