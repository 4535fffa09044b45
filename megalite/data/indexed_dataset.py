"""Megatron's memory-mapped indexed dataset: ``PREFIX.bin`` (tokens) and ``PREFIX.idx`` (index).

Byte layout (Megatron's MMIDIDX format, version 1), little-endian::

    .idx: magic b"MMIDIDX\\x00\\x00" | version <Q = 1 | dtype code <B | sequence_count <Q |
          document_count <Q (documents + 1)            -- header ends at byte 34
          sequence_lengths int32[sequence_count]
          sequence_pointers int64[sequence_count]      (byte offsets into .bin)
          document_indices int64[document_count]       (0, then first sequence after each document)
    .bin: the tokens of every sequence, concatenated, no header.

``IndexedDataset`` reads both zero-copy (numpy views of a memory map); ``IndexedDatasetBuilder``
writes them, to temporary names that are renamed into place only by ``finalize`` so an interrupted
run never leaves a half-written dataset under the final name.
"""
from __future__ import annotations

import os
import shutil
import struct
from typing import Optional

import numpy as np

from megalite.errors import UserError

HEADER_MAGIC = b"MMIDIDX\x00\x00"
HEADER_VERSION = 1
HEADER_SIZE = 34  # 9 + 8 + 1 + 8 + 8

DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
DTYPE_NAMES = {np.dtype(t).name: t for t in DTYPES.values()}


def dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    for code, t in DTYPES.items():
        if np.dtype(t) == dtype:
            return code
    raise ValueError(f"dtype {dtype} has no Megatron dtype code")


def best_dtype(vocab_size: int) -> type:
    """Megatron's choice: uint16 when the vocabulary is below 65500, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def max_token_for(dtype) -> int:
    """The largest token id that ``dtype`` can store exactly."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return int(np.iinfo(dtype).max)
    return int(2 ** (np.finfo(dtype).nmant + 1))


def check_vocab_fits(vocab_size: int, dtype, what: str = "the tokenizer") -> None:
    if vocab_size - 1 > max_token_for(dtype):
        raise UserError(f"vocab size {vocab_size} of {what} is too large for dtype {np.dtype(dtype).name} "
                        f"(max id {max_token_for(dtype)}); use a wider --dtype (int32)")


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(data_file_path(prefix)) and os.path.isfile(index_file_path(prefix))


def normalize_prefix(prefix: str) -> str:
    """Accept ``x.bin`` / ``x.idx`` for the prefix ``x`` when those files exist."""
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext) and dataset_exists(prefix[: -len(ext)]):
            return prefix[: -len(ext)]
    return prefix


def _check_present(prefix: str) -> None:
    has_bin = os.path.isfile(data_file_path(prefix))
    has_idx = os.path.isfile(index_file_path(prefix))
    if has_bin and has_idx:
        return
    if not has_bin and not has_idx:
        hint = ""
        folder = os.path.dirname(prefix) or "."
        if os.path.isdir(folder):
            near = sorted(f[:-4] for f in os.listdir(folder) if f.endswith(".idx"))[:3]
            if near:
                hint = f"; prefixes found in {folder}: " + ", ".join(near)
        raise UserError(f"dataset {prefix}: neither {prefix}.bin nor {prefix}.idx exists (pass the prefix "
                        f"that preprocess_data.py printed, without .bin/.idx{hint})")
    missing = data_file_path(prefix) if not has_bin else index_file_path(prefix)
    raise UserError(f"dataset {prefix}: {missing} is missing (its partner file exists); "
                    "rerun tools/preprocess_data.py or copy both files")


