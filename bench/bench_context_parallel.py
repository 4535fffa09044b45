#!/usr/bin/env python
"""Context parallelism: activation memory per rank vs sequence length at cp = 1, 2, 4.

Each row runs one forward of a small Llama-style GPTModel (with its loss) on cp gloo ranks and sums the
bytes of the tensors autograd saves for backward (torch.autograd.graph.saved_tensors_hooks; parameters
and storages seen twice are not counted) on CP rank 0. That is the activation memory a training step
holds between forward and backward; with ring attention it should fall ~1/cp. Writes a section of
bench/RESULTS.md.

    python bench/bench_context_parallel.py
    python bench/bench_context_parallel.py --quick      # smoke test: seq 256 and 512, cp 1 and 2
"""
import argparse
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from megalite.parallel.context import build_context_parallel, context_parallel_loss, slice_for_context_parallel  # noqa: E402,E501
from megalite.model.gpt import GPTModel  # noqa: E402
from megalite.config.megatron_cli import parse_args  # noqa: E402
from megalite.parallel.mesh import ParallelState  # noqa: E402

SEQ_LENGTHS, QUICK_SEQ_LENGTHS = (256, 512, 1024, 2048), (256, 512)
CPS, QUICK_CPS = (1, 2, 4), (1, 2)
MODEL = ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "352", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rope",
         "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--micro-batch-size", "1",
         "--global-batch-size", "1", "--lr", "1e-3", "--train-iters", "1", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


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


def measure(cp_size: int, seq_lengths: tuple) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(cp_size, port, seq_lengths, queue), nprocs=cp_size, join=True)
    results = {}
    while not queue.empty():
        seq, value = queue.get()
        results[seq] = value
    return results


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    args = parser.parse_args(argv)
    seq_lengths, cps = (QUICK_SEQ_LENGTHS, QUICK_CPS) if args.quick else (SEQ_LENGTHS, CPS)
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
    body = ["Llama-style GPTModel, 2 layers, hidden 128, 4 heads / 2 KV groups, vocab 1000, micro-batch 1, fp32; one "
            "forward with its loss on cp gloo ranks. Figure: bytes of the tensors autograd saves for backward on CP "
            "rank 0 (parameters excluded), in brackets relative to cp=1. Ring attention saves only the local "
            "queries, keys/values, output and log-sum-exp (no s x s probabilities), so the saved activations fall "
            "as 1/cp.",
            "", "| seq length | " + " | ".join(f"cp={cp}" for cp in cps) + " |", "|---|" + "---|" * len(cps), *rows]
    publish(args, "bench_context_parallel", "Context parallelism: activation memory per rank vs sequence length",
            command, headlines, body)


if __name__ == "__main__":
    main(sys.argv[1:])
