"""Muon's --muon-tp-mode on 2 gloo TP ranks, against Newton-Schulz of the whole matrix in one process.

- distributed_newton_schulz on each rank's part of a tall, a wide and a square matrix, its rows or its
  columns split (and two matrices stepped together, rows of one held by both ranks, which count once),
  equals newton_schulz of the whole matrix in fp32 to rounding (in bf16, to a few bf16 units);
- on every Muon weight of a tiny TP=2 Llama (one KV group, so both ranks hold K and V whole), the rule's
  orthogonalised update of each rank's part: duplicated and distributed equal the serial run's whole-matrix
  result cut to the rank's part (to rounding); blockwise equals newton_schulz of the rank's own part of each
  logical matrix, scaled by that part's shape, and differs from the serial result; at TP=1 every mode is
  the serial rule, bit for bit.
"""
import torch
import torch.distributed as dist

from harness import run_ranks
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.config.muon_fields import NS_COEFFICIENTS

ARGV = with_flags(TINY_LLAMA_ARGS, optimizer="muon", num_query_groups=1, muon_fp32_matmul_prec="high")
QUINTIC = NS_COEFFICIENTS["quintic"]
SHAPES = ((12, 40), (40, 12), (16, 16))


def matrix_of(seed: int, shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def split_parts(rank: int, world: int) -> list:
    """Each rank's result of distributed_newton_schulz per (shape, split), and for rows held twice."""
    from megalite.optim.rules.muon import distributed_newton_schulz
    out = {}
    for i, shape in enumerate(SHAPES):
        for split in (0, 1):
            part = matrix_of(i, shape).chunk(world, split)[rank]
            for bf16 in (False, True):
                out[shape, split, bf16], = distributed_newton_schulz([part], split, [None], dist.group.WORLD,
                                                                     QUINTIC, 5, bf16)
    # two logical matrices stepped together (one all-reduce each step), the second's rows 5, 6 on both ranks
    rows = torch.arange(0, 7) if rank == 0 else torch.arange(5, 12)
    counted = None if rank == 0 else torch.arange(2, 7)
    out["pair"] = distributed_newton_schulz([matrix_of(8, (20, 40)).chunk(world)[rank], matrix_of(9, (12, 40))[rows]],
                                            0, [None, counted], dist.group.WORLD, QUINTIC, 5, False)
    return out


def built(argv, world: int, rank: int):
    from megalite.model.chunks import build_model_chunks
    from megalite.parallel.tensor.layers import TensorParallel
    from megalite.train.command_line import parse_args
    config = parse_args(argv, world_size=world)
    return config, build_model_chunks(config.model, 1, TensorParallel(rank=rank, size=world), 0, 1, 1)[0]


def updates(config, chunk, group):
    """Per Muon weight: (its local rows, cols, the full random update, {mode: (the rule's orthogonalised local
    update, its row runs)})."""
    import dataclasses
    from megalite.optim.muon_matrices import build_matrix, is_muon_matrix
    from megalite.optim.rules.muon import Muon
    from megalite.parallel.param_meta import full_shape
    from megalite.parallel.tensor.layers import shard_positions
    out = {}
    for i, (name, param) in enumerate(chunk.named_parameters()):
        if not is_muon_matrix(name, param):
            continue
        rows, cols, full_cols = shard_positions(param)
        full = matrix_of(i, (full_shape(param)[0], full_cols))
        local = full[rows][:, cols]
        results = {}
        for mode in ("duplicated", "distributed", "blockwise"):
            optimizer = dataclasses.replace(config.optimizer, muon_tp_mode=mode)
            matrix = build_matrix(name, param, config.model, optimizer, group)
            assert (matrix.parts is not None) == (group is not None and mode == "distributed"), (name, mode)
            results[mode] = (Muon([], [], optimizer, [])._orthogonalise(local, matrix), matrix.row_runs)
        out[name] = (rows, cols, full, results)
    return out


def tp_rank_updates(rank: int, world: int) -> dict:
    config, chunk = built(with_flags(ARGV, tensor_model_parallel_size=world), world, rank)
    return updates(config, chunk, dist.group.WORLD)


def test_distributed_newton_schulz_equals_the_whole_matrix():
    from megalite.optim.rules.muon import newton_schulz
    ranks = run_ranks(2, split_parts)
    for i, shape in enumerate(SHAPES):
        whole, whole_bf16 = (newton_schulz(matrix_of(i, shape), QUINTIC, 5, bf16=bf16) for bf16 in (False, True))
        for split in (0, 1):
            ours = torch.cat([r[shape, split, False] for r in ranks], split)
            torch.testing.assert_close(ours, whole, rtol=0, atol=5e-6, msg=f"{shape} split {split}")
            # bf16: a few bf16 units (2^-8 near 1) from the whole matrix's bf16 iteration, and from fp32
            ours = torch.cat([r[shape, split, True] for r in ranks], split)
            assert (ours - whole_bf16).abs().max() <= 0.03 and 1e-3 < (ours - whole).abs().max() <= 0.03, (shape, split)
    first = newton_schulz(matrix_of(8, (20, 40)), QUINTIC, 5, bf16=False)
    torch.testing.assert_close(torch.cat([r["pair"][0] for r in ranks]), first, rtol=0, atol=5e-6)
    whole = newton_schulz(matrix_of(9, (12, 40)), QUINTIC, 5, bf16=False)
    torch.testing.assert_close(ranks[0]["pair"][1], whole[:7], rtol=0, atol=5e-6)
    torch.testing.assert_close(ranks[1]["pair"][1], whole[5:], rtol=0, atol=5e-6)


def test_tp_modes_of_the_rule_on_a_tp2_llama():
    from megalite.optim.muon_matrices import logical_blocks, scale_ratio
    from megalite.optim.rules.muon import newton_schulz
    config, chunk = built(ARGV, 1, 0)
    serial = updates(config, chunk, None)
    ranks = run_ranks(2, tp_rank_updates)
    differs = 0.0
    for name, (_, _, full, results) in serial.items():
        whole = results["duplicated"][0]
        for mode in ("distributed", "blockwise"):       # at TP=1 every mode is the whole-matrix rule
            assert torch.equal(results[mode][0], whole) and results[mode][1] == results["duplicated"][1], name
        for rank in ranks:
            rows, cols, theirs_full, modes = rank[name]
            assert torch.equal(theirs_full, full)
            expected = whole[rows][:, cols]
            torch.testing.assert_close(modes["duplicated"][0], expected, rtol=0, atol=1e-6, msg=name)
            torch.testing.assert_close(modes["distributed"][0], expected, rtol=0, atol=5e-6, msg=name)
            assert modes["distributed"][1] == modes["duplicated"][1]          # the whole matrix's scales
            local, blockwise = full[rows][:, cols], modes["blockwise"][0]
            for runs in logical_blocks(name, len(full), config.model, config.optimizer):
                block = torch.cat([torch.arange(a, b) for a, b in runs])
                index = torch.nonzero(torch.isin(rows, block)).flatten()
                assert torch.equal(blockwise[index], newton_schulz(local[index], QUINTIC, 5, bf16=False)), name
                ratio = scale_ratio(len(index), len(cols), config.optimizer)
                assert all(r == ratio for a, b, r in modes["blockwise"][1] if a in index.tolist()), name
            differs = max(differs, (blockwise - expected).abs().max().item())
    assert differs > 0.05, differs           # blockwise changes the result with TP
