"""Fuzzing the two readers of untrusted input (hypothesis): the .bin/.idx dataset reader and the
command-line parser. Whatever the bytes or the argv, the outcome is a result or a UserError (one line)
-- never another exception, never a hang.
"""
from __future__ import annotations

import math
import os
import signal
import struct
import tempfile
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from megalite_test_utils import TINY_LLAMA_ARGS
from megalite.config.megatron_cli import build_parser
from megalite.train.command_line import parse_args
from megalite.data.gpt_dataset import GPTDataset
from megalite.data.indexed_dataset import DTYPES, HEADER_SIZE, IndexedDataset, IndexedDatasetBuilder
from megalite.errors import UserError
from megalite.optim.lr_scheduler import LRScheduler

# MEGALITE_FUZZ_EXAMPLES=20000 for a longer hunt
FUZZ = settings(max_examples=int(os.environ.get("MEGALITE_FUZZ_EXAMPLES", 200)), deadline=None,
                suppress_health_check=list(HealthCheck))


# ---- the .idx / .bin reader ----------------------------------------------------------------------------
def _valid_pair(directory: str, docs: list[list[int]], dtype) -> str:
    prefix = os.path.join(directory, "ds")
    builder = IndexedDatasetBuilder(prefix, dtype)
    for doc in docs:
        builder.add_document(np.asarray(doc, dtype=np.int64))
    builder.finalize()
    return prefix


def read_everything(prefix: str) -> None:
    """Every public read of the dataset: open, lengths, each sequence, slices, all tokens, max/min."""
    ds = IndexedDataset(prefix)
    n = len(ds)
    assert n == len(ds.sequence_lengths) == len(ds.sequence_pointers)
    for i in range(min(n, 64)):
        seq = ds[i]
        assert len(seq) == int(ds.sequence_lengths[i])
        if len(seq):
            ds.get(i, len(seq) - 1, 1)
    if n:
        ds[0:n]
        ds[-1]
    ds.tokens()
    ds.max_token()
    ds.min_token()
    ds.max_token(max_tokens_scanned=7)
    assert ds.num_tokens >= 0
    assert ds.document_indices[0] == 0 and ds.document_indices[-1] == n
    if n and ds.num_tokens and ds.dtype.kind in "iu":   # and what training reads: GPTDataset samples
        samples = GPTDataset(ds, (0, n), 3, 4, seed=1, eod=0, cache_dir=False, verbose=False)
        for i in range(min(len(samples), 3)):
            samples[i]