class _Index:
    """The parsed .idx file (arrays are views of a memory map)."""

    def __init__(self, path: str, bin_size: Optional[int] = None):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < len(HEADER_MAGIC) or header[:9] != HEADER_MAGIC:
            raise UserError(f"{path}: not a Megatron indexed dataset (bad magic {header[:9]!r}, expected "
                            f"{HEADER_MAGIC!r}); is this the right file?")
        if len(header) < HEADER_SIZE:
            raise UserError(f"{path}: truncated header ({size} bytes, need {HEADER_SIZE}); rerun preprocessing")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != HEADER_VERSION:
            raise UserError(f"{path}: index version {version} is not supported (only version "
                            f"{HEADER_VERSION}); rebuild it with tools/preprocess_data.py")
        (code,) = struct.unpack("<B", header[17:18])
        if code not in DTYPES:
            raise UserError(f"{path}: unknown dtype code {code} (known: {sorted(DTYPES)}); file is corrupt")
        self.dtype = np.dtype(DTYPES[code])
        self.sequence_count, self.document_count = struct.unpack("<QQ", header[18:34])
        n, d = self.sequence_count, self.document_count
        expected = HEADER_SIZE + 4 * n + 8 * n + 8 * d
        if size == expected + n and n > 0:
            raise UserError(f"{path}: has per-sequence modes (a multimodal dataset); megalite reads text only")
        if size != expected:
            raise UserError(f"{path}: size {size} bytes does not match its header ({n} sequences, {d - 1} "
                            f"documents need {expected} bytes); the file is truncated or corrupt")
        if d < 1:
            raise UserError(f"{path}: document count 0 in header (must be documents + 1); the file is corrupt")
        self._mmap = np.memmap(path, mode="r", order="C")
        buf = memoryview(self._mmap)
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buf, dtype="<i4", count=n, offset=off)
        off += 4 * n
        self.sequence_pointers = np.frombuffer(buf, dtype="<i8", count=n, offset=off)
        off += 8 * n
        self.document_indices = np.frombuffer(buf, dtype="<i8", count=d, offset=off)
        if self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise UserError(f"{path}: document_indices must run from 0 to {n} (found "
                            f"{int(self.document_indices[0])}..{int(self.document_indices[-1])}); file is corrupt")
        if bin_size is not None:
            if n == 0:
                needed = 0
            else:
                needed = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
            if needed != bin_size:
                raise UserError(f"{path}: the index describes {needed} bytes of tokens but the .bin has "
                                f"{bin_size}; the .bin and .idx do not belong together or one is truncated")
            self._check_arrays(bin_size)

    CHECK_CHUNK = 1 << 22   # entries per vectorised check (bounded memory on huge indexes)

    def _check_arrays(self, bin_size: int) -> None:
        """Sequences lie back to back from byte 0 (as every Megatron writer lays them out, and as slices
        read them) and the documents are in order, so no read can go out of bounds whatever the file
        says. Linear in the number of sequences; chunked to bound memory."""
        n, itemsize = self.sequence_count, self.dtype.itemsize
        expected_start = 0
        for start in range(0, n, self.CHECK_CHUNK):
            lengths = self.sequence_lengths[start:start + self.CHECK_CHUNK].astype(np.int64)
            pointers = self.sequence_pointers[start:start + self.CHECK_CHUNK]
            ends = expected_start + np.cumsum(lengths * itemsize)
            expected = np.concatenate(([expected_start], ends[:-1]))
            bad = (lengths < 0) | (pointers != expected)
            if bad.any():
                i = start + int(np.argmax(bad))
                raise UserError(f"{self.path}: sequence {i} (length {int(self.sequence_lengths[i])}, byte offset "
                                f"{int(self.sequence_pointers[i])}) does not follow the one before it in the "
                                f"{bin_size}-byte .bin; the index is corrupt, rebuild it with tools/preprocess_data.py")
            expected_start = int(ends[-1])
        docs = self.document_indices
        for start in range(0, len(docs) - 1, self.CHECK_CHUNK):
            chunk = docs[start:start + self.CHECK_CHUNK + 1]
            if (np.diff(chunk) < 0).any():
                i = start + int(np.argmax(np.diff(chunk) < 0))
                raise UserError(f"{self.path}: document_indices decrease at document {i}; the index is corrupt, "
                                "rebuild it with tools/preprocess_data.py")


