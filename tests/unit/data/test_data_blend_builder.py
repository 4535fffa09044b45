"""Blending (Megatron's helpers.cpp), the dataset builder the training loop calls, and the
token-range check."""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megalite.config.schema import DataConfig
from megalite.data.blended_dataset import BlendedDataset, build_blending_indices
from megalite.data.builder import (build_train_valid_test_datasets, dataset_prefixes, parse_data_path,
                                   validate_dataset_vocab)
from megalite.data.gpt_dataset import GPTDataset
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megalite.data.mock_dataset import MockGPTDataset
from megalite.data.tokenizers import NullTokenizer
from megalite.errors import UserError

TOK = NullTokenizer(1000)  # eod = 1000, vocab_size = 1001


def megatron_blend_reference(weights, size):
    """helpers.cpp build_blending_indices as a plain loop: error_j = w_j * max(i, 1) - taken_j, first max wins."""
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    taken = np.zeros(len(w), dtype=np.int64)
    di, dsi = [], []
    for i in range(size):
        errors = w * max(float(i), 1.0) - taken
        j = int(np.argmax(errors))  # argmax returns the first of equal maxima
        di.append(j)
        dsi.append(taken[j])
        taken[j] += 1
    return np.asarray(di), np.asarray(dsi)


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=6), size=st.integers(1, 300))
def test_blending_indices_match_megatron(weights, size):
    di, dsi = build_blending_indices(weights, size)
    ref_di, ref_dsi = megatron_blend_reference(weights, size)
    np.testing.assert_array_equal(di, ref_di)
    np.testing.assert_array_equal(dsi, ref_dsi)
    assert di.dtype == np.int16 and dsi.dtype == np.int64
    # dataset_sample_index counts up per dataset: 0, 1, 2, ...
    for j in range(len(weights)):
        np.testing.assert_array_equal(dsi[di == j], np.arange((di == j).sum()))


@settings(max_examples=60, deadline=None)
@given(w0=st.floats(0.001, 0.999), size=st.integers(1, 2000))
def test_two_dataset_ratios_within_one_over_n(w0, size):
    di, _ = build_blending_indices([w0, 1 - w0], size)
    share = np.bincount(di, minlength=2) / size
    assert np.all(np.abs(share - [w0, 1 - w0]) <= 1.0 / size + 1e-12)


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.floats(0.001, 1.0), min_size=3, max_size=8), size=st.integers(1, 2000))
def test_many_dataset_ratios_close(weights, size):
    """With three or more datasets Megatron's rule can lag by a little more than one sample (up to ~1.9
    seen): every share stays within 2/N of its weight."""
    di, _ = build_blending_indices(weights, size)
    w = np.asarray(weights) / np.sum(weights)
    share = np.bincount(di, minlength=len(w)) / size
    assert np.all(np.abs(share - w) <= 2.0 / size + 1e-12)


def test_blending_ratios_large_n():
    di, _ = build_blending_indices([0.3, 0.7], 100_000)
    np.testing.assert_array_equal(np.bincount(di), [30_000, 70_000])
    di, _ = build_blending_indices([1, 2, 3, 4], 10_000)
    np.testing.assert_allclose(np.bincount(di) / 10_000, [0.1, 0.2, 0.3, 0.4], atol=1e-4)


def make_dataset(prefix, n_docs, first_token, length=20) -> str:
    """Documents whose tokens identify their dataset: first_token + doc number, ending with eod."""
    b = IndexedDatasetBuilder(str(prefix), np.uint16)
    for d in range(n_docs):
        doc = np.full(length, first_token + d % 100)
        doc[-1] = TOK.eod
        b.add_document(doc)
    b.finalize()
    return str(prefix)


@pytest.fixture
def two_prefixes(tmp_path):
    return make_dataset(tmp_path / "a_text_document", 200, 100), make_dataset(tmp_path / "b_text_document", 300, 500)


