#!/usr/bin/env python
"""GPU MFU: a ~1B-parameter Llama trained in bf16 on one GPU by megalite, side by side with transformers.

megalite trains through its own path, as pretrain_gpt.py does (parse_args -> build_trainer ->
train_step): bf16 weights with fp32 gradient accumulation and fp32 master weights, PyTorch's fused
AdamW, SDPA attention (flash attention on the GPU). The baseline is transformers' LlamaForCausalLM
with the same shape, batch, gradient accumulation and optimizer settings, trained the usual way (fp32
weights under bf16 autocast, SDPA, fused AdamW). Each is measured eager and compiled: megalite with
--compile (torch.compile per transformer layer), transformers with the same regional compile of each
LlamaDecoderLayer's forward. Each of the four runs alone on the GPU in its own process, one after
the other; the warm-up steps include the compilation.

    MFU = tokens/s * FLOPs/token / peak FLOP/s
    FLOPs/token = 6*N + 12*L*h*s   (PaLM appendix B; N = non-embedding parameters +
                                    output layer, attention without causal discount, no recomputation)

The peak is the GPU's dense bf16 peak from the table below (by torch.cuda.get_device_name), or
--peak-tflops. The micro-batch is fitted to the GPU's memory (halved and retried on out-of-memory);
both sides use the same one. Without a CUDA GPU the script says so in one line, records that in the
results file and exits 0.

    python bench/gpu_mfu.py                      # ~1B Llama, seq 4096: a few minutes on an H100/H200
    python bench/gpu_mfu.py --recompute          # full activation recomputation, larger micro-batches
    python bench/gpu_mfu.py --peak-tflops 989    # a GPU missing from the table
    python bench/gpu_mfu.py --quick              # smoke test: 4 layers, seq 2048, 3 timed steps
    python bench/gpu_mfu.py --smoke              # the whole script on CPU with a tiny model (checks the
                                                 # script; no MFU, writes nothing; alias --cpu-check)
    python bench/gpu_mfu.py --no-compile         # the eager runs only
    python bench/gpu_mfu.py --fp8 blockwise      # megalite FP8 (--fp8-recipe blockwise, --fp8-format hybrid
                                                 # or e4m3) vs megalite bf16, eager, same micro-batch
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_flags import llama_argv  # noqa: E402
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from megalite.config.fp8_fields import FP8_FORMATS, FP8_RECIPES  # noqa: E402

NO_GPU = "no CUDA GPU on this machine: GPU MFU not measured"
KEY, TITLE = "gpu_mfu", "GPU MFU: ~1B Llama, bf16, one GPU, megalite vs transformers"
FP8_KEY, FP8_TITLE = "gpu_fp8", "GPU FP8: ~1B Llama, one GPU, megalite FP8 vs bf16 tokens/s"

@dataclass(frozen=True)
class Shape:
    layers: int = 16
    hidden: int = 2048
    ffn: int = 8192
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 32000
    seq: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def describe(self) -> str:
        return (f"Llama {self.layers} layers, hidden {self.hidden}, {self.heads} heads / {self.kv_heads} KV heads "
                f"(GQA), SwiGLU {self.ffn}, vocab {self.vocab}, untied embeddings, seq {self.seq}")


FULL = Shape()
QUICK = replace(FULL, layers=4, seq=2048)
CPU_CHECK = Shape(layers=2, hidden=256, ffn=704, heads=4, kv_heads=2, vocab=1024, seq=128)


@dataclass(frozen=True)
class Run:
    """What one worker process trains and times."""
    kind: str                    # "megalite" or "hf"
    shape: Shape
    micro_batch: int | None      # None: fit to the GPU's memory (megalite side, which runs first)
    accumulation: int
    recompute: bool
    warmup: int
    steps: int
    compile: bool = False        # torch.compile per transformer layer
    fp8: str | None = None       # megalite's --fp8-recipe (None: bf16 GEMMs)
    fp8_format: str = "hybrid"

    @property
    def label(self) -> str:
        name = ("megalite" if self.kind == "megalite" else "transformers") + (" compiled" if self.compile else "")
        return name + (f" fp8 {self.fp8}" if self.fp8 else "")


# ---- arithmetic ---------------------------------------------------------------------------------
def flops_per_token(n_params: int, shape: Shape) -> float:
    """PaLM appendix B: 6N + 12*L*h*s, N = non-embedding parameters + output layer."""
    return 6 * n_params + 12 * shape.layers * shape.hidden * shape.seq


def total_params(shape: Shape) -> int:
    """Embedding + layers + final norm + untied output layer, for the memory estimate."""
    h, d = shape.hidden, shape.head_dim
    per_layer = h * (shape.heads + 2 * shape.kv_heads) * d + shape.heads * d * h + 3 * h * shape.ffn + 2 * h
    return 2 * shape.vocab * h + shape.layers * per_layer + h


def activation_bytes_per_sample(shape: Shape, recompute: bool) -> int:
    """A generous estimate of one sequence's activation memory in bf16, eager PyTorch, flash attention
    (no s x s tensors): per layer about s*(48h + 10*ffn) bytes saved for backward (norms, QKV, rotary
    copies, GQA-expanded K/V, attention output, MLP), and the logits in bf16 and fp32 with their
    gradient, ~12*s*V bytes. With full recomputation a layer keeps only its input (2*s*h bytes), plus
    one layer's activations while it is recomputed."""
    s, h = shape.seq, shape.hidden
    layer = s * (48 * h + 10 * shape.ffn)
    layers = shape.layers * 2 * s * h + layer if recompute else shape.layers * layer
    return layers + 12 * s * shape.vocab