@contextmanager
def no_hang(seconds: float = 10.0):
    """A read that takes longer than ``seconds`` fails the test instead of hanging it."""
    def expired(signum, frame):
        raise AssertionError(f"reading took more than {seconds} s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def outcome(prefix: str) -> str:
    try:
        with no_hang():
            read_everything(prefix)
        event("read")
        return "read"
    except UserError as e:
        assert "\n" not in str(e), str(e)
        event("refused")
        return "refused"


documents = st.lists(st.lists(st.integers(0, 200), max_size=12), min_size=1, max_size=8)
dtypes = st.sampled_from([np.uint16, np.int32, np.uint8, np.int64])


@st.composite
def mutations(draw):
    """(target file, kind, parameters) applied to a valid pair."""
    kind = draw(st.sampled_from(["flip", "write", "truncate", "extend", "header", "array", "random_idx"]))
    target = draw(st.sampled_from(["idx", "idx", "idx", "bin"]))
    return target, kind, draw(st.integers(0, 2 ** 16)), draw(st.binary(min_size=1, max_size=16)), \
        draw(st.integers(-2 ** 63, 2 ** 64 - 1))


def mutate(path: str, kind: str, position: int, payload: bytes, number: int) -> None:
    data = bytearray(open(path, "rb").read())
    if kind == "flip" and data:
        i = position % len(data)
        data[i] ^= payload[0] or 0xFF
    elif kind == "write":
        i = position % (len(data) + 1)
        data[i:i + len(payload)] = payload
    elif kind == "truncate":
        data = data[:position % (len(data) + 1)]
    elif kind == "extend":
        data += payload
    elif kind == "header" and path.endswith(".idx"):
        # one header field at a time: version (9), dtype code (17), sequence count (18), document count (26)
        offset, fmt = [(9, "<Q"), (17, "<B"), (18, "<Q"), (26, "<Q")][position % 4]
        value = number % (256 if fmt == "<B" else 2 ** 64)
        data[offset:offset + struct.calcsize(fmt)] = struct.pack(fmt, value)
    elif kind == "array" and len(data) > HEADER_SIZE + 8:
        # an entry of the lengths / pointers / document arrays set to an arbitrary integer
        i = HEADER_SIZE + (position % ((len(data) - HEADER_SIZE) // 4)) * 4
        data[i:i + 8] = struct.pack("<q", max(-2 ** 63, min(2 ** 63 - 1, number)))
        data = data[:max(len(data), i + 8)]
    elif kind == "random_idx" and path.endswith(".idx"):
        data = bytearray(payload * (position % 9))
    open(path, "wb").write(bytes(data))


@FUZZ
@given(docs=documents, dtype=dtypes, changes=st.lists(mutations(), min_size=1, max_size=3))
def test_mutated_index_and_data_files_are_read_or_refused(docs, dtype, changes):
    with tempfile.TemporaryDirectory() as d:
        prefix = _valid_pair(d, [[t % 250 for t in doc] for doc in docs], dtype)
        assert len(IndexedDataset(prefix)) == len(docs)        # the unspoilt pair reads
        for target, kind, position, payload, number in changes:
            mutate(f"{prefix}.{target}", kind, position, payload, number)
        outcome(prefix)


@FUZZ
@given(idx=st.binary(max_size=200), bin_=st.binary(max_size=64), with_magic=st.booleans())
def test_random_bytes_are_read_or_refused(idx, bin_, with_magic):
    with tempfile.TemporaryDirectory() as d:
        prefix = os.path.join(d, "ds")
        if with_magic:
            idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + idx
        open(prefix + ".idx", "wb").write(idx)
        open(prefix + ".bin", "wb").write(bin_)
        outcome(prefix)


@FUZZ
@given(lengths=st.lists(st.integers(0, 6), max_size=6), cuts=st.sets(st.integers(1, 5)),
       code=st.sampled_from([1, 2, 3, 4, 5, 8, 6, 7]), field=st.sampled_from(["none", "length", "pointer", "doc",
                                                                              "bin", "code", "count"]),
       where=st.integers(0, 10), value=st.integers(-2 ** 40, 2 ** 40))
def test_consistent_indexes_with_one_wrong_value_are_read_or_refused(lengths, cuts, code, field, where, value):
    """A well-formed index (pointers from the lengths, documents in order, .bin of the right size) with
    at most one value changed: the reader takes the consistent ones and refuses each inconsistency."""
    itemsize = np.dtype(DTYPES[code]).itemsize
    n = len(lengths)
    pointers = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64) * itemsize)[:-1]]) if n else []
    docs = [0] + sorted(c for c in cuts if c < n) + [n] if n else [0]
    bin_size = int(sum(lengths)) * itemsize
    arrays = {"length": list(lengths), "pointer": list(pointers), "doc": docs}
    if field in arrays and arrays[field]:
        arrays[field][where % len(arrays[field])] = value % (2 ** 31) if field == "length" else value
    elif field == "bin":
        bin_size = max(0, bin_size + value % 7 - 3)
    elif field == "code":
        code = value % 256
    with tempfile.TemporaryDirectory() as d:
        prefix = os.path.join(d, "ds")
        with open(prefix + ".idx", "wb") as f:
            count = n + (value % 3 - 1 if field == "count" else 0)
            f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, max(count, 0), len(arrays["doc"])))
            f.write(np.asarray(arrays["length"], dtype="<i4").tobytes())
            f.write(np.asarray(arrays["pointer"], dtype="<i8").tobytes())
            f.write(np.asarray(arrays["doc"], dtype="<i8").tobytes())
        open(prefix + ".bin", "wb").write(bytes(i % 251 for i in range(bin_size)))
        result = outcome(prefix)
        if field == "none" or (field == "bin" and value % 7 == 3):
            assert result == "read" or code in (6, 7) or sum(lengths) <= 1, result


def test_a_huge_sequence_count_is_refused_without_allocating(tmp_path):
    prefix = str(tmp_path / "ds")
    open(prefix + ".idx", "wb").write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 2 ** 62, 2 ** 62))
    open(prefix + ".bin", "wb").write(b"")
    with pytest.raises(UserError, match="does not match its header"):
        IndexedDataset(prefix)


