"""Megatron .bin/.idx: byte layout (Megatron's MMIDIDX format), round trips, reading foreign files, bad files."""
from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest

from megalite.data.indexed_dataset import (DTYPES, IndexedDataset, IndexedDatasetBuilder, best_dtype,
                                           check_vocab_fits)
from megalite.errors import UserError

# Megatron's dtype codes, written out independently of the implementation
MEGATRON_DTYPE_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32",
                   8: "uint16"}


def test_dtype_codes_match_reference():
    assert {c: np.dtype(t).name for c, t in DTYPES.items()} == MEGATRON_DTYPE_CODES
    assert best_dtype(65499) == np.uint16 and best_dtype(65500) == np.int32


@pytest.mark.parametrize("code", sorted(MEGATRON_DTYPE_CODES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = np.dtype(MEGATRON_DTYPE_CODES[code])
    rng = np.random.default_rng(code)
    hi = 100 if dtype.kind == "f" else min(int(np.iinfo(dtype).max), 10 ** 6)
    lo = -hi if dtype.kind in "if" else 0
    docs = [rng.integers(lo, hi, size=int(n)).astype(dtype) for n in rng.integers(0, 50, size=20)]
    b = IndexedDatasetBuilder(str(tmp_path / "ds"), dtype)
    for d in docs[:10]:
        b.add_document(d)
    flat = np.concatenate(docs[10:])
    b.add_documents(flat, [len(d) for d in docs[10:]])
    b.finalize()
    with open(tmp_path / "ds.idx", "rb") as f:
        assert f.read(18)[17] == code
    ds = IndexedDataset(str(tmp_path / "ds"))
    assert len(ds) == 20 and ds.dtype == dtype
    for i, d in enumerate(docs):
        got = ds[i]
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, d)
    np.testing.assert_array_equal(ds.document_indices, np.arange(21))
    assert ds.num_tokens == sum(len(d) for d in docs)
    # no stray temporary files
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]


def test_idx_header_byte_by_byte(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "x"), np.uint16)
    b.add_document([1, 2, 3])
    b.add_document([4, 5])
    b.add_document([65535])
    b.finalize()
    raw = (tmp_path / "x.idx").read_bytes()
    le = "little"
    expected = (b"MMIDIDX\x00\x00"                      # magic, 9 bytes
                + (1).to_bytes(8, le)                    # version <Q
                + bytes([8])                             # dtype code <B: uint16
                + (3).to_bytes(8, le)                    # sequence_count <Q
                + (4).to_bytes(8, le))                   # document_count <Q = documents + 1
    assert len(expected) == 34
    assert raw[:34] == expected
    body = b"".join(n.to_bytes(4, le) for n in (3, 2, 1))          # lengths int32
    body += b"".join(p.to_bytes(8, le) for p in (0, 6, 10))        # byte pointers int64
    body += b"".join(d.to_bytes(8, le) for d in (0, 1, 2, 3))      # document indices int64
    assert raw[34:] == body
    assert (tmp_path / "x.bin").read_bytes() == b"".join(t.to_bytes(2, le) for t in (1, 2, 3, 4, 5, 65535))


def _write_megatron_layout(prefix, dtype_code_, dtype, sequences, doc_indices, extra_idx=b""):
    """A dataset built by hand from Megatron's byte layout (struct + numpy), independent of the writer."""
    with open(prefix + ".bin", "wb") as f:
        for s in sequences:
            f.write(np.asarray(s, dtype=dtype).tobytes())
    lengths = [len(s) for s in sequences]
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * np.dtype(dtype).itemsize
    with open(prefix + ".idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, dtype_code_, len(sequences), len(doc_indices)))
        f.write(np.asarray(lengths, dtype="<i4").tobytes())
        f.write(np.asarray(pointers, dtype="<i8").tobytes())
        f.write(np.asarray(doc_indices, dtype="<i8").tobytes())
        f.write(extra_idx)


def test_reads_hand_built_megatron_file(tmp_path):
    seqs = [[10, 11, 12], [13], [100000, 7, 8, 9], [5, 6]]
    prefix = str(tmp_path / "meg")
    # two documents: the first made of sequences 0-1 (sentence-split style), the second of 2-3
    _write_megatron_layout(prefix, 4, np.int32, seqs, [0, 2, 4])
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.int32 and len(ds) == 4
    np.testing.assert_array_equal(ds.document_indices, [0, 2, 4])
    np.testing.assert_array_equal(ds.sequence_lengths, [3, 1, 4, 2])
    np.testing.assert_array_equal(ds.sequence_pointers, [0, 12, 16, 32])
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], s)
    np.testing.assert_array_equal(ds.get(2, offset=1, length=2), [7, 8])
    np.testing.assert_array_equal(ds.get(2, offset=2), [8, 9])
    parts = ds[1:3]
    assert [p.tolist() for p in parts] == [[13], [100000, 7, 8, 9]]
    np.testing.assert_array_equal(ds.tokens(), np.concatenate(seqs))
    assert ds.max_token() == 100000
    # zero copy: a view into the memory map, not an owned copy
    assert not ds.get(0).flags.owndata and not ds.get(0).flags.writeable
    # the prefix may be given with its extension
    assert IndexedDataset(prefix + ".bin").prefix == prefix
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=5)