class IndexedDataset:
    """Read-only view of ``PREFIX.bin`` / ``PREFIX.idx``, memory-mapped.

    ``ds[i]`` is sequence ``i`` (a numpy view, no copy); ``ds.get(i, offset, length)`` a part of it.
    ``mmap=False`` (``--no-mmap-bin-files``, as Megatron's file reader): the ``.bin`` is not mapped;
    each access reads its bytes from the file into a fresh array (``os.pread``, so DataLoader workers
    sharing the descriptor do not race on a file position). The ``.idx`` is mapped either way.
    """

    _bin_fd: int | None = None      # the .bin's descriptor once an unmapped read opens it (a class default,
                                    # so __del__ finds it even when __init__ raised before setting it)

    def __init__(self, prefix: str, mmap: bool = True):
        prefix = normalize_prefix(prefix)
        _check_present(prefix)
        self.prefix = prefix
        self.mmap = mmap
        self._bin_path = data_file_path(prefix)
        bin_size = os.path.getsize(self._bin_path)
        self.index = _Index(index_file_path(prefix), bin_size)
        self.dtype = self.index.dtype
        if not mmap:
            self._bin = None
            self._bin_buffer = None
        elif bin_size > 0:
            self._bin = np.memmap(self._bin_path, mode="r", order="C")
            self._bin_buffer = memoryview(self._bin)
        else:  # numpy cannot memory-map an empty file
            self._bin = None
            self._bin_buffer = memoryview(b"")

    # pickling (DataLoader workers started with spawn) re-opens the files instead of copying them
    def __getstate__(self):
        return {"prefix": self.prefix, "mmap": self.mmap}

    def __setstate__(self, state):
        self.__init__(state["prefix"], state["mmap"])

    def __del__(self):
        if self._bin_fd is not None:
            os.close(self._bin_fd)

    def _read(self, byte_offset: int, count: int) -> np.ndarray:
        """``count`` tokens of the .bin from ``byte_offset``: a view of the mapping, or read from the file."""
        if self.mmap:
            return np.frombuffer(self._bin_buffer, dtype=self.dtype, count=count, offset=byte_offset)
        if self._bin_fd is None:
            self._bin_fd = os.open(self._bin_path, os.O_RDONLY)
        nbytes = count * self.dtype.itemsize
        data = os.pread(self._bin_fd, nbytes, byte_offset)
        if len(data) != nbytes:
            raise UserError(f"{self._bin_path} is truncated: {nbytes} bytes wanted at {byte_offset}, {len(data)} read")
        return np.frombuffer(data, dtype=self.dtype)

    def __len__(self) -> int:
        return self.index.sequence_count

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self.index.document_indices

    @property
    def num_tokens(self) -> int:
        return int(self.index.sequence_lengths.sum(dtype=np.int64))

    def tokens(self) -> np.ndarray:
        """All tokens of the .bin as one flat view (read whole without the mapping)."""
        if not self.mmap:
            return np.fromfile(self._bin_path, dtype=self.dtype)
        return np.frombuffer(self._bin_buffer, dtype=self.dtype)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """``length`` tokens of sequence ``idx`` from ``offset`` (to its end when length is None)."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {self.prefix} ({n} sequences)")
        idx = int(idx) % n
        size = int(self.index.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {idx} of length {size}")
        pointer = int(self.index.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return self._read(pointer, length)

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            return self.get(int(idx))
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices of an IndexedDataset must be contiguous")
            if stop <= start:
                return []
            lengths = self.index.sequence_lengths[start:stop]
            flat = self._read(int(self.index.sequence_pointers[start]), int(lengths.sum(dtype=np.int64)))
            return np.split(flat, np.cumsum(lengths)[:-1])
        raise TypeError(f"cannot index an IndexedDataset with {type(idx).__name__}")

    def max_token(self, max_tokens_scanned: Optional[int] = None) -> int:
        """Largest token id (over all tokens, or evenly spaced chunks when the .bin is bigger than
        ``max_tokens_scanned``); -1 when empty."""
        size = os.path.getsize(self._bin_path) // self.dtype.itemsize
        if size == 0:
            return -1
        if max_tokens_scanned is None or size <= max_tokens_scanned:
            return int(self.tokens().max())
        chunks = 64
        chunk = max(1, max_tokens_scanned // chunks)
        starts = np.linspace(0, size - chunk, chunks).astype(np.int64)
        return int(max(self._read(int(s) * self.dtype.itemsize, chunk).max() for s in starts))

    def min_token(self) -> int:
        tokens = self.tokens()
        return int(tokens.min()) if tokens.size else 0


def write_index(path: str, dtype, sequence_lengths, document_indices) -> None:
    """Write a .idx file for sequences stored back to back (pointers are derived from the lengths)."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
        raise ValueError("sequence lengths must fit in int32")
    pointers = np.zeros(lengths.size, dtype="<i8")
    if lengths.size > 1:
        np.cumsum(lengths[:-1] * dtype.itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype="<i8")
    with open(path, "wb") as f:
        f.write(HEADER_MAGIC)
        f.write(struct.pack("<Q", HEADER_VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", lengths.size))
        f.write(struct.pack("<Q", docs.size))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.tobytes())
        f.write(docs.tobytes())


class IndexedDatasetBuilder:
    """Writes ``PREFIX.bin`` / ``PREFIX.idx``; nothing appears under the final names before ``finalize()``.

    ``add_document(tokens)`` adds one document of one sequence; ``add_documents(flat, lengths)`` many at
    once; ``add_item`` + ``end_document`` build a document from several sequences; ``add_index`` appends
    a whole existing dataset (merging).
    """

    def __init__(self, prefix: str, dtype=np.int32):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # validates
        self._max_id = max_token_for(self.dtype)
        self._min_id = 0 if self.dtype.kind in "uf" else int(np.iinfo(self.dtype).min)
        self._tmp_suffix = f".tmp.{os.getpid()}"
        self._bin_tmp = data_file_path(prefix) + self._tmp_suffix
        try:
            os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
            self._bin = open(self._bin_tmp, "wb")
        except OSError as e:
            raise UserError(f"cannot write {data_file_path(prefix)} ({e.strerror}: {e.filename}); choose an output "
                            "prefix in a writable directory") from None
        self._lengths: list[np.ndarray] = []
        self._doc_ends: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]   # document_indices, in pieces
        self._num_documents = 0
        self._num_sequences = 0
        self.num_tokens = 0

    def _check_range(self, arr: np.ndarray) -> None:
        if arr.size == 0:
            return
        hi, lo = arr.max(), arr.min()
        if hi > self._max_id or lo < self._min_id:
            bad = hi if hi > self._max_id else lo
            raise UserError(f"token id {int(bad)} does not fit in dtype {self.dtype.name} (range "
                            f"{self._min_id}..{self._max_id}) writing {self.prefix}: vocab too large for the "
                            "dtype; use a wider --dtype (int32)")

    def _write_tokens(self, tokens) -> int:
        arr = np.asarray(tokens)
        if arr.dtype != self.dtype:
            if arr.dtype.kind in "iu" and self.dtype.kind in "iu":
                self._check_range(arr)
            arr = arr.astype(self.dtype)
        self._bin.write(np.ascontiguousarray(arr).tobytes())
        self.num_tokens += arr.size
        return arr.size

    def add_item(self, tokens) -> None:
        """Append one sequence to the current document."""
        n = self._write_tokens(tokens)
        self._lengths.append(np.array([n], dtype=np.int64))
        self._num_sequences += 1

    def end_document(self) -> None:
        self._doc_ends.append(np.array([self._num_sequences], dtype=np.int64))
        self._num_documents += 1

    def add_document(self, tokens, lengths=None) -> None:
        """One document; ``lengths`` splits it into several sequences (default: one)."""
        arr = np.asarray(tokens)
        if lengths is None:
            lengths = [arr.size]
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.sum() != arr.size:
            raise ValueError("lengths must add up to the number of tokens")
        self._write_tokens(arr)
        self._lengths.append(lengths)
        self._num_sequences += lengths.size
        self.end_document()

    def add_documents(self, flat_tokens, lengths) -> None:
        """Many one-sequence documents at once: ``flat_tokens`` concatenated, ``lengths`` per document."""
        lengths = np.asarray(lengths, dtype=np.int64)
        arr = np.asarray(flat_tokens)
        if lengths.sum() != arr.size:
            raise ValueError("lengths must add up to the number of tokens")
        self._write_tokens(arr)
        self._lengths.append(lengths)
        self._doc_ends.append(self._num_sequences + np.arange(1, lengths.size + 1, dtype=np.int64))
        self._num_sequences += lengths.size
        self._num_documents += lengths.size

    def add_index(self, other_prefix: str) -> None:
        """Append the whole dataset ``other_prefix`` (same dtype), copying its .bin bytes."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise UserError(f"cannot merge {other.prefix} (dtype {other.dtype.name}) into a {self.dtype.name} "
                            "dataset: all inputs must be tokenized with the same dtype")
        self._bin.flush()
        with open(data_file_path(other.prefix), "rb") as src:
            shutil.copyfileobj(src, self._bin, length=16 << 20)
        self._lengths.append(np.asarray(other.sequence_lengths, dtype=np.int64))
        self._doc_ends.append(self._num_sequences + np.asarray(other.document_indices[1:], dtype=np.int64))
        self._num_sequences += len(other)
        self._num_documents += len(other.document_indices) - 1
        self.num_tokens += other.num_tokens

    @property
    def num_documents(self) -> int:
        return self._num_documents

    def finalize(self) -> None:
        """Write the .idx and publish both files under their final names."""
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int64)
        idx_tmp = index_file_path(self.prefix) + self._tmp_suffix
        write_index(idx_tmp, self.dtype, lengths, np.concatenate(self._doc_ends))
        os.replace(self._bin_tmp, data_file_path(self.prefix))
        os.replace(idx_tmp, index_file_path(self.prefix))

    def abort(self) -> None:
        """Drop everything written so far (temporary files only)."""
        if not self._bin.closed:
            self._bin.close()
        for path in (self._bin_tmp, index_file_path(self.prefix) + self._tmp_suffix):
            if os.path.exists(path):
                os.remove(path)