def fit_micro_batch(total_memory: int, shape: Shape, recompute: bool, limit: int = 16) -> int:
    """The largest micro-batch whose estimate fits 85% of the GPU's memory: 18 bytes per parameter
    (bf16 weights, fp32 gradients, fp32 master weights, Adam m and v) plus activations."""
    states = 18 * total_params(shape)
    fit = (0.85 * total_memory - states) // activation_bytes_per_sample(shape, recompute)
    return int(max(1, min(limit, fit)))


def peak_tflops(device_name: str, override: float | None = None) -> float | None:
    """--peak-tflops if given, else the table's dense bf16 peak for this GPU (None when unknown)."""
    if override:
        return override
    from megalite.train.performance import KNOWN_GPU_PEAK_FLOPS      # the table the training log's MFU uses
    for text, flops in KNOWN_GPU_PEAK_FLOPS:
        if text.lower() in device_name.lower():
            return flops / 1e12
    return None


# ---- the two sides (run inside worker processes) --------------------------------------------------
def megalite_argv(run: Run) -> list[str]:
    s = run.shape
    argv = llama_argv(s, run.micro_batch, run.micro_batch * run.accumulation) + [
        "--bf16", "--adam-beta1", "0.9", "--adam-beta2", "0.95"]
    if run.recompute:
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if run.compile:
        argv += ["--compile"]
    if run.fp8:
        argv += ["--fp8-format", run.fp8_format, "--fp8-recipe", run.fp8]
        if os.environ.get("CUDA_VISIBLE_DEVICES") == "":      # --smoke: a CPU has kernels for some recipes only
            argv += ["--fp8-emulate"]
    return argv


def random_tokens(run: Run, device):
    """Endless micro-batches of random tokens [b, s + 1], made on the device."""
    import torch
    while True:
        yield torch.randint(0, run.shape.vocab, (run.micro_batch, run.shape.seq + 1), device=device)


