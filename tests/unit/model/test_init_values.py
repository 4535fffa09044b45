"""megalite/model/init.py's generator against a reference implementation of its formula (int64 hashes,
float64 throughout: bench/bench_init.py's ``reference_values``, which the benchmark times it against): the
same fp32 values, bit for bit, at indices below and above 2**32, in pieces that straddle a multiple of
2**32, for every kind of shard and range, several keys, on one thread and on several, and for a whole
model's initialisation."""
import os
import random
import sys

import pytest
import torch

from megalite_test_utils import ROOT, TINY_LLAMA_ARGS
from megalite.train.command_line import parse_args
from megalite.model import init
from megalite.model.gpt import GPTModel
from megalite.parallel.param_meta import mark, param_meta

sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_init import reference_values  # noqa: E402


@pytest.fixture(params=["one thread", "threads"])
def threads(request, monkeypatch):
    """Small pieces, so that small shards take many; drawn on one thread, or on three whatever the cores."""
    monkeypatch.setattr(init, "_CPU_PIECE", 4096)
    monkeypatch.setattr(init, "_threads", lambda: 1 if request.param == "one thread" else 3)


def meta_shard(full_shape: tuple, take_shard, partition_dim: int = 0) -> torch.nn.Parameter:
    rows, cols = full_shape
    if partition_dim == 0:          # the shard's shape from an empty stand-in (meta torch.cat is slow)
        local = (take_shard(torch.empty(rows, 0)).shape[0], cols)
    else:
        local = (rows, take_shard(torch.empty(0, cols)).shape[1])
    return mark(torch.nn.Parameter(torch.empty(local, device="meta")), full_shape=full_shape,
                take_shard=take_shard, tensor_model_parallel=True, partition_dim=partition_dim)


def assert_same(param, name, ranges, seed=11, base_std=0.02, num_layers=4):
    for start, end in ranges:
        got = init.initial_values(param, name, base_std, num_layers, seed, start, end)
        want = reference_values(param, name, base_std, num_layers, seed, start, end)
        assert got.dtype == torch.float32 and torch.equal(got, want), (name, start, end, (got != want).sum())


def random_shard(rng: random.Random) -> torch.nn.Parameter:
    """A row-block, column-block or unsharded view of a full tensor; the wide ones reach past 2**32."""
    full_rows, full_cols = rng.choice([(300, 7), (5000, 33), (1 << 20, 8192), (1 << 15, 300_007)])
    kind = rng.choice(["rows", "cols", "whole"])
    if kind == "rows":
        blocks = sorted(rng.sample(range(full_rows), 4))
        take = lambda full: torch.cat([full[blocks[0]:blocks[1]], full[blocks[2]:blocks[3]]])   # noqa: E731
        return meta_shard((full_rows, full_cols), take, 0)
    if kind == "cols":
        lo = rng.randrange(full_cols)
        hi = rng.randrange(lo + 1, full_cols + 1)
        return meta_shard((full_rows, full_cols), lambda full: full[:, lo:hi], 1)
    return torch.nn.Parameter(torch.empty(full_rows, full_cols, device="meta"))


def test_random_ranges_of_random_shards_match_the_reference(threads):
    rng = random.Random(0)
    for trial in range(16):
        param = random_shard(rng)
        n = param.numel()
        starts = [rng.randrange(n) for _ in range(2)] + [0, max(0, n - rng.randrange(1, 5000))]
        ranges = [(s, min(n, s + rng.randrange(1, 40_000))) for s in starts]
        assert_same(param, f"decoder.layers.{trial}.mlp.linear_fc{1 + trial % 2}.weight", ranges, seed=trial)


def test_pieces_that_straddle_a_multiple_of_2_to_the_32_match_the_reference(threads):
    """Indices cross 2**32 between rows 524287 and 524288 of [2**20, 8192] (a piece of several rows of a
    16-column block holds both), within row 2096128 of [2100000, 2049] and row 42948 of [50000, 100003]
    (pieces of one row), and 3 * 2**32 at row 1572864 of [2**21, 8192] (a piece boundary)."""
    block = meta_shard((1 << 20, 8192), lambda full: full[:, :16], 1)
    assert_same(block, "a.weight", [(524_200 * 16, 524_400 * 16)], seed=0)
    mid_row = meta_shard((2_100_000, 2049), lambda full: full[2_096_120:2_096_140])
    assert_same(mid_row, "b.weight", [(0, mid_row.numel())], seed=123456789)
    wide = meta_shard((50_000, 100_003), lambda full: full[42_947:42_950])
    assert_same(wide, "c.weight", [(0, wide.numel())], seed=5)
    rows = meta_shard((1 << 21, 8192), lambda full: full[1_572_860:1_572_870])
    assert_same(rows, "d.weight", [(77, rows.numel() - 5)], seed=1)


def test_rows_longer_than_a_piece_and_one_element_ranges_match_the_reference(threads):
    wide = meta_shard((3, 50_000), lambda full: full[:, 1:49_999], 1)
    assert_same(wide, "w.weight", [(0, wide.numel()), (49_990, 50_010), (5, 6), (wide.numel() - 1, wide.numel())])
    column = torch.nn.Parameter(torch.empty(20_000, device="meta"))            # 1-D: [n, 1]
    assert_same(column, "router.weight", [(0, 20_000), (12_345, 12_346)])


def test_a_whole_model_initialises_to_the_reference_values(threads):
    """Through initialize_parameter, as GPTModel builds itself; torch's thread count is left as it was."""
    cfg = parse_args(TINY_LLAMA_ARGS, world_size=1).model
    threads_before = torch.get_num_threads()
    model = GPTModel(cfg, seed=7)
    assert torch.get_num_threads() == threads_before
    for name, param in model.named_parameters():
        values = param.detach().reshape(-1)
        if param_meta(param).is_norm_weight:
            assert torch.equal(values, torch.ones_like(values)), name
            continue
        want = reference_values(param, model.global_name(name), cfg.init_method_std, cfg.num_layers, 7, 0,
                                param.numel())
        assert torch.equal(values, want.to(values.dtype)), name


def test_values_come_on_the_device_asked_for():
    weight = meta_shard((64, 48), lambda full: full[16:32])
    values = init.initial_values(weight, "x.weight", 1.0, 2, 0, 0, 100, device="cpu")
    assert values.device.type == "cpu"
    assert torch.equal(values, init.initial_values(weight, "x.weight", 1.0, 2, 0, 0, 100))
