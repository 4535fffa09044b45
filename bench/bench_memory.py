#!/usr/bin/env python
"""Memory per rank, measured side by side with theory and with PyTorch FSDP2 in one run.

Sections (each a function returning table rows; add one to SECTIONS to extend):
- zero: peak RSS per rank of a training step for each data-parallel sharding strategy (no_shard,
  ZeRO-1/2/3) at DP=4 with 4 micro-batches on a bf16 Llama whose state dominates (tiny activations),
  against the ZeRO paper's bytes per parameter with Megatron's fp32 gradient buffer: 18, 6 + 12/d,
  2 + 16/d, 18/d. The done-when figure: each stage saves >= 0.9 of its theoretical saving over the
  stage before it.
- zero-pretrain: the same four stages as the user runs them, ``torchrun pretrain_gpt.py`` at DP=4 (4 layers,
  hidden 1024, bf16, 4 steps), with whatever allocator the environment gives it: each rank's peak RSS of
  the whole run (the kernel's high-water mark read from /proc, tests/distributed/process_memory.py), and
  each stage's saving over the stage before against the same theory.
- fsdp2: the same fp32 model under megalite's ZeRO-3 and under PyTorch's FSDP2 (``fully_shard`` per
  transformer layer and on the root), same weights, same batches: peak RSS per rank of the training
  steps, start-up peak, and step time, at DP=2 and DP=4 (and DP=2 with 4 micro-batches).
- checkpoint: a ZeRO-3 DP=2 save and load: peak RSS above the rank's own state, and throughput
  against this disk's write speed (the same bytes written with one fsync'd file).
- activations: bytes autograd keeps per transformer layer at TP 1/2/4 + SP against Korthikanti et al.'s
  formula and transformers' LlamaForCausalLM (bench/activation_memory.py).
- cross-entropy: the loss's peak memory with and without --cross-entropy-loss-fusion.

Peak RSS is the kernel's high-water mark (VmHWM) restarted before the measured window, minus the RSS
the process had at that point (Python, torch, the process group), so it counts what training adds.

    python bench/bench_memory.py                 # every section, writes bench/RESULTS.md sections
    python bench/bench_memory.py --sections zero,fsdp2
    python bench/bench_memory.py --quick         # smoke test: a smaller model, one step
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_flags import llama_argv  # noqa: E402
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MiB = 2 ** 20
USER_ENV = dict(os.environ)          # as given: pretrain_gpt.py's launches set their allocator policy themselves


@dataclass(frozen=True)
class Shape:
    layers: int = 6
    hidden: int = 768
    ffn: int = 2048
    heads: int = 12
    kv_heads: int = 4
    vocab: int = 8192
    seq: int = 64
    mbs: int = 1

    def describe(self) -> str:
        return (f"Llama {self.layers} layers, hidden {self.hidden}, {self.heads} heads / {self.kv_heads} KV heads, "
                f"SwiGLU {self.ffn}, vocab {self.vocab}, seq {self.seq}, micro-batch {self.mbs}")


# ~50M parameters in 16 thin layers: state dominates, and one gathered layer is small next to it
ZERO_SHAPE = Shape(layers=16, hidden=512, ffn=1408, heads=8, kv_heads=2, vocab=4096, seq=64)
FSDP_SHAPE = Shape(layers=12, hidden=768, ffn=2048, vocab=16384, seq=128, mbs=2)   # ~100M parameters
QUICK_SHAPE = Shape(layers=2, hidden=256, ffn=704, heads=4, kv_heads=2, vocab=2048, seq=32)

# bytes per parameter with bf16 parameters, fp32 gradients and fp32 Adam (the ZeRO paper's accounting with
# Megatron's fp32 gradient buffer: 2 + 4 + 12, sharded by stage)
THEORY = {"no_shard": lambda d: 18.0, "optim": lambda d: 6 + 12 / d, "optim_grads": lambda d: 2 + 16 / d,
          "optim_grads_params": lambda d: 18 / d}
NAMES = {"no_shard": "no_shard", "optim": "ZeRO-1 (optim)", "optim_grads": "ZeRO-2 (optim_grads)",
         "optim_grads_params": "ZeRO-3 (optim_grads_params)"}


# ---- running N gloo ranks, each in a fresh process ------------------------------------------------------
def _rank_main(rank, world, port, out_dir, fn, args):
    import torch
    import torch.distributed as dist
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = fn(rank, world, *args)
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def spawn(world: int, fn, *args) -> list:
    from megalite.train.allocator import set_allocator_policy
    set_allocator_policy()           # pretrain_gpt.py's, exported to the ranks (fresh interpreters)
    import socket
    import torch
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(world, port, out_dir, fn, args), nprocs=world, join=True)
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world)]


def random_batches(shape: Shape, seed: int):
    """Token batches in pretrain_gpt.py's format; every rank of a layout draws its own."""
    import torch
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, shape.vocab - 1, (shape.mbs, shape.seq + 1), generator=g)
        yield {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(shape.mbs, shape.seq),
               "position_ids": torch.arange(shape.seq).expand(shape.mbs, shape.seq)}


