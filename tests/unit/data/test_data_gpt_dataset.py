"""GPT dataset indexing (Megatron's GPTDataset): samples = the concatenated token stream, Megatron's indices,
epochs, determinism, the .npy cache."""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megalite.data.gpt_dataset import (GPTDataset, build_gpt_indices, build_sample_index, parse_split,
                                       split_ranges)
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megalite.errors import UserError

EOD = 0


def make_dataset(path, sizes, seed=0, vocab=1000) -> IndexedDataset:
    """Documents of random tokens in [1, vocab), each ending with EOD, one per size."""
    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(str(path), np.uint16)
    for n in sizes:
        doc = rng.integers(1, vocab, size=int(n))
        if n:
            doc[-1] = EOD
        b.add_document(doc)
    b.finalize()
    return IndexedDataset(str(path))


def reference_sample_index(sizes, document_index, seq_length):
    """Megatron's helpers.cpp build_sample_idx, transcribed as a plain loop (drop last partial, +1 token)."""
    total = int(sum(int(sizes[d]) for d in document_index))
    num_samples = (total - 1) // seq_length
    out = [(0, 0)]
    doc_i, offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[document_index[doc_i]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                doc_i += 1
                offset = 0
        out.append((doc_i, offset))
    return np.asarray(out)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=30), seq_length=st.integers(1, 50),
       epochs=st.integers(1, 3), seed=st.integers(0, 2 ** 31))
def test_sample_index_matches_megatron_loop(sizes, seq_length, epochs, seed):
    sizes = np.asarray(sizes, dtype=np.int32)
    if sizes.sum() < 2:
        sizes[0] = 2
    rng = np.random.RandomState(seed)
    document_index = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
    rng.shuffle(document_index)
    got = build_sample_index(sizes, document_index, seq_length)
    np.testing.assert_array_equal(got, reference_sample_index(sizes, document_index, seq_length))


def test_random_draws_are_megatrons():
    """document_index and shuffle_index consume numpy.random.RandomState(seed) as Megatron does."""
    sizes = np.full(50, 30, dtype=np.int32)
    docs = np.arange(10, 40, dtype=np.int32)
    doc_idx, sample_idx, shuffle_idx = build_gpt_indices(sizes, docs, num_samples=None, seq_length=16, seed=7)
    rng = np.random.RandomState(7)
    expected_docs = docs.copy()
    rng.shuffle(expected_docs)
    np.testing.assert_array_equal(doc_idx, expected_docs)
    expected_shuffle = np.arange(len(sample_idx) - 1, dtype=np.uint32)
    rng.shuffle(expected_shuffle)
    np.testing.assert_array_equal(shuffle_idx, expected_shuffle)
    assert doc_idx.dtype == np.int32 and shuffle_idx.dtype == np.uint32
    assert len(sample_idx) - 1 == (30 * 30 - 1) // 16


def test_separate_final_epoch():
    sizes = np.full(20, 50, dtype=np.int32)      # 1000 tokens per epoch -> 99 samples of 10 per epoch
    docs = np.arange(20, dtype=np.int32)
    num_samples = 99 * 2 + 10                      # a small third epoch: shuffled separately
    doc_idx, sample_idx, shuffle_idx = build_gpt_indices(sizes, docs, num_samples, seq_length=10, seed=3)
    assert len(doc_idx) == 60
    assert sorted(doc_idx[40:]) == list(range(20))  # the last epoch is a permutation on its own
    rng = np.random.RandomState(3)                  # ... drawn after the first two epochs' shuffle
    first_two = np.tile(docs, 2)
    rng.shuffle(first_two)
    last = docs.copy()
    rng.shuffle(last)
    np.testing.assert_array_equal(doc_idx, np.concatenate([first_two, last]))
    sans_final = (2 * 1000 - 1) // 10
    assert sorted(shuffle_idx[:sans_final]) == list(range(sans_final))
    assert sorted(shuffle_idx[sans_final:]) == list(range(sans_final, len(sample_idx) - 1))
    # a nearly full last epoch (90 >= 0.8 * 99 samples) is shuffled together with the others
    doc_idx2, _, shuffle2 = build_gpt_indices(sizes, docs, 99 * 2 + 90, seq_length=10, seed=3)
    assert len(doc_idx2) == 60 and sorted(doc_idx2[40:]) != list(range(20))
    assert sorted(shuffle2) == list(range(len(shuffle2)))
    assert max(shuffle2[:sans_final]) >= sans_final


@pytest.mark.parametrize("seq_length,num_samples", [(7, None), (16, 500), (64, 40)])
def test_samples_equal_concatenated_stream(tmp_path, seq_length, num_samples):
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 60, size=40)
    ds = make_dataset(tmp_path / "d", sizes)
    gpt = GPTDataset(ds, (5, 35), num_samples, seq_length, seed=11, eod=EOD, cache_dir=False, verbose=False)
    if num_samples:
        assert len(gpt) >= num_samples
    # the stream: documents in document_index order, concatenated
    docs = [np.asarray(ds[int(d)]) for d in gpt.document_index]
    assert set(int(d) for d in gpt.document_index) == set(range(5, 35))
    stream = np.concatenate(docs).astype(np.int64)
    seen = set()
    for idx in range(len(gpt)):
        s = int(gpt.shuffle_index[idx])
        seen.add(s)
        expected = stream[s * seq_length: s * seq_length + seq_length + 1]
        item = gpt[idx]
        np.testing.assert_array_equal(item["tokens"], expected[:-1])
        np.testing.assert_array_equal(item["labels"], expected[1:])
        np.testing.assert_array_equal(item["position_ids"], np.arange(seq_length))
        assert item["loss_mask"].sum() == seq_length
    assert seen == set(range(len(gpt)))  # every sample exactly once
    assert len(gpt) == (len(stream) - 1) // seq_length


