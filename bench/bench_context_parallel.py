#!/usr/bin/env python
"""Context parallelism: activation memory per rank vs sequence length at cp = 1, 2, 4, and the memory and
time of one ring-attention block at 8K-token chunks, before and after the fused block kernels.

Each row of the first table runs one forward of a small Llama-style GPTModel (with its loss) on cp gloo
ranks and sums the bytes of the tensors autograd saves for backward (torch.autograd.graph.saved_tensors_hooks;
parameters and storages seen twice are not counted) on CP rank 0. That is the activation memory a
training step holds between forward and backward; with ring attention it should fall ~1/cp.

The second table runs one full (off-diagonal) block of ring attention, forward and backward, as the ring
computes it: c queries of 8 heads against c keys/values of 2 KV groups. "before" is the explicit fp32
math ring attention used to run per block (kept below as the baseline: it materialises the block's
[b, groups, c x heads_per_group, c] scores, probabilities and their gradients); "after" is the fused
kernel pair of megalite/parallel/context/block_kernels.py. Each runs in a fresh process; memory is the
peak of the tensors the block's ops create alive at once (LiveBytes) and the growth of the process's
peak RSS, which also counts the kernels' internal buffers.

The third table sets the ring (--cp-comm-type p2p), Ulysses (a2a) and the K/V all-gather (allgather) side
by side at cp = 2 and 4 on gloo, each on the same cp processes: the time of one attention layer's forward
and backward over the whole sequence (the only part of a training step where they differ), causal, with
their communication. Writes a section of bench/RESULTS.md.

    python bench/bench_context_parallel.py
    python bench/bench_context_parallel.py --quick      # smoke test: seq 256 and 512, cp 1 and 2, chunk 1024,
                                                        # comm types at seq 1024
"""
import argparse
import math
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from cross_entropy_memory import LiveBytes  # noqa: E402
from megalite.parallel.context import build_context_parallel, context_parallel_loss, slice_for_context_parallel  # noqa: E402,E501
from megalite.parallel.context.block_kernels import block_backward, block_forward  # noqa: E402
from megalite.parallel.context.ulysses import context_attention  # noqa: E402
from megalite.model.attention.core import core_attention  # noqa: E402
from megalite.model.attention.mask import MaskSpec  # noqa: E402
from megalite.train.performance import current_rss_bytes, reset_peak_rss, window_peak_rss_bytes  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402
from megalite.train.command_line import parse_args  # noqa: E402
from megalite.parallel.mesh import ParallelState  # noqa: E402

SEQ_LENGTHS, QUICK_SEQ_LENGTHS = (256, 512, 1024, 2048), (256, 512)
CPS, QUICK_CPS = (1, 2, 4), (1, 2)
MODEL = ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "352", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rope",
         "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--micro-batch-size", "1",
         "--global-batch-size", "1", "--lr", "1e-3", "--train-iters", "1", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
CHUNK, QUICK_CHUNK = 8192, 1024
BLOCK_HEADS, BLOCK_GROUPS, BLOCK_HEAD_DIM = 8, 2, 64            # hidden 512, GQA 4 query heads per KV group
COMM_SEQ, QUICK_COMM_SEQ, COMM_CPS, COMM_REPEATS = 8192, 1024, (2, 4), 3
COMM_HEADS, COMM_GROUPS = 8, 4                                  # divisible by every cp of COMM_CPS (Ulysses)
COMM_TYPES = ("p2p", "a2a", "allgather")
COMM_NAMES = {"p2p": "ring (p2p)", "a2a": "Ulysses (a2a)", "allgather": "all-gather (allgather)"}


def saved_activation_bytes(cp_size: int, rank: int, seq: int) -> int:
    argv = MODEL + ["--seq-length", str(seq), "--max-position-embeddings", str(seq),
                    "--context-parallel-size", str(cp_size)]
    cfg = parse_args(argv, world_size=cp_size)
    state = ParallelState.build(cp_size, rank, cp=cp_size)
    cp = build_context_parallel(state)
    model = GPTModel(cfg.model, seed=1, cp=cp)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (1, seq + 1), generator=g)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(1, seq),
             "position_ids": torch.arange(seq)[None]}
    batch = slice_for_context_parallel(batch, cp.rank, cp.size)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), [0]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        per_token = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
        loss, _ = context_parallel_loss(per_token, batch["loss_mask"], cp)
    loss.backward()
    return total[0]