class Window:
    """Peak RSS above the starting RSS over a block of code (the kernel's restarted high-water mark)."""

    def __enter__(self):
        from megalite.train.performance import current_rss_bytes, reset_peak_rss
        import gc
        gc.collect()
        reset_peak_rss()
        self.start = current_rss_bytes()
        return self

    def __exit__(self, *exc):
        from megalite.train.performance import window_peak_rss_bytes
        self.peak = window_peak_rss_bytes() - self.start
        return False


def timed_steps(step, steps: int) -> tuple[list[float], list[float]]:
    """Seconds and loss of each of ``steps`` calls of ``step()`` (ranks start each step together), with
    the RSS high-water mark restarted first so the peak is the steps'."""
    import torch
    from megalite.train.performance import reset_peak_rss
    reset_peak_rss()
    times, losses = [], []
    for _ in range(steps):
        torch.distributed.barrier()
        t = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t)
    return times, losses


# ---- megalite's own strategies ----------------------------------------------------------------------------
def _megalite_run(rank, world, argv, shape, steps):
    """Start-up and training-step peaks (bytes above the pre-start-up RSS) and step times of one layout."""
    import torch
    from megalite.train.command_line import parse_args
    from megalite.train.performance import current_rss_bytes, window_peak_rss_bytes
    from megalite.train.trainer import build_trainer
    from megalite.train.step import train_step
    with Window() as startup:
        trainer = build_trainer(parse_args(argv, world_size=world))
    base = startup.start
    data = random_batches(shape, rank)
    times, losses = timed_steps(lambda: float(train_step(trainer, data)[0]), steps)
    trainer.ddp.close()
    units = getattr(trainer.ddp, "units", [])        # the FSDP2 backend has no megalite gather units
    largest_unit = max((sum(p.numel() for p in u.params) for u in units), default=0)
    return {"startup": startup.peak, "step": window_peak_rss_bytes() - base, "times": times, "losses": losses,
            "psi": trainer.buffer.numel_unpadded, "held": current_rss_bytes() - base,
            "unit_bytes": largest_unit * trainer.buffer.param_shard.element_size()
            if trainer.buffer.param_shard is not None else 0}


def zero_argv(shape: Shape, world: int, micro_batches: int, strategy: str, precision: str | None,
              prefetch: bool = True) -> list[str]:
    argv = llama_argv(shape, shape.mbs, shape.mbs * world * micro_batches)
    argv += ["--data-parallel-sharding-strategy", strategy, "--overlap-grad-reduce", "--ddp-bucket-size", "4000000"]
    if strategy != "no_shard" and prefetch:
        argv.append("--overlap-param-gather")
    return argv + ([f"--{precision}"] if precision else [])