def test_eod_mask_loss(tmp_path):
    ds = make_dataset(tmp_path / "d", [5, 6, 7, 8] * 5)
    gpt = GPTDataset(ds, (0, 20), None, 16, seed=1, eod=EOD, eod_mask_loss=True, cache_dir=False, verbose=False)
    item = gpt[0]
    assert (item["tokens"] == EOD).any()
    np.testing.assert_array_equal(item["loss_mask"] == 0, item["tokens"] == EOD)


def test_determinism_and_seed(tmp_path):
    ds = make_dataset(tmp_path / "d", np.random.default_rng(2).integers(1, 50, size=60))
    a = GPTDataset(ds, (0, 60), 100, 8, seed=5, eod=EOD, cache_dir=False, verbose=False)
    b = GPTDataset(ds, (0, 60), 100, 8, seed=5, eod=EOD, cache_dir=False, verbose=False)
    c = GPTDataset(ds, (0, 60), 100, 8, seed=6, eod=EOD, cache_dir=False, verbose=False)
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.document_index, c.document_index)
    np.testing.assert_array_equal(a[3]["tokens"], b[3]["tokens"])


def test_cache_reuse_and_keys(tmp_path, capsys):
    ds = make_dataset(tmp_path / "d", np.random.default_rng(3).integers(1, 50, size=60))
    cache = str(tmp_path / "cache")
    first = GPTDataset(ds, (0, 50), 100, 8, seed=5, eod=EOD, cache_dir=cache)
    assert first.index_source == "built"
    files = sorted(os.listdir(os.path.join(cache, "GPTDataset_indices")))
    assert len(files) == 4 and all(f.endswith((".npy", ".json")) for f in files)
    again = GPTDataset(ds, (0, 50), 100, 8, seed=5, eod=EOD, cache_dir=cache)
    assert again.index_source == "cache"
    assert isinstance(again.sample_index, np.memmap)
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    np.testing.assert_array_equal(first[7]["tokens"], again[7]["tokens"])
    assert "loaded from" in capsys.readouterr().out
    # everything that shapes the indices is in the key
    for kwargs in ({"seed": 6}, {"seq_length": 9}, {"num_samples": 101}, {"document_range": (0, 49)}):
        args = dict(document_range=(0, 50), num_samples=100, seq_length=8, seed=5) | kwargs
        other = GPTDataset(ds, args["document_range"], args["num_samples"], args["seq_length"], args["seed"],
                           eod=EOD, cache_dir=cache, verbose=False)
        assert other.index_source == "built", kwargs
    # new data with the same prefix (different document lengths) is not served stale indices
    changed = make_dataset(tmp_path / "d2", np.random.default_rng(4).integers(1, 50, size=60))
    assert GPTDataset(changed, (0, 50), 100, 8, 5, EOD, cache_dir=cache, verbose=False).index_source == "built"


def test_default_cache_dir_and_unwritable_fallback(tmp_path, capsys):
    ds = make_dataset(tmp_path / "d", [20] * 10)
    GPTDataset(ds, (0, 10), None, 8, 1, EOD)
    assert os.path.isdir(tmp_path / "cache" / "GPTDataset_indices")
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")  # a file where the cache folder should go: cannot be created (even as root)
    gpt = GPTDataset(ds, (0, 10), None, 8, 1, EOD, cache_dir=str(blocker))
    assert gpt.index_source == "memory"
    out = capsys.readouterr().out
    assert "cannot write the index cache" in out and "--data-cache-path" in out
    assert len(gpt) > 0 and gpt[0]["tokens"].shape == (8,)


def test_pickle_keeps_cached_arrays_mapped(tmp_path):
    ds = make_dataset(tmp_path / "d", [30] * 40)
    gpt = GPTDataset(ds, (0, 40), 1000, 8, 1, EOD, cache_dir=str(tmp_path / "c"), verbose=False)
    blob = pickle.dumps(gpt)
    assert len(blob) < 4000
    clone = pickle.loads(blob)
    np.testing.assert_array_equal(clone[5]["tokens"], gpt[5]["tokens"])


def test_split_parsing_and_ranges():
    assert parse_split("98,2,0") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_split("969, 30, 1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    assert parse_split("90 10") == pytest.approx([0.9, 0.1, 0.0])
    assert split_ranges(parse_split("969,30,1"), 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(parse_split("98,2,0"), 731) == [(0, 716), (716, 731), (731, 731)]
    # rounding overshoot is taken off every boundary, as Megatron does
    assert split_ranges([0.5, 0.5, 0.0], 3) == [(0, 1), (1, 3), (3, 3)]
    for bad in ("a,b", "0,0,0", "1,2,3,4", "-1,2", ""):
        with pytest.raises(UserError, match="--split"):
            parse_split(bad)


def test_too_little_data(tmp_path):
    ds = make_dataset(tmp_path / "d", [1, 0, 0])
    with pytest.raises(UserError, match="too few for even one sample"):
        GPTDataset(ds, (0, 3), 10, 8, 1, EOD, cache_dir=False, verbose=False)
    with pytest.raises(UserError, match="document range"):
        GPTDataset(ds, (2, 2), 10, 8, 1, EOD, cache_dir=False, verbose=False)