def build_megalite(run: Run):
    """(step function, N for the FLOPs formula, device) for megalite's own training step."""
    import torch
    from megalite.train.command_line import parse_args
    from megalite.train.trainer import build_trainer
    from megalite.train.step import train_step
    trainer = build_trainer(parse_args(megalite_argv(run), world_size=1))
    b, s = run.micro_batch, run.shape.seq

    def batches():
        positions = torch.arange(s, device=trainer.device).expand(b, s)
        ones = torch.ones(b, s, device=trainer.device)
        for x in random_tokens(run, trainer.device):
            yield {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": ones, "position_ids": positions}

    model, data = trainer.model, batches()
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("embedding."))
    if model.share_embeddings_and_output_weights:
        n += model.output_weight().numel()
    return (lambda: train_step(trainer, data)), n, trainer.device


def build_hf(run: Run):
    """(step function, N, device) for transformers' LlamaForCausalLM with the usual bf16 autocast."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    s = run.shape
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.ffn,
                         num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                         max_position_embeddings=s.seq, tie_word_embeddings=False, attention_dropout=0.0,
                         use_cache=False)
    config._attn_implementation = "sdpa"
    with device:
        model = LlamaForCausalLM(config)
    if run.recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if run.compile:      # regional, as megalite's --compile: each decoder layer's forward (hooks stay eager)
        for layer in model.model.layers:
            layer.forward = torch.compile(layer.forward)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=device.type == "cuda")
    data = random_tokens(run, device)

    def step():
        for _ in range(run.accumulation):
            tokens = next(data)[:, :-1]
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=tokens).loss    # transformers shifts the labels itself
            (loss / run.accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    return step, n, device


def time_steps(step, run: Run, device) -> list[float]:
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    for _ in range(run.warmup):
        step()
    sync()
    times = []
    for _ in range(run.steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return times


def count_syncs(step) -> int | None:
    """The synchronising CUDA calls of one step (each a host wait for the device), as
    torch.cuda.set_sync_debug_mode("warn") reports them; None without CUDA."""
    import warnings
    import torch
    if not torch.cuda.is_available():
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchronizing CUDA operation" in str(w.message) for w in caught)


def with_micro_batch(run: Run) -> Run:
    """The run with its micro-batch fixed: as given, or fitted to this GPU's memory."""
    import torch
    if run.micro_batch is not None:
        return run
    total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 16 * 2 ** 30
    return replace(run, micro_batch=fit_micro_batch(total, run.shape, run.recompute))


def measure_side(run: Run) -> dict:
    import torch
    cuda = torch.cuda.is_available()
    step, n_params, device = (build_megalite if run.kind == "megalite" else build_hf)(run)
    times = time_steps(step, run, device)
    syncs = count_syncs(step)           # after the timed steps: the warnings cost host time
    return {"kind": run.kind, "micro_batch": run.micro_batch, "times": times, "n_params": n_params,
            "syncs": syncs,
            "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
            "peak_memory": torch.cuda.max_memory_allocated(device) if cuda else None}


def worker(run: Run, conn) -> None:
    import torch
    try:
        run = with_micro_batch(run)
        conn.send(measure_side(run))
    except torch.OutOfMemoryError:
        conn.send({"oom": True, "micro_batch": run.micro_batch})
    except BaseException:
        conn.send({"error": traceback.format_exc()})