def bench_zero(args):
    """Each stage against the one before; ZeRO-3 twice: with --overlap-param-gather (the next unit is
    prefetched while one computes, so two units are gathered at the peak, as in FSDP2) and without it
    (one unit: 18Ψ/d + one layer), each against the ZeRO-2 row."""
    shape, world, m = args.zero_shape, 4, 4
    layouts = [(s, NAMES[s], s, True) for s in THEORY]
    layouts.append(("zero3_no_prefetch", NAMES["optim_grads_params"] + " without --overlap-param-gather",
                    "optim_grads_params", False))
    runs = {key: spawn(world, _megalite_run, zero_argv(shape, world, m, strategy, "bf16", prefetch), shape, args.steps)
            for key, _, strategy, prefetch in layouts}
    psi = runs["no_shard"][0]["psi"]
    rows = ["| strategy | theory (bytes/param) | theory MiB | measured peak MiB (max over ranks) | saving vs previous "
            "stage: measured / theory MiB | share of theoretical saving |", "|---|---|---|---|---|---|"]
    measured, shares = {}, {}
    for key, name, strategy, prefetch in layouts:
        peak = max(r["step"] for r in runs[key]) / MiB
        units = (2 if prefetch else 1) if strategy == "optim_grads_params" else 0
        theory = (THEORY[strategy](world) * psi + units * runs[key][0]["unit_bytes"]) / MiB
        measured[key] = (peak, theory)
        previous = {"no_shard": None, "optim": "no_shard", "optim_grads": "optim"}.get(key, "optim_grads")
        if previous is None:
            saving = "- | -"
        else:
            got, expected = measured[previous][0] - peak, measured[previous][1] - theory
            shares[key] = (name, got / expected)
            saving = f"{got:.0f} / {expected:.0f} | {got / expected:.2f}"
        per_param = f"{THEORY[strategy](world):.1f}" + {0: "", 1: " + one layer", 2: " + two layers"}[units]
        rows.append(f"| {name} | {per_param} | {theory:.0f} | {peak:.0f} | {saving} |")
    header = (f"{shape.describe()}; Ψ = {psi / 1e6:.1f}M parameters; bf16 parameters, fp32 gradients and Adam; "
              f"DP={world}, {m} micro-batches, --overlap-grad-reduce --overlap-param-gather (but the last row), "
              f"4M-element buckets; gloo on localhost. Peak RSS of {args.steps} training steps above the RSS before "
              f"start-up. Theory: the ZeRO paper's bytes per parameter with Megatron's fp32 gradient buffer; "
              f"ZeRO-3 adds its largest unit gathered in bf16 (18Ψ/d + one layer), twice with "
              f"--overlap-param-gather, whose prefetch gathers the next unit while one computes (FSDP2 does the "
              f"same). Both ZeRO-3 rows compare with ZeRO-2. Activations and the buckets in flight are extra and "
              f"cancel in the savings.")
    headlines = [(f"{name} memory saving over the stage before", "ZeRO theory (bytes per parameter)",
                  f"{share:.2f} of theory")
                 for name, share in shares.values()]
    return rows, header, headlines


# ---- the same stages through the user's command line ------------------------------------------------------
PRETRAIN_SHAPE = Shape(layers=4, hidden=1024, ffn=2816, heads=8, kv_heads=2, vocab=16384, seq=8)


def gathered_pair_numel(shape: Shape) -> int:
    """Parameters of the largest two consecutive ZeRO-3 gather units (embedding, each layer, output layer in
    order): one computing and the next prefetched by --overlap-param-gather."""
    kv = shape.hidden // shape.heads * shape.kv_heads
    layer = 2 * shape.hidden * shape.hidden + 2 * shape.hidden * kv + 3 * shape.hidden * shape.ffn + 2 * shape.hidden
    units = [shape.vocab * shape.hidden, *[layer] * shape.layers, shape.vocab * shape.hidden + shape.hidden]
    return max(a + b for a, b in zip(units, units[1:]))