def test_blended_dataset_items_come_from_components(two_prefixes, tmp_path):
    a, b = (GPTDataset(IndexedDataset(p), (0, 100), 200, 16, 1, TOK.eod, cache_dir=False, verbose=False)
            for p in two_prefixes)
    blend = BlendedDataset([a, b], [1, 3], 240, cache_dir=str(tmp_path / "c"), verbose=False)
    assert len(blend) == 240
    for i in range(0, 240, 7):
        j, k = int(blend.dataset_index[i]), int(blend.dataset_sample_index[i])
        np.testing.assert_array_equal(blend[i]["tokens"], [a, b][j][k]["tokens"])
    again = BlendedDataset([a, b], [1, 3], 240, cache_dir=str(tmp_path / "c"), verbose=False)
    np.testing.assert_array_equal(again.dataset_index, blend.dataset_index)
    assert isinstance(again.dataset_index, np.memmap)  # loaded from the cache
    for built in (blend, again):       # to a loader worker by the cache's paths, mapped again there
        blob = pickle.dumps(built)
        assert len(blob) < len(pickle.dumps(built.datasets)) + 1000        # the components and two paths
        clone = pickle.loads(blob)
        assert isinstance(clone.dataset_index, np.memmap)
        np.testing.assert_array_equal(clone.dataset_sample_index, blend.dataset_sample_index)
    uncached = BlendedDataset([a, b], [1, 3], 240, cache_dir=False, verbose=False)
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(uncached)).dataset_index, blend.dataset_index)
    with pytest.raises(UserError, match="non-negative"):
        BlendedDataset([a, b], [1, -1], 10, verbose=False)
    with pytest.raises(UserError, match="blend needs"):  # a component too small for its share
        BlendedDataset([a, b], [1, 3], 400, verbose=False)


def _config(**kw) -> DataConfig:
    return DataConfig(seq_length=kw.pop("seq_length", 16), **kw)


def test_builder_single_prefix_split(two_prefixes):
    cfg = _config(data_path=[two_prefixes[0]], split="90,10,0")
    train, valid, test = build_train_valid_test_datasets(cfg, TOK, (500, 30, 10), seed=1234)
    assert isinstance(train, GPTDataset) and isinstance(valid, GPTDataset) and test is None
    assert train.document_range == (0, 180) and valid.document_range == (180, 200)
    assert len(train) >= 500 and len(valid) >= 30
    assert train[0]["tokens"].shape == (16,)
    # 0 samples -> None
    _, valid0, _ = build_train_valid_test_datasets(cfg, TOK, (10, 0, 0), seed=1234)
    assert valid0 is None
    # the prefix list round-trips to the vocabulary check
    assert dataset_prefixes(cfg) == [two_prefixes[0]]


def test_builder_weighted_blend(two_prefixes):
    a, b = two_prefixes
    cfg = _config(data_path=["0.25", a, "0.75", b], split="98,2,0")
    train, valid, _ = build_train_valid_test_datasets(cfg, TOK, (1000, 40, 0), seed=1)
    assert isinstance(train, BlendedDataset) and len(train) == 1000
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    np.testing.assert_array_equal(counts, [250, 750])
    # the tokens tell which file a sample came from
    from_a = [bool(np.any(train[i]["tokens"] < 500)) for i in range(1000)]
    from_b = [bool(np.any((train[i]["tokens"] >= 500) & (train[i]["tokens"] < 1000))) for i in range(1000)]
    assert sum(from_a) == 250 and sum(from_b) == 750 and not any(x and y for x, y in zip(from_a, from_b))
    assert isinstance(valid, BlendedDataset) and len(valid) == 40
    # components hold ceil(ceil(w * n) * 1.005) samples at least
    assert len(train.datasets[0]) >= 252 and len(train.datasets[1]) >= 754


def test_builder_unweighted_prefixes_weigh_by_tokens(two_prefixes):
    cfg = _config(data_path=list(two_prefixes), split="100,0,0")
    train, valid, _ = build_train_valid_test_datasets(cfg, TOK, (1000, 0, 0), seed=1)
    np.testing.assert_allclose(train.weights, [0.4, 0.6])
    assert valid is None