# ---- the parent: fit the batch, run both sides, report ---------------------------------------------
def run_side(run: Run) -> dict:
    """One side in a fresh process (a clean GPU each time): its result, or {"oom": True, "micro_batch": b}."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=worker, args=(run, child))
    proc.start()
    child.close()
    try:
        result = parent.recv()
    except EOFError:
        result = None
    proc.join()
    if result is None:
        raise RuntimeError(f"the {run.kind} worker died without a result (exit code {proc.exitcode})")
    if "error" in result:
        raise RuntimeError(f"the {run.kind} side failed:\n{result['error']}")
    return result


def measure_all(run: Run, peak_override: float | None, compiled: bool = True) -> list[tuple[Run, dict]]:
    """megalite eager first (it fits the micro-batch), then megalite compiled and transformers eager and
    compiled with the same micro-batch; all again at half the micro-batch whenever one runs out of memory.
    With ``run.fp8``: megalite eager in bf16, then in FP8."""
    variants = [("megalite", False, None), ("hf", False, None)]
    if compiled:
        variants = [("megalite", False, None), ("megalite", True, None), ("hf", False, None), ("hf", True, None)]
    if run.fp8:
        variants = [("megalite", False, None), ("megalite", False, run.fp8)]
    while True:
        results, retry = [], False
        for kind, compile_, fp8 in variants:
            side = replace(run, kind=kind, compile=compile_, fp8=fp8)
            result = run_side(side)
            if result.get("oom"):
                run, retry = halved(run, result["micro_batch"], side.label), True
                break
            run = replace(run, micro_batch=result["micro_batch"])
            peak = peak_tflops(result["device_name"], peak_override)
            print(f"{side.label}: micro-batch {run.micro_batch}, {summary(result, run, peak)}", flush=True)
            results.append((replace(side, micro_batch=run.micro_batch), result))
        if not retry:
            return results


def halved(run: Run, micro_batch: int, who: str) -> Run:
    if micro_batch <= 1:
        raise RuntimeError(f"{who} runs out of GPU memory at micro-batch 1; try --recompute or a shorter sequence")
    print(f"{who}: out of GPU memory at micro-batch {micro_batch}; retrying both sides at {micro_batch // 2}",
          flush=True)
    return replace(run, micro_batch=micro_batch // 2)


def figures(result: dict, run: Run, peak: float | None) -> dict:
    seconds = statistics.median(result["times"])
    tokens = result["micro_batch"] * run.accumulation * run.shape.seq
    tokens_per_s = tokens / seconds
    tflops = tokens_per_s * flops_per_token(result["n_params"], run.shape) / 1e12
    return {"ms": 1000 * seconds, "tokens": tokens, "tokens_per_s": tokens_per_s, "tflops": tflops,
            "mfu": tflops / peak if peak else None,
            "memory_gib": result["peak_memory"] / 2 ** 30 if result["peak_memory"] is not None else None}


def summary(result: dict, run: Run, peak: float | None) -> str:
    f = figures(result, run, peak)
    parts = [f"{f['ms']:.0f} ms/step", f"{f['tokens_per_s']:,.0f} tokens/s", f"{f['tflops']:.1f} TFLOP/s"]
    if f["mfu"] is not None:
        parts.append(f"MFU {100 * f['mfu']:.1f}%")
    if f["memory_gib"] is not None:
        parts.append(f"peak memory {f['memory_gib']:.1f} GiB")
    return ", ".join(parts)


def table_row(name: str, result: dict, run: Run, peak: float | None) -> str:
    f = figures(result, run, peak)
    mfu = f"**{100 * f['mfu']:.1f}%**" if f["mfu"] is not None else "n/a (unknown peak)"
    memory = f"{f['memory_gib']:.1f}" if f["memory_gib"] is not None else "n/a"
    syncs = result.get("syncs")
    return (f"| {name} | {result['micro_batch']} x {run.accumulation} | {f['tokens']:,} | {f['ms']:.0f} | "
            f"{f['tokens_per_s']:,.0f} | {f['tflops']:.1f} | {mfu} | {memory} | "
            f"{'n/a' if syncs is None else syncs} |")


def report(results: list[tuple[Run, dict]], peak: float | None, peak_source: str, command: str):
    by_label = {side.label: result for side, result in results}
    run = results[0][0]
    mega = by_label.get("megalite compiled", by_label["megalite"])
    hf = by_label.get("transformers compiled", by_label["transformers"])
    best = "megalite compiled" if "megalite compiled" in by_label else "megalite"
    baseline = "transformers compiled" if "transformers compiled" in by_label else "transformers"
    m, h = figures(mega, run, peak), figures(hf, run, peak)
    n = mega["n_params"]
    gpu = mega["device_name"]
    mfu_text = f"{100 * m['mfu']:.1f}% MFU" if m["mfu"] is not None else "MFU n/a: pass --peak-tflops"
    hf_mfu = f", {baseline} {100 * h['mfu']:.1f}% MFU" if h["mfu"] is not None else ""
    headlines = [
        Headline(f"GPU MFU, {best}, {n / 1e9:.2f}B Llama bf16 seq {run.shape.seq}, {gpu}",
                 f"{peak_source} (goal >= 50%)", mfu_text, command),
        Headline(f"GPU training throughput, {best} vs {baseline}", f"{baseline} LlamaForCausalLM, same model, "
                 f"batch and optimizer{hf_mfu}", f"{m['tokens_per_s'] / h['tokens_per_s']:.2f}x tokens/s", command)]
    hf_params = by_label["transformers"]["n_params"]
    body = [f"{run.shape.describe()}: N = {n:,} non-embedding + output parameters ({hf_params:,} counted on "
            f"the transformers model), {flops_per_token(n, run.shape) / 1e9:.2f} GFLOP/token by 6N + 12*L*h*s. "
            f"bf16; AdamW + clip 1.0; gradient accumulation {run.accumulation}; activation recomputation "
            f"{'full' if run.recompute else 'off'}; compiled = torch.compile of each transformer layer's forward "
            f"(megalite --compile; the same on each LlamaDecoderLayer). Median of {run.steps} steps after "
            f"{run.warmup} warm-up (which include compiling) per run; MFU against {peak_source}. Peak memory: "
            "torch.cuda.max_memory_allocated. Host syncs: the synchronising CUDA calls of one more step, as "
            "torch.cuda.set_sync_debug_mode(\"warn\") reports them (megalite: the gradient norm, which decides "
            "clipping and refuses a NaN update on the host).",
            "", "| implementation | micro-batch x accumulation | tokens / step | ms / step | tokens/s | model TFLOP/s "
            "| MFU | peak memory GiB | host syncs / step |", "|---|---|---|---|---|---|---|---|---|"]
    names = {"megalite": "megalite (train_step, fused AdamW, SDPA)",
             "megalite compiled": "megalite --compile",
             "transformers": "transformers LlamaForCausalLM (autocast, fused AdamW, SDPA)",
             "transformers compiled": "transformers LlamaForCausalLM, compiled layers"}
    body += [table_row(names[side.label], result, side, peak) for side, result in results]
    return headlines, body


def fp8_report(results: list[tuple[Run, dict]], peak: float | None, command: str):
    """Headline and table of megalite FP8 against megalite bf16 (``measure_all`` with ``run.fp8``)."""
    (bf16_run, bf16), (fp8_run, fp8) = results
    b, f = figures(bf16, bf16_run, peak), figures(fp8, fp8_run, peak)
    headlines = [Headline(f"GPU FP8 throughput, megalite --fp8-recipe {fp8_run.fp8} ({fp8_run.fp8_format}), "
                          f"{bf16['n_params'] / 1e9:.2f}B Llama seq {bf16_run.shape.seq}, {bf16['device_name']}",
                          "megalite bf16, same model, micro-batch and optimizer (goal >= 1.3x)",
                          f"{f['tokens_per_s'] / b['tokens_per_s']:.2f}x tokens/s", command)]
    body = [f"{bf16_run.shape.describe()}; AdamW + clip 1.0; gradient accumulation {bf16_run.accumulation}; eager "
            f"(no --compile) on both sides. Median of {bf16_run.steps} steps after {bf16_run.warmup} warm-up. The "
            "transformer layers' linears run in FP8, the output head, norms and core attention in bf16; MFU counts "
            "the same model FLOPs against the dense bf16 peak.", "",
            "| run | micro-batch x accumulation | tokens / step | ms / step | tokens/s | model TFLOP/s | MFU (bf16 peak) "
            "| peak memory GiB | host syncs / step |", "|---|---|---|---|---|---|---|---|---|"]
    body += [table_row(side.label, result, side, peak) for side, result in results]
    return headlines, body


def cpu_build_hint(torch) -> str:
    """When the machine has an NVIDIA driver but this PyTorch was built without CUDA, say so."""
    if torch.version.cuda is None and shutil.which("nvidia-smi"):
        return f" (nvidia-smi is here, but torch {torch.__version__} has no CUDA: install a CUDA build)"
    return ""


def no_gpu_section(command: str, shape: Shape) -> tuple[list[Headline], list[str]]:
    headlines = [Headline("GPU MFU, megalite vs transformers, ~1B Llama bf16", "transformers LlamaForCausalLM",
                          "not measured: no CUDA GPU on this machine", command)]
    body = [f"{NO_GPU}. On a GPU machine `{command}` trains {shape.describe()} in bf16 with megalite and with "
            "transformers' LlamaForCausalLM and reports tokens/s, TFLOP/s, MFU (6N + 12*L*h*s FLOPs per token "
            "against the GPU's dense bf16 peak) and peak memory for both."]
    return headlines, body


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch-size", type=int, help="default: fitted to the GPU's memory")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimizer step (default 4)")
    parser.add_argument("--recompute", action="store_true", help="full activation recomputation on both sides")
    parser.add_argument("--steps", type=int, help="timed steps per side (default 10; 3 with --quick)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per side (default 3; 2 with --quick)")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, for a GPU not in the table")
    parser.add_argument("--smoke", "--cpu-check", action="store_true", dest="cpu_check",
                        help="run everything on CPU with a tiny model to check the script (no MFU, writes nothing)")
    parser.add_argument("--no-compile", action="store_false", dest="compiled",
                        help="measure the eager runs only (default: eager and compiled, both sides)")
    parser.add_argument("--fp8", metavar="RECIPE", choices=FP8_RECIPES,
                        help="megalite with --fp8-recipe RECIPE against megalite bf16 (eager, no transformers)")
    parser.add_argument("--fp8-format", default="hybrid", choices=FP8_FORMATS, help="with --fp8 (default hybrid)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    command = command_line("gpu_mfu.py", argv)
    shape = CPU_CHECK if args.cpu_check else QUICK if args.quick else FULL
    if args.cpu_check and args.fp8:          # whole 128-blocks for blockwise
        shape = replace(shape, ffn=768)
    key, title = (FP8_KEY, FP8_TITLE) if args.fp8 else (KEY, TITLE)

    import torch
    if args.cpu_check:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""          # the workers see no GPU
    elif not torch.cuda.is_available():
        print(NO_GPU + cpu_build_hint(torch), flush=True)
        publish(args, key, title, command, *no_gpu_section(command, shape))
        return 0
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

    run = Run("megalite", shape, args.micro_batch_size, args.accumulation, args.recompute,
              args.warmup or (2 if args.quick or args.cpu_check else 3), args.steps or (3 if args.quick else 10),
              fp8=args.fp8, fp8_format=args.fp8_format)
    if args.cpu_check:
        run = replace(run, micro_batch=args.micro_batch_size or 2, warmup=1, steps=2)
    results = measure_all(run, args.peak_tflops, args.compiled)
    device_name = results[0][1]["device_name"]
    peak = peak_tflops(device_name, args.peak_tflops)
    peak_source = (f"{peak:.0f} TFLOP/s dense bf16 ({'--peak-tflops' if args.peak_tflops else device_name})"
                   if peak else f"unknown peak for {device_name}")
    headlines, body = (fp8_report(results, peak, command) if args.fp8 else
                       report(results, peak, peak_source, command))
    print("\n".join(f"{h.benchmark}: {h.ratio} (baseline: {h.baseline})" for h in headlines), flush=True)
    print("\n".join(body), flush=True)
    if not args.cpu_check:
        publish(args, key, title, command, headlines, body)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