def bench_zero_pretrain(args):
    """Each stage through ``torchrun pretrain_gpt.py``: the whole run's peak RSS per rank (start-up
    included, the same in every row, so it cancels in the savings)."""
    import re
    sys.path.insert(0, os.path.join(ROOT, "tests", "distributed"))
    from process_memory import run_pretrain_measured
    shape, world, steps = PRETRAIN_SHAPE, 4, max(args.steps, 2)
    peaks, psi = {}, None
    for strategy in THEORY:
        argv = zero_argv(shape, world, 1, strategy, "bf16") + ["--train-iters", str(steps), "--num-workers", "0"]
        run = run_pretrain_measured(world, argv, env=USER_ENV)
        if run.returncode != 0:
            raise RuntimeError(f"pretrain_gpt.py --data-parallel-sharding-strategy {strategy} failed:\n"
                               + run.stdout[-3000:])
        peaks[strategy] = max(run.rank_peak_rss.values()) / MiB
        psi = int(re.search(r"number of parameters: (\d+)", run.stdout).group(1))
    unit = gathered_pair_numel(shape) * 2 / MiB               # two bf16 units gathered at the peak
    rows = ["| strategy | theory (bytes/param) | theory MiB | measured peak MiB (max over ranks) | saving vs previous "
            "stage: measured / theory MiB | share of theoretical saving |", "|---|---|---|---|---|---|"]
    theory = {s: per_param(world) * psi / MiB + (unit if s == "optim_grads_params" else 0)
              for s, per_param in THEORY.items()}
    shares, previous = {}, None
    for strategy, per_param in THEORY.items():
        saving = "- | -"
        if previous is not None:
            got, expected = peaks[previous] - peaks[strategy], theory[previous] - theory[strategy]
            shares[strategy] = got / expected
            saving = f"{got:.0f} / {expected:.0f} | {got / expected:.2f}"
        extra = " + two units" if strategy == "optim_grads_params" else ""
        rows.append(f"| {NAMES[strategy]} | {per_param(world):.1f}{extra} | {theory[strategy]:.0f} | "
                    f"{peaks[strategy]:.0f} | {saving} |")
        previous = strategy
    header = (f"{shape.describe()}; Ψ = {psi / 1e6:.1f}M parameters; `torchrun --nproc_per_node {world} "
              f"pretrain_gpt.py` with --bf16, DP={world}, --overlap-grad-reduce --overlap-param-gather, "
              f"4M-element buckets, {steps} steps, no loader workers. Peak: each rank's VmHWM over the whole run "
              f"(max over ranks); start-up's torch and gloo are in every row and cancel in the savings. Theory as "
              f"above; ZeRO-3 adds the largest two consecutive units gathered in bf16 ({unit:.0f} MiB). Allocator: the "
              f"environment's (LD_PRELOAD={USER_ENV.get('LD_PRELOAD', '')!r}, "
              f"MALLOC_CONF={USER_ENV.get('MALLOC_CONF', '')!r}, "
              f"GLIBC_TUNABLES={USER_ENV.get('GLIBC_TUNABLES', '')!r}); pretrain_gpt.py sets its own policy "
              f"where these are empty.")
    headlines = [(f"{NAMES[s]} memory saving over the stage before, through pretrain_gpt.py",
                  "ZeRO theory (bytes per parameter)", f"{share:.2f} of theory") for s, share in shares.items()]
    return rows, header, headlines


# ---- PyTorch FSDP2, side by side ------------------------------------------------------------------------
def fsdp2_argv(argv: list[str]) -> list[str]:
    """The same run under megalite's PyTorch FSDP2 backend (it has no buckets: one layer at a time)."""
    argv = list(argv)
    if "--ddp-bucket-size" in argv:
        i = argv.index("--ddp-bucket-size")
        del argv[i:i + 2]
    return argv + ["--use-torch-fsdp2"]