# ---- the command-line parser -------------------------------------------------------------------------
GARBAGE = st.one_of(
    st.sampled_from(["", " ", "x", "--", "-", "nan", "inf", "-inf", "1e308", "1e-320", "99999999999999999999",
                     "true", "None", "0x10", "1_000", "a,b", "0.3 A 0.7 B", "/nonexistent"]),
    st.text(max_size=8),
)
NUMBERS = {  # plausible values, edges included, for each kind of numeric flag
    "int": st.one_of(st.integers(-2, 9), st.sampled_from([16, 32, 64, 128, 2 ** 31, 2 ** 32, 2 ** 40])),
    "float": st.one_of(st.sampled_from([0.0, 1e-8, 1e-3, 0.1, 0.5, 0.999, 1.0, 2.0, 1e4, -1e-3, -1.0]),
                       st.floats(-10, 10, allow_nan=False)),
}


def _value_strategy(action):
    """Mostly values the flag accepts (its choices, numbers of its type), sometimes garbage."""
    if action.choices:
        good = st.sampled_from([str(c) for c in action.choices])
    elif action.type is not None and action.type.__name__.endswith("int"):
        good = NUMBERS["int"].map(str)
    elif action.type is not None and action.type.__name__.endswith("float"):
        good = NUMBERS["float"].map(repr)
    elif action.nargs == "*":
        good = st.sampled_from(["/nonexistent/prefix", "1", "0.5", "data/a_text_document"])
    elif action.dest in ("split",):
        good = st.sampled_from(["969,30,1", "1,0,0", "0,0,0", "98, 2", "100", "1/2/3", "1,2,3,4", "-1,2,1"])
    else:                                  # paths and names: nothing parse_args reads may exist
        good = st.sampled_from(["/nonexistent/dir", "run1", "x"])
    return st.sampled_from([True] * 9 + [False]).flatmap(lambda ok: good if ok else GARBAGE)


def _flags():
    parser = build_parser()
    out = []
    for action in parser._actions:
        for flag in action.option_strings:
            if flag in ("-h", "--help"):
                continue               # prints the help and exits 0, as intended
            out.append((flag, action.nargs == 0, _value_strategy(action), action.nargs == "*"))
    return out


FLAGS = _flags()
ONE_IN_5 = st.sampled_from([True] * 4 + [False])       # False one time in 5 (st.integers shrinks to 0 too often)
ONE_IN_10 = st.sampled_from([True] * 9 + [False])


@st.composite
def argvs(draw):
    """The tiny Llama command line (or nothing) with a few flags added or changed, occasionally
    shuffled or with a stray word, so both deep validation and argparse's own errors are reached."""
    argv = list(TINY_LLAMA_ARGS) if draw(ONE_IN_5) else []
    base_flags = [a for a in argv if a.startswith("--")]
    for flag in draw(st.lists(st.sampled_from(base_flags), max_size=2, unique=True)) if argv else []:
        i = argv.index(flag)                      # drop a flag of the base line (and its value)
        del argv[i:i + (2 if i + 1 < len(argv) and not argv[i + 1].startswith("--") else 1)]
    for flag, is_switch, values, many in draw(st.lists(st.sampled_from(FLAGS), min_size=1, max_size=5)):
        if flag in argv and not is_switch and argv.index(flag) + 1 < len(argv):
            i = argv.index(flag)
            del argv[i:i + 2]
        if is_switch:
            argv.append(flag)
        else:
            count = draw(st.integers(0, 3)) if many else (1 if draw(ONE_IN_10) else draw(st.sampled_from([0, 2])))
            argv += [flag] + [draw(values) for _ in range(count)]
    if not draw(ONE_IN_10):
        argv.insert(draw(st.integers(0, len(argv))), draw(GARBAGE))
    if not draw(ONE_IN_10):
        argv = draw(st.permutations(argv))
    return argv


@FUZZ
@given(argv=argvs(), world_size=st.sampled_from([1, 1, 1, 2, 3, 4, 8]), vocab=st.integers(1, 70000))
def test_parse_args_returns_a_config_or_a_user_error(argv, world_size, vocab):
    try:
        config = parse_args(argv, world_size=world_size, true_vocab_size=vocab)
    except UserError as e:
        assert "\n" not in str(e), str(e)
        event("refused: " + str(e)[:25])
        return
    event("parsed")
    # a config that parses is coherent enough to build from: batches, vocabulary, a finite LR schedule
    t = config.training
    assert t.train_iters >= 1
    assert t.global_batch_size % t.micro_batch_size == 0 and config.num_microbatches >= 1
    assert config.model.padded_vocab_size >= config.model.vocab_size >= 1
    scheduler = LRScheduler(config.optimizer, t.train_iters)
    for step in {0, 1, t.train_iters // 2, t.train_iters - 1, t.train_iters, t.train_iters + 5}:
        lr = scheduler.lr_at(step)
        assert math.isfinite(lr) and lr >= 0, (step, lr)