def test_pickle_reopens_instead_of_copying(tmp_path):
    _write_megatron_layout(str(tmp_path / "p"), 8, np.uint16, [[1, 2], [3]], [0, 1, 2])
    ds = IndexedDataset(str(tmp_path / "p"))
    blob = pickle.dumps(ds)
    assert len(blob) < 200
    np.testing.assert_array_equal(pickle.loads(blob)[0], [1, 2])


def test_empty_dataset(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "e"), np.uint16)
    b.finalize()
    ds = IndexedDataset(str(tmp_path / "e"))
    assert len(ds) == 0 and ds.max_token() == -1


# ------------------------------------------------------------------------------------ bad inputs
@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "good")
    _write_megatron_layout(prefix, 8, np.uint16, [[1, 2, 3], [4, 5]], [0, 1, 2])
    return prefix


def _error(prefix) -> str:
    with pytest.raises(UserError) as e:
        IndexedDataset(prefix)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_bin(good):
    os.remove(good + ".bin")
    msg = _error(good)
    assert good + ".bin is missing" in msg


def test_missing_idx(good):
    os.remove(good + ".idx")
    assert good + ".idx is missing" in _error(good)


def test_missing_both_suggests_prefixes(good, tmp_path):
    msg = _error(str(tmp_path / "nope"))
    assert "neither" in msg and "good" in msg


def test_bad_magic(good):
    raw = bytearray(open(good + ".idx", "rb").read())
    raw[:9] = b"NOTMEGATR"
    open(good + ".idx", "wb").write(raw)
    assert "bad magic" in _error(good)


def test_bad_version(good):
    raw = bytearray(open(good + ".idx", "rb").read())
    raw[9:17] = struct.pack("<Q", 2)
    open(good + ".idx", "wb").write(raw)
    assert "version 2" in _error(good)


def test_bad_dtype_code(good):
    raw = bytearray(open(good + ".idx", "rb").read())
    raw[17] = 9
    open(good + ".idx", "wb").write(raw)
    assert "dtype code 9" in _error(good)


def test_truncated_idx(good):
    raw = open(good + ".idx", "rb").read()
    open(good + ".idx", "wb").write(raw[:-3])
    assert "does not match its header" in _error(good)


def test_bin_size_mismatch(good):
    with open(good + ".bin", "ab") as f:
        f.write(b"\x00\x00")
    msg = _error(good)
    assert "has 12" in msg and "describes 10 bytes" in msg


def test_truncated_bin(good):
    raw = open(good + ".bin", "rb").read()
    open(good + ".bin", "wb").write(raw[:4])
    assert "describes 10 bytes" in _error(good)


def test_multimodal_rejected(tmp_path):
    prefix = str(tmp_path / "mm")
    _write_megatron_layout(prefix, 8, np.uint16, [[1, 2], [3]], [0, 1, 2], extra_idx=b"\x00\x01")
    assert "multimodal" in _error(prefix)


def test_token_too_large_for_dtype(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "big"), np.uint16)
    with pytest.raises(UserError, match="token id 70000 does not fit in dtype uint16"):
        b.add_document([1, 70000])
    b.abort()
    assert os.listdir(tmp_path) == []
    with pytest.raises(UserError, match="too large for dtype uint8"):
        check_vocab_fits(300, np.uint8)
    check_vocab_fits(256, np.uint8)


def test_merge_datasets_cli(tmp_path, run_tool, one_line_error):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _write_megatron_layout(a, 8, np.uint16, [[1, 2], [3]], [0, 1, 2])
    _write_megatron_layout(b, 8, np.uint16, [[4], [5, 6, 7]], [0, 2])   # one two-sequence document
    out = str(tmp_path / "merged")
    run_tool("merge_datasets.py", "--input", a, b, "--output-prefix", out, check=True)
    m = IndexedDataset(out)
    assert [m[i].tolist() for i in range(len(m))] == [[1, 2], [3], [4], [5, 6, 7]]
    np.testing.assert_array_equal(m.document_indices, [0, 1, 2, 4])
    # refuses to overwrite, and to mix dtypes
    assert "already exists" in one_line_error(run_tool("merge_datasets.py", "--input", a, b,
                                                       "--output-prefix", out).stderr)
    c = str(tmp_path / "c")
    _write_megatron_layout(c, 4, np.int32, [[1]], [0, 1])
    proc = run_tool("merge_datasets.py", "--input", a, c, "--output-prefix", str(tmp_path / "m2"))
    assert proc.returncode == 1 and "different token dtypes" in one_line_error(proc.stderr)
    assert not os.path.exists(str(tmp_path / "m2.bin"))