def _fsdp2_run(rank, world, argv, shape, steps):
    """The same GPTModel, weights, batches, optimizer and clipping with --use-torch-fsdp2: fully_shard per
    layer and on the root (megalite/parallel/data/fsdp2.py)."""
    return _megalite_run(rank, world, fsdp2_argv(argv), shape, steps)


FSDP_LAYOUTS = [("DP=2", 2, 1), ("DP=4", 4, 1), ("DP=2, 4 micro-batches", 2, 4)]


def bench_fsdp2(args):
    shape = args.fsdp_shape
    rows = ["| layout | megalite ZeRO-3 step peak MiB | FSDP2 step peak MiB | ratio | megalite / FSDP2 start-up "
            "peak MiB | megalite ms / step | FSDP2 ms / step | time ratio | max loss difference |",
            "|---|---|---|---|---|---|---|---|---|"]
    headlines = []
    for name, world, m in FSDP_LAYOUTS:
        argv = zero_argv(shape, world, m, "optim_grads_params", None)
        ours, theirs = [], []
        for _ in range(args.rounds):               # alternate, so machine noise hits both alike
            ours.append(spawn(world, _megalite_run, argv, shape, args.steps))
            theirs.append(spawn(world, _fsdp2_run, argv, shape, args.steps))

        def peak(runs, key):
            return statistics.median(max(r[key] for r in ranks) for ranks in runs) / MiB

        def step_ms(runs):   # per step the slowest rank, skipping each run's first (warm-up) step
            return statistics.median(max(r["times"][i] for r in ranks) for ranks in runs
                                     for i in range(1, args.steps)) * 1000
        a, b = peak(ours, "step"), peak(theirs, "step")
        ta, tb = step_ms(ours), step_ms(theirs)
        diff = max(abs(x - y) for x, y in zip(ours[0][0]["losses"], theirs[0][0]["losses"]))
        rows.append(f"| {name} | {a:.0f} | {b:.0f} | {a / b:.2f} | {peak(ours, 'startup'):.0f} / "
                    f"{peak(theirs, 'startup'):.0f} | {ta:.0f} | {tb:.0f} | {ta / tb:.2f} | {diff:.1e} |")
        headlines.append((f"ZeRO-3 peak memory per rank, {name}", "PyTorch FSDP2, same model", f"{a / b:.2f}x"))
        headlines.append((f"ZeRO-3 step time, {name}", "PyTorch FSDP2, same model", f"{ta / tb:.2f}x"))
    header = (f"{shape.describe()}; fp32, --overlap-grad-reduce --overlap-param-gather; megalite ZeRO-3 "
              f"(--data-parallel-sharding-strategy optim_grads_params, 4M-element buckets) against "
              f"--use-torch-fsdp2 (PyTorch fully_shard per layer and root, reshard after forward); both through "
              f"build_trainer/train_step from the same seed (same weights, optimizer, clipping), same batches "
              f"(max loss difference in the table). Step peak: peak RSS over {args.steps} steps above the "
              f"RSS before start-up (max over ranks, median over {args.rounds} alternating runs); step time: median "
              f"of steps 2.., the slowest rank. Both run with one thread per rank on this machine's cores.")
    return rows, header, headlines


# ---- checkpoint save and load -----------------------------------------------------------------------------
def _checkpoint_run(rank, world, argv, shape, directory):
    import torch
    from megalite.train.command_line import parse_args
    from megalite.checkpoint.save import save_checkpoint
    from megalite.checkpoint.sharded import load_checkpoint
    from megalite.train.trainer import build_trainer
    from megalite.train.step import train_step
    trainer = build_trainer(parse_args(argv, world_size=world))
    train_step(trainer, random_batches(shape, rank))
    trainer.ddp.close()
    state = (trainer.buffer.param_bytes() + trainer.buffer.grad_bytes() + trainer.optimizer.state_bytes())
    torch.distributed.barrier()
    with Window() as save:
        t = time.perf_counter()
        path = save_checkpoint(trainer.checkpoint_state, directory)
        torch.distributed.barrier()
        save_seconds = time.perf_counter() - t
    with Window() as load:
        t = time.perf_counter()
        load_checkpoint(trainer.checkpoint_state, path, log=lambda *_: None)
        torch.distributed.barrier()
        load_seconds = time.perf_counter() - t
    return {"save_peak": save.peak, "load_peak": load.peak, "save_s": save_seconds, "load_s": load_seconds,
            "state": state, "path": path}