def _rank(rank: int, cp_size: int, port: int, seq_lengths: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp_size)
    torch.set_num_threads(1)
    try:
        for seq in seq_lengths:
            result = saved_activation_bytes(cp_size, rank, seq)
            if rank == 0:
                queue.put((seq, result))
    finally:
        dist.destroy_process_group()


def measure(cp_size: int, seq_lengths: tuple, rank_fn=_rank) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank_fn, args=(cp_size, port, seq_lengths, queue), nprocs=cp_size, join=True)
    results = {}
    while not queue.empty():
        seq, value = queue.get()
        results[seq] = value
    return results


# ---- ring vs Ulysses vs all-gather: one attention layer, forward and backward ------------------------
def attention_seconds(cp_size: int, rank: int, seq: int) -> dict:
    """Per comm type, the best of COMM_REPEATS timings (after one warm-up) of one causal attention forward +
    backward at ``seq`` tokens over ``cp_size`` ranks (fp32, batch 1, head dim BLOCK_HEAD_DIM). The comm
    types take turns, so a change in the machine's load falls on all of them alike."""
    state = ParallelState.build(cp_size, rank, cp=cp_size)
    cps = {kind: build_context_parallel(state, (kind,)).for_layer(1) for kind in COMM_TYPES}
    g = torch.Generator().manual_seed(rank)
    local = seq // cp_size
    q, dout = (torch.randn(local, 1, COMM_HEADS, BLOCK_HEAD_DIM, generator=g) for _ in range(2))
    k, v = (torch.randn(local, 1, COMM_GROUPS, BLOCK_HEAD_DIM, generator=g) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = MaskSpec()
    times = {kind: [] for kind in COMM_TYPES}
    for _ in range(COMM_REPEATS + 1):
        for kind, cp in cps.items():
            dist.barrier()
            start = time.perf_counter()
            context_attention(q, k, v, cp, mask, lambda *t: core_attention(*t, mask)).backward(dout.view(local, 1, -1))
            dist.barrier()
            times[kind].append(time.perf_counter() - start)
    return {kind: min(t[1:]) for kind, t in times.items()}


def _comm_rank(rank: int, cp_size: int, port: int, seq: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp_size)
    torch.set_num_threads(1)
    try:
        seconds = attention_seconds(cp_size, rank, seq)
        if rank == 0:
            for kind in COMM_TYPES:
                queue.put((kind, seconds[kind]))
    finally:
        dist.destroy_process_group()


def comm_type_rows(seq: int) -> tuple[list[str], dict, tuple]:
    """The table's rows, its figures and the 1-minute load average before and after it was measured."""
    before = os.getloadavg()[0]
    table = {cp: measure(cp, seq, _comm_rank) for cp in COMM_CPS}
    loads = (before, os.getloadavg()[0])
    rows = ["| " + " | ".join([str(cp), *(f"{t[kind] * 1e3:.0f} ms" for kind in COMM_TYPES),
                                *(f"{t[kind] / t['p2p']:.2f}x" for kind in COMM_TYPES[1:])]) + " |"
            for cp, t in table.items()]
    print(*rows, f"load average {loads[0]:.1f} before, {loads[1]:.1f} after", sep="\n", flush=True)
    return rows, table, loads


# ---- one ring block: before (explicit fp32 math, the baseline) and after (fused kernels) -----------
def _old_block_forward(q, k, v, scale: float):
    """The baseline's full block: q [b, g, rows, d], k, v [b, g, c, d] fp32 -> (out, lse [b, g, rows])."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs, v), lse


def _old_block_backward(q, k, v, d_out, lse, delta, scale: float):
    """The baseline's gradients (dq, dk, dv) of a full block given the final lse and delta = rowsum(dO * O)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-1, -2), d_out)
    dprobs = torch.matmul(d_out, v.transpose(-1, -2))
    dscores = probs * (dprobs - delta.unsqueeze(-1))
    dq = torch.matmul(dscores, k).mul_(scale)
    dk = torch.matmul(dscores.transpose(-1, -2), q).mul_(scale)
    return dq, dk, dv


def _block_inputs(chunk: int, old: bool):
    """q, k, v, dout of one block in the layout each implementation works in (fp32, batch 1)."""
    g = torch.Generator().manual_seed(0)
    nh, ng, d = BLOCK_HEADS, BLOCK_GROUPS, BLOCK_HEAD_DIM
    q, dout = (torch.randn(chunk, 1, nh, d, generator=g) for _ in range(2))
    k, v = (torch.randn(chunk, 1, ng, d, generator=g) for _ in range(2))
    if old:      # grouped: [b, g, c * heads_per_group, d] queries, [b, g, c, d] keys/values
        return (q.view(chunk, 1, ng, nh // ng, d).permute(1, 2, 0, 3, 4).reshape(1, ng, -1, d).contiguous(),
                k.permute(1, 2, 0, 3).contiguous(), v.permute(1, 2, 0, 3).contiguous(),
                dout.view(chunk, 1, ng, nh // ng, d).permute(1, 2, 0, 3, 4).reshape(1, ng, -1, d).contiguous())
    return tuple(t.permute(1, 2, 0, 3) for t in (q, k, v, dout))      # [b, heads, c, d] views of [c, b, heads, d]


def _block_step(chunk: int, old: bool) -> dict:
    """Forward and backward of one full block: seconds of each, peak live bytes, peak RSS growth."""
    q, k, v, dout = _block_inputs(chunk, old)
    scale = 1.0 / math.sqrt(BLOCK_HEAD_DIM)
    reset_peak_rss()
    rss = current_rss_bytes()
    with LiveBytes() as live:
        start = time.perf_counter()
        if old:
            out, lse = _old_block_forward(q, k, v, scale)
            middle = time.perf_counter()
            delta = (dout * out).sum(-1)
            grads = _old_block_backward(q, k, v, dout, lse, delta, scale)
        else:
            out, lse = block_forward(q, k, v, False, scale)
            middle = time.perf_counter()
            grads = block_backward(dout, q, k, v, out, lse, False, scale)
        end = time.perf_counter()
        del out, lse, grads
    return {"forward_s": middle - start, "backward_s": end - middle, "live_bytes": live.peak,
            "rss_bytes": window_peak_rss_bytes() - rss, "input_bytes": sum(t.numel() * 4 for t in (q, k, v, dout))}


def _block_process(chunk: int, old: bool, queue) -> None:
    _block_step(256, old)                                   # warm-up: kernels, thread pool
    queue.put(_block_step(chunk, old))


def measure_block(chunk: int, old: bool) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    proc = ctx.Process(target=_block_process, args=(chunk, old, queue))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"block measurement ({'before' if old else 'after'}, chunk {chunk}) exited {proc.exitcode}")
    return queue.get()


def block_rows(chunk: int) -> tuple[list[str], dict, dict]:
    before, after = measure_block(chunk, old=True), measure_block(chunk, old=False)
    scores = BLOCK_HEADS * chunk * chunk * 4
    rows = []
    for name, r in (("before: explicit fp32 math", before), ("after: fused kernels", after)):
        rows.append(f"| {name} | {r['live_bytes'] / 2**20:.0f} MiB ({r['live_bytes'] / scores:.2f}x) | "
                    f"{r['rss_bytes'] / 2**20:.0f} MiB | {r['forward_s']:.2f} s | {r['backward_s']:.2f} s |")
        print(rows[-1], flush=True)
    return rows, before, after


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    args = parser.parse_args(argv)
    seq_lengths, cps = (QUICK_SEQ_LENGTHS, QUICK_CPS) if args.quick else (SEQ_LENGTHS, CPS)
    chunk = QUICK_CHUNK if args.quick else CHUNK
    block, before, after = block_rows(chunk)
    comm_seq = QUICK_COMM_SEQ if args.quick else COMM_SEQ
    comm_rows, comm_table, loads = comm_type_rows(comm_seq)
    table = {cp: measure(cp, seq_lengths) for cp in cps}
    rows = []
    for seq in seq_lengths:
        base = table[1][seq]
        cells = [f"{table[cp][seq] / 2**20:.2f} MiB ({table[cp][seq] / base:.2f}x)" for cp in cps]
        rows.append(f"| {seq} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    command = command_line("bench_context_parallel.py", argv)
    longest = seq_lengths[-1]
    headlines = [Headline(f"context parallel activation memory per rank, cp={cp}, seq {longest}",
                          f"cp=1 (one rank holds the whole sequence); ideal 1/{cp} = {1 / cp:.2f}x",
                          f"{table[cp][longest] / table[1][longest]:.2f}x", command) for cp in cps[1:]]
    headlines += [Headline(f"ring attention block memory at {chunk}-token chunks (peak live tensors)",
                           "the explicit fp32 math blocks", f"{after['live_bytes'] / before['live_bytes']:.3f}x", command),
                  Headline(f"ring attention block time at {chunk}-token chunks (forward + backward)",
                           "the explicit fp32 math blocks",
                           f"{(after['forward_s'] + after['backward_s']) / (before['forward_s'] + before['backward_s']):.2f}x",
                           command)]
    headlines += [Headline(f"{COMM_NAMES[kind]} attention forward + backward, cp={cp}, seq {comm_seq}, gloo",
                           "the ring (p2p)", f"{t[kind] / t['p2p']:.2f}x", command)
                  for kind in COMM_TYPES[1:] for cp, t in comm_table.items()]
    body = ["Llama-style GPTModel, 2 layers, hidden 128, 4 heads / 2 KV groups, vocab 1000, micro-batch 1, fp32; one "
            "forward with its loss on cp gloo ranks. Figure: bytes of the tensors autograd saves for backward on CP "
            "rank 0 (parameters excluded), in brackets relative to cp=1. Ring attention saves only the local "
            "queries, keys/values, output and log-sum-exp (no s x s probabilities), so the saved activations fall "
            "as 1/cp.",
            "", "| seq length | " + " | ".join(f"cp={cp}" for cp in cps) + " |", "|---|" + "---|" * len(cps), *rows,
            "", f"One full ring-attention block at c = {chunk} tokens per chunk: {BLOCK_HEADS} query heads, "
            f"{BLOCK_GROUPS} KV groups, head dim {BLOCK_HEAD_DIM}, batch 1, fp32, forward and backward "
            f"({torch.get_num_threads()} threads). Peak live tensors: bytes of the tensors the block's ops create "
            f"alive at once, in brackets relative to one fp32 [heads, c, c] score matrix "
            f"({BLOCK_HEADS * chunk * chunk * 4 / 2**30:.2f} GiB); the block's inputs (q, k, v, dout) are "
            f"{after['input_bytes'] / 2**20:.0f} MiB. Peak RSS growth also counts the kernels' internal buffers.",
            "", "| block | peak live tensors | peak RSS growth | forward | backward |", "|---|---|---|---|---|", *block,
            "", f"Ring (p2p) vs Ulysses (a2a) vs all-gather (allgather): one causal attention layer's forward and "
            f"backward at {comm_seq} tokens, {COMM_HEADS} query heads / {COMM_GROUPS} KV groups, head dim "
            f"{BLOCK_HEAD_DIM}, batch 1, fp32, on cp gloo ranks of one thread each, the same cp processes for every "
            f"comm type, taking turns (best of {COMM_REPEATS}, CP rank 0). Load average {loads[0]:.1f} when this "
            f"table started, {loads[1]:.1f} when it ended: the machine is shared, so the ratios carry its noise.",
            "", "| cp | " + " | ".join(COMM_NAMES[kind] for kind in COMM_TYPES) + " | "
            + " | ".join(f"{kind} / p2p" for kind in COMM_TYPES[1:]) + " |",
            "|---|" + "---|" * (2 * len(COMM_TYPES) - 1), *comm_rows]
    publish(args, "bench_context_parallel", "Context parallelism: activation memory per rank vs sequence length",
            command, headlines, body)


if __name__ == "__main__":
    main(sys.argv[1:])
