#!/usr/bin/env python
"""Initial weights of a 1B-parameter shard: how long one rank takes to draw them under torchrun's thread
setting (OMP_NUM_THREADS=1), with megalite's generator (megalite/model/init.py) beside the reference
implementation of the same formula kept here (``reference_values``: int64 hashes and float64 temporaries
over 4M-element chunks, one torch thread), which tests/unit/model/test_init_values.py checks megalite's
values against, bit for bit.

The shard: the weights of one rank of Llama-2 70B at TP8 x PP8 (TP rank 3 of pipeline stage 3, layers
30-39, no embedding): 1.07 B elements, parameters on the meta device with their tensor-parallel layout
(fused QKV and SwiGLU rows, row-parallel column blocks), each filled as the data-parallel buffer fills
this rank's storage at start-up (materialise.fill_initial: ``init_values`` a bounded chunk at a time).

megalite's generator runs on the whole shard, with its threads (one per core here) and with one thread
(what each rank gets when torchrun starts one rank per core). The reference takes minutes for the whole
shard, so it runs on the first 2**22 elements of each of the four weights of a layer, and its time is
scaled by each weight's element count; megalite's values on those elements are compared with it.

    python bench/bench_init.py             # writes bench/RESULTS.md
    python bench/bench_init.py --quick     # one layer, 2**18 reference elements per weight
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from results import Headline, add_common_args, command_line, publish  # noqa: E402

from megalite.model import init  # noqa: E402
from megalite.parallel.data.materialise import fill_initial  # noqa: E402
from megalite.parallel.param_meta import mark, param_meta  # noqa: E402
from megalite.parallel.tensor.layers import shard_positions  # noqa: E402

HIDDEN, FFN, HEADS, GROUPS, HEAD_DIM, LAYERS = 8192, 28672, 64, 8, 128, 80      # Llama-2 70B
TP, TP_RANK, STAGE, LAYERS_PER_STAGE = 8, 3, 3, 10
BASE_STD, SEED = 0.02, 1234
REFERENCE_SAMPLE = 1 << 22


# ---- the reference implementation ---------------------------------------------------------------
_MASK32 = 0xFFFFFFFF


def _reference_hash32(x: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def _reference_uniform(index: torch.Tensor, key: int) -> torch.Tensor:
    high = _reference_hash32((index >> 32) ^ key)
    bits = _reference_hash32(_reference_hash32((index & _MASK32) ^ high) ^ ((key * 0x9E3779B1) & _MASK32))
    return (bits.double() + 0.5) / 2.0 ** 32


def reference_normal(index: torch.Tensor, key: int) -> torch.Tensor:
    """Standard normal samples (float64) for int64 flat indices of a tensor keyed ``key``."""
    u1 = _reference_uniform(index, key)
    u2 = _reference_uniform(index, key ^ 0x5BD1E995)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


def reference_values(param: torch.nn.Parameter, global_name: str, base_std: float, num_layers: int, seed: int,
                     start: int, end: int) -> torch.Tensor:
    """fp32 values of a weight's local elements [start, end), as ``init.initial_values`` gives them."""
    rows, cols, full_cols = shard_positions(param)
    local_cols = cols.numel()
    key, std = init.param_seed(seed, global_name), init.init_std(global_name, base_std, num_layers)
    out = torch.empty(end - start)
    for lo in range(start, end, 1 << 22):
        hi = min(end, lo + (1 << 22))
        local = torch.arange(lo, hi)
        full_index = rows[local // local_cols] * full_cols + cols[local % local_cols]
        out[lo - start:hi - start] = reference_normal(full_index, key) * std
    return out


# ---- the shard ----------------------------------------------------------------------------------
def _rows(blocks: list[tuple[int, int]]):
    """take_shard selecting row blocks [lo, hi) of a full tensor, concatenated."""
    return lambda full: torch.cat([full[lo:hi] for lo, hi in blocks])


def _weight(full_shape: tuple[int, int], take_shard, partition_dim: int) -> torch.nn.Parameter:
    local = take_shard(torch.empty(full_shape, device="meta")).shape
    return mark(torch.nn.Parameter(torch.empty(local, device="meta")), full_shape=full_shape,
                take_shard=take_shard, tensor_model_parallel=True, partition_dim=partition_dim)


def layer_weights(layer: int) -> dict[str, torch.nn.Parameter]:
    """One layer's weights on TP rank TP_RANK, by global name."""
    qkv_rows = (HEADS + 2 * GROUPS) * HEAD_DIM // TP            # this rank's query groups, with their K and V
    ffn, cols = FFN // TP, HIDDEN // TP
    prefix = f"decoder.layers.{layer}."
    return {
        prefix + "self_attention.linear_qkv.weight": _weight(
            ((HEADS + 2 * GROUPS) * HEAD_DIM, HIDDEN), _rows([(TP_RANK * qkv_rows, (TP_RANK + 1) * qkv_rows)]), 0),
        prefix + "self_attention.linear_proj.weight": _weight(
            (HIDDEN, HEADS * HEAD_DIM), lambda full: full[:, TP_RANK * cols:(TP_RANK + 1) * cols], 1),
        prefix + "mlp.linear_fc1.weight": _weight(                 # [gate; up]: this rank's block of each
            (2 * FFN, HIDDEN), _rows([(TP_RANK * ffn, (TP_RANK + 1) * ffn),
                                      (FFN + TP_RANK * ffn, FFN + (TP_RANK + 1) * ffn)]), 0),
        prefix + "mlp.linear_fc2.weight": _weight(
            (HIDDEN, FFN), lambda full: full[:, TP_RANK * ffn:(TP_RANK + 1) * ffn], 1),
    }


def shard(layers: int) -> dict[str, torch.nn.Parameter]:
    first = STAGE * LAYERS_PER_STAGE
    weights = {}
    for layer in range(first, first + layers):
        weights.update(layer_weights(layer))
    return weights


# ---- timing -------------------------------------------------------------------------------------
def fill(weights: dict[str, torch.nn.Parameter], values, count: int | None = None) -> tuple[list, list]:
    """Seconds to fill each weight's storage (its first ``count`` elements, or all) from ``values``, and
    what it was filled with (with ``count``)."""
    seconds, filled = [], []
    for name, param in weights.items():
        mark(param, init_values=partial(values, param, name, BASE_STD, LAYERS, SEED))
        n = param.numel() if count is None else min(count, param.numel())
        target = torch.zeros(n)             # allocated and zeroed before the fill, as the buffer's storage is
        start = time.perf_counter()
        fill_initial(target, param_meta(param).init_values, 0, n)
        seconds.append(time.perf_counter() - start)
        filled.append(target if count is not None else None)
    return seconds, filled


def megalite_seconds(weights: dict, threads: int) -> float:
    """The whole shard with megalite's generator on ``threads`` threads (1: as each rank of torchrun's one
    rank per core gets)."""
    os.environ["LOCAL_WORLD_SIZE"] = str(max(1, init._threads() // threads))
    try:
        return sum(fill(weights, init.initial_values)[0])
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


def measure(quick: bool) -> dict:
    layers = 1 if quick else LAYERS_PER_STAGE
    weights = shard(layers)
    sample = 1 << 18 if quick else REFERENCE_SAMPLE
    layer = dict(list(weights.items())[:4])
    ref_seconds, ref_values = fill(layer, reference_values, sample)
    _, new_values = fill(layer, init.initial_values, sample)
    sampled = [min(sample, p.numel()) for p in layer.values()]
    scaled = layers * sum(t / n * p.numel() for t, n, p in zip(ref_seconds, sampled, layer.values()))
    return {"elements": sum(p.numel() for p in weights.values()), "sampled": sum(sampled), "sample": sample,
            "ref_sampled_seconds": sum(ref_seconds), "ref_seconds": scaled, "threads": init._threads(),
            "identical": all(torch.equal(a, b) for a, b in zip(ref_values, new_values)),
            "new_seconds": megalite_seconds(weights, init._threads()),
            "new_one_thread_seconds": megalite_seconds(weights, 1)}


def report(r: dict) -> list[str]:
    def row(name, threads, elements, seconds, shard_seconds):
        return (f"| {name} | {threads} | {elements / 1e6:,.1f} M | {seconds:.2f} | "
                f"{seconds / elements * 1e9:.1f} | {shard_seconds:.1f} |")
    return [f"Seconds to fill this rank's {r['elements'] / 1e9:.2f} B weight elements, torch at one thread "
            "(OMP_NUM_THREADS=1); megalite's threads are its own, one per core. Each weight's storage is "
            "allocated and zeroed before its timed fill, as the buffer's is; the fill includes each range's "
            "returned tensor (64 MiB per 16M elements) and its copy into the storage.", "",
            "| generator | threads | elements timed | seconds | ns per element | whole shard (s) |",
            "|---|---|---|---|---|---|",
            row("reference (int64, 4M-element chunks)", 1, r["sampled"], r["ref_sampled_seconds"],
                r["ref_seconds"]),
            row("megalite (int32 in place, pieces of 128K)", 1, r["elements"], r["new_one_thread_seconds"],
                r["new_one_thread_seconds"]),
            row("megalite (int32 in place, pieces of 128K)", r["threads"], r["elements"], r["new_seconds"],
                r["new_seconds"]), "",
            f"The reference's whole-shard figure is scaled from its {r['sampled'] / 1e6:.1f} M timed elements "
            f"(the first {r['sample']:,} of each weight of one layer, each scaled by its weight's size). "
            f"megalite's values on those elements: {'identical' if r['identical'] else 'DIFFERENT'} to the "
            "reference's, bit for bit."]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    args = parser.parse_args(argv)
    command = command_line("bench_init.py", argv)
    torch.set_num_threads(1)                    # what OMP_NUM_THREADS=1 gives each rank under torchrun
    r = measure(args.quick)
    print(r, flush=True)
    if not r["identical"]:
        raise SystemExit("megalite's initial values differ from the reference's")
    headline = Headline(f"initial values of a {r['elements'] / 1e9:.2f}B-element shard (Llama-2 70B, one "
                        "TP8 x PP8 rank), OMP_NUM_THREADS=1",
                        "the reference implementation of the same formula (int64, one thread), scaled",
                        f"{r['new_seconds']:.1f} s vs {r['ref_seconds']:.0f} s "
                        f"({r['ref_seconds'] / r['new_seconds']:.0f}x faster; {r['threads']} threads)", command)
    publish(args, "bench_init", "Initial weights of a 1B-parameter shard", command, [headline], report(r))


if __name__ == "__main__":
    main(sys.argv[1:])