def disk_write_speed(directory: str, nbytes: int) -> float:
    """Bytes/s of writing ``nbytes`` to one file with an fsync (what any checkpoint writer pays)."""
    block = os.urandom(1 << 20) * 16
    path = os.path.join(directory, "speed-probe")
    t = time.perf_counter()
    with open(path, "wb") as f:
        written = 0
        while written < nbytes:
            written += f.write(block[:min(len(block), nbytes - written)])
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t
    os.remove(path)
    return nbytes / seconds


def bench_checkpoint(args):
    shape, world = args.zero_shape, 2
    argv = zero_argv(shape, world, 1, "optim_grads_params", "bf16")
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        runs = spawn(world, _checkpoint_run, argv, shape, os.path.join(tmp, "ck"))
        path = runs[0]["path"]
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        disk = disk_write_speed(tmp, size)
    save_s, load_s = max(r["save_s"] for r in runs), max(r["load_s"] for r in runs)
    rows = ["| operation | checkpoint MiB | seconds | MiB/s | vs disk write speed | peak RSS above the rank's own "
            "state, MiB (max over ranks) | the rank's own state MiB |", "|---|---|---|---|---|---|---|"]
    for name, seconds, key in (("save", save_s, "save_peak"), ("load", load_s, "load_peak")):
        rows.append(f"| {name} | {size / MiB:.0f} | {seconds:.2f} | {size / MiB / seconds:.0f} | "
                    f"{size / seconds / disk:.2f}x | {max(r[key] for r in runs) / MiB:.0f} | "
                    f"{max(r['state'] for r in runs) / MiB:.0f} |")
    header = (f"{shape.describe()}; bf16, ZeRO-3 at DP={world}; each rank writes and reads only its own slices. "
              f"Disk: {disk / MiB:.0f} MiB/s writing the same bytes to one fsync'd file.")
    headlines = [("checkpoint save throughput", "this disk's write speed", f"{size / save_s / disk:.2f}x"),
                 ("checkpoint save peak memory above a rank's state", "the rank's own state",
                  f"{max(r['save_peak'] for r in runs) / max(r['state'] for r in runs):.2f}x")]
    return rows, header, headlines


# ---- activations ---------------------------------------------------------------------------------------
def bench_activations(args):
    from activation_memory import CONFIGS, activation_table, markdown
    rows = activation_table(CONFIGS[:1] if args.quick else CONFIGS)
    tp1 = [r for r in rows if r["tp"] == 1]
    sharded = [r for r in rows if r["tp"] > 1]
    header = ("Bytes autograd keeps for backward per transformer layer (unique storages saved, parameters "
              "excluded), per rank. Megatron: Korthikanti et al. 2022, 34sbh/t with flash attention (the 5as/h "
              "term only without it); transformers: LlamaForCausalLM's decoder layer on the same config. "
              "Command: python bench/activation_memory.py prints the same table.")
    # Megatron-Core needs the KV heads to divide by TP; megalite also runs t > KV heads by replicating
    # each group's K/V on t/g ranks, which no implementation can shard below s*b*d per rank: those rows
    # are compared with the minimum's own share (minimum at t x t / minimum at 1) instead of 1.00
    divisible = [r for r in sharded if r["kv_heads"] % r["tp"] == 0]
    replicated = [r for r in sharded if r["kv_heads"] % r["tp"]]
    headlines = [("activations per layer, TP=1", "transformers LlamaForCausalLM, same config",
                  f"{max(r['vs_transformers'] for r in tp1 if r['vs_transformers'] is not None):.2f}x (worst config)"),
                 ("activations per layer x t, TP=t + SP, KV heads divisible by t", "TP=1 (ideal 1.00)",
                  f"{max(r['share_of_tp1'] for r in divisible):.3f} (worst config)")]
    if replicated:
        headlines.append(("activations per layer x t, TP=t + SP, t > KV heads (K/V replicated)",
                          "the minimum's own share at that t", f"{max(r['share_of_tp1'] / r['minimum_share'] for r in replicated):.3f} (worst config)"))
    return markdown(rows).splitlines(), header, headlines