def test_builder_per_split_paths(two_prefixes):
    a, b = two_prefixes
    cfg = _config(train_data_path=[a], valid_data_path=["1", b])
    train, valid, test = build_train_valid_test_datasets(cfg, TOK, (100, 20, 5), seed=1)
    assert train.indexed.prefix == a and train.document_range == (0, 200)
    assert valid.indexed.prefix == b and valid.split_name == "valid"
    assert test is None


def test_builder_mock_data():
    cfg = _config(mock_data=True)
    train, valid, test = build_train_valid_test_datasets(cfg, TOK, (64, 8, 0), seed=3)
    assert isinstance(train, MockGPTDataset) and len(train) == 64 and len(valid) == 8 and test is None
    assert train[0]["tokens"].shape == (16,)


@pytest.mark.parametrize("kw,match", [
    ({}, "no training data"),
    ({"data_path": ["0.3", "A", "0.7"]}, "weight/prefix pairs"),
    ({"data_path": ["A"], "train_data_path": ["B"]}, "not both"),
    ({"data_path": ["-1", "A", "2", "B"]}, "non-negative"),
    ({"data_path": ["does/not/exist"]}, "neither does/not/exist.bin"),
    ({"data_path": ["PREFIX_A"], "split": "0,100,0"}, "no documents for training"),
])
def test_builder_user_errors(kw, match, two_prefixes):
    kw = {k: [two_prefixes[0] if x == "PREFIX_A" else x for x in v] if isinstance(v, list) else v
          for k, v in kw.items()}
    with pytest.raises(UserError, match=match):
        build_train_valid_test_datasets(_config(**kw), TOK, (10, 1, 0), seed=1)


def test_parse_data_path():
    assert parse_data_path(["x"]) == (["x"], None)
    assert parse_data_path(["0.3 a 0.7 b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)


def test_validate_dataset_vocab(two_prefixes, tmp_path):
    cfg = _config(data_path=["1", two_prefixes[0], "1", two_prefixes[1]], split="98,2,0")
    datasets = build_train_valid_test_datasets(cfg, TOK, (100, 10, 0), seed=1)
    assert validate_dataset_vocab(datasets, 1024) == 1000
    assert validate_dataset_vocab(list(two_prefixes), 1001) == 1000
    with pytest.raises(UserError) as e:
        validate_dataset_vocab(datasets, 1000)
    assert "token id 1000 >= padded vocab size 1000: wrong tokenizer?" in str(e.value)
    # sampled scan of a big file still finds a large id spread everywhere
    big = IndexedDatasetBuilder(str(tmp_path / "big"), np.uint16)
    tokens = np.random.default_rng(0).integers(0, 100, size=200_000)
    tokens[::1000] = 5000
    big.add_documents(tokens, [100_000, 100_000])
    big.finalize()
    with pytest.raises(UserError, match="token id 5000 >= padded vocab size 128"):
        validate_dataset_vocab(str(tmp_path / "big"), 128, max_tokens_scanned=10_000)
    validate_dataset_vocab(build_train_valid_test_datasets(_config(mock_data=True), TOK, (4, 0, 0), 1), 1024)


def test_distributed_rank0_builds_others_load(two_prefixes, tmp_path):
    """Two gloo ranks: rank 0 builds the index cache, rank 1 waits at the barrier and memory-maps it."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_rank_main, args=(r, store, two_prefixes[0], queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    results = dict(queue.get(timeout=5) for _ in range(2))
    assert results[0][0] == "built" and results[1][0] == "cache", results
    assert results[0][1] == results[1][1]


def _rank_main(rank, store, prefix, queue):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        cfg = _config(data_path=[prefix], split="90,10,0", data_cache_path=os.path.join(os.path.dirname(store), "dc"))
        train, _, _ = build_train_valid_test_datasets(cfg, TOK, (50, 5, 0), seed=9)
        queue.put((rank, (train.index_source, train[3]["tokens"].tolist())))
    finally:
        dist.destroy_process_group()