def bench_cross_entropy(args):
    from cross_entropy_memory import cross_entropy_memory
    rows = ["| tokens | vocab | dtype | logits MiB | unfused loss peak MiB | fused (--cross-entropy-loss-fusion) "
            "peak MiB | fused / unfused |", "|---|---|---|---|---|---|---|"]
    ratios = []
    for vocab in ((32000,) if args.quick else (32000, 128256)):
        r = cross_entropy_memory(512 if args.quick else 2048, vocab)
        ratios.append(r["ratio"])
        rows.append(f"| {r['tokens']} | {vocab} | {r['dtype']} | {r['logits bytes'] / MiB:.1f} | "
                    f"{r['unfused peak bytes'] / MiB:.1f} | {r['fused peak bytes'] / MiB:.1f} | {r['ratio']:.2f} |")
    header = ("Peak bytes of the loss's forward and backward over bf16 logits (the logits themselves not counted): "
              "the unfused loss copies them to fp32 for every token at once; the chunked one upcasts one chunk "
              "at a time and recomputes the softmax in backward.")
    return rows, header, [("--cross-entropy-loss-fusion loss memory", "unfused vocab-parallel cross-entropy",
                           f"{max(ratios):.2f}x")]


SECTIONS = {"zero": ("bench_memory_zero", "Memory per rank by ZeRO stage, against theory", bench_zero),
            "zero-pretrain": ("bench_memory_zero_pretrain", "Memory per rank by ZeRO stage through pretrain_gpt.py",
                              bench_zero_pretrain),
            "fsdp2": ("bench_memory_fsdp2", "ZeRO-3 against PyTorch FSDP2: memory and step time", bench_fsdp2),
            "checkpoint": ("bench_memory_checkpoint", "Checkpoint save and load: memory and throughput",
                           bench_checkpoint),
            "activations": ("bench_memory_activations", "Activation memory per layer", bench_activations),
            "cross-entropy": ("bench_memory_cross_entropy", "Loss memory: fused (chunked) cross-entropy",
                              bench_cross_entropy)}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {list(SECTIONS)}")
    p.add_argument("--steps", type=int, help="training steps per run (default 3; 2 with --quick)")
    p.add_argument("--rounds", type=int, help="alternating runs per FSDP2 comparison (default 2; 1 with --quick)")
    add_common_args(p)
    args = p.parse_args(argv)
    args.zero_shape = QUICK_SHAPE if args.quick else ZERO_SHAPE
    args.fsdp_shape = QUICK_SHAPE if args.quick else FSDP_SHAPE
    args.steps = args.steps or (2 if args.quick else 3)
    args.rounds = args.rounds or (1 if args.quick else 2)
    command = command_line("bench_memory.py", argv)
    for name in args.sections.split(","):
        key, title, fn = SECTIONS[name]
        rows, header, figures = fn(args)
        print(f"## {title}\n{header}\n" + "\n".join(rows), flush=True)
        publish(args, key, title, command, [Headline(*f, command) for f in figures], [header, "", *rows])


if __name__ == "__main__":
    main(sys.argv[1:])
