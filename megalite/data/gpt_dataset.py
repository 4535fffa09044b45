"""GPT pretraining samples over a Megatron indexed dataset, indexed like Megatron's GPTDataset.

A split is a contiguous range of documents. Three index arrays turn it into samples, as in Megatron:

- ``document_index``: the split's document ids repeated for as many epochs as ``num_samples``
  needs, shuffled with ``numpy.random.RandomState(seed)``; when the last epoch contributes less
  than 80% of an epoch's samples it is shuffled separately, so the partial epoch does not
  concentrate on a few documents.
- ``sample_index`` (``[num_samples + 1, 2]``): row i is (position in document_index, token offset)
  where sample i starts. Sample i reads ``seq_length + 1`` tokens from there, across document
  boundaries, so it ends on the token where sample i + 1 starts (inputs/labels shift by one).
- ``shuffle_index``: a seeded permutation of the samples (first the full epochs, then, separately,
  the final partial epoch).

Megatron computes ``sample_index`` with a compiled C++ loop; here it is vectorised numpy: sample i
starts at token ``i * seq_length`` of the concatenated stream, found with one ``searchsorted``
over the cumulative document lengths. The random draws are Megatron's, in the same order, so the
indices equal Megatron's for the same data, split, seed, sequence length and sample count.

Indices are built once and cached as ``.npy`` files named by a hash of everything that shapes them
(the document lengths in the split, the range, the sample count, seq_length, seed); later runs and
other ranks memory-map them.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from typing import Optional

import numpy as np

from megalite.data.gpt_sample import make_sample
from megalite.data.indexed_dataset import IndexedDataset
from megalite.errors import UserError

INDEX_FORMAT_VERSION = 1
ADD_EXTRA_TOKEN = 1          # a sample reads seq_length + 1 tokens
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
SPLIT_NAMES = ("train", "valid", "test")


def log(msg: str, verbose: bool = True) -> None:
    if verbose:
        print(msg, flush=True)


# ----------------------------------------------------------------------------------------- splits
def parse_split(split: str) -> list[float]:
    """``"969, 30, 1"`` -> normalised [train, valid, test] fractions (missing entries are 0)."""
    parts = [p for p in re.split(r"[,\s/]+", str(split).strip()) if p]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise UserError(f"--split {split!r}: expected up to three numbers like 969,30,1")
    if not values or len(values) > 3:
        raise UserError(f"--split {split!r}: expected one to three numbers (train, valid, test) like 969,30,1")
    if any(v < 0 for v in values) or sum(values) <= 0:
        raise UserError(f"--split {split!r}: the numbers must be non-negative and not all zero")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_ranges(fractions: list[float], num_documents: int) -> list[tuple[int, int]]:
    """Contiguous document ranges for the split fractions, as Megatron rounds them."""
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + int(round(f * float(num_documents))))
    excess = bounds[-1] - num_documents
    bounds = [0] + [min(max(b - excess, 0), num_documents) for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(len(fractions))]


# ---------------------------------------------------------------------------------------- indices
def num_epochs_for(tokens_per_epoch: int, num_samples: Optional[int], seq_length: int) -> int:
    """Fewest epochs whose tokens cover ``num_samples * seq_length + 1``."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + ADD_EXTRA_TOKEN
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate((first, last))
    dtype = np.int32 if documents.size == 0 or documents.max() <= np.iinfo(np.int32).max else np.int64
    index = np.tile(np.asarray(documents, dtype=dtype), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int) -> np.ndarray:
    """Rows (position in document_index, offset) where each sample starts, plus the end of the last.

    Sample i covers tokens [i * seq_length, (i + 1) * seq_length] of the concatenated stream, so
    there are ``(total_tokens - 1) // seq_length`` samples (the last partial one is dropped).
    """
    doc_sizes = np.asarray(sizes)[document_index].astype(np.int64)
    ends = np.cumsum(doc_sizes)
    total = int(ends[-1]) if ends.size else 0
    num_samples = max(0, (total - ADD_EXTRA_TOKEN) // seq_length)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # first stream entry whose end lies beyond the position (empty documents are skipped)
    rows = np.searchsorted(ends, positions, side="right")
    offsets = positions - (ends - doc_sizes)[rows]  # rows < ends.size: positions stay below total
    int32_max = np.iinfo(np.int32).max
    large = document_index.size > int32_max or (doc_sizes.size and doc_sizes.max() > int32_max)
    sample_index = np.empty((num_samples + 1, 2), dtype=np.int64 if large else np.int32)
    sample_index[:, 0] = rows
    sample_index[:, 1] = offsets
    sample_index[0] = (0, 0)
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, num_samples) followed by a separate one of [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(sizes: np.ndarray, documents: np.ndarray, num_samples: Optional[int], seq_length: int,
                      seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) as Megatron's GPTDataset builds them.

    ``sizes``: tokens per document of the whole dataset; ``documents``: the split's document ids;
    ``num_samples``: samples wanted (None: one epoch).
    """
    if seq_length < 1:
        raise UserError(f"--seq-length {seq_length} must be positive")
    documents = np.asarray(documents)
    tokens_per_epoch = int(np.asarray(sizes)[documents].sum(dtype=np.int64))
    if tokens_per_epoch <= ADD_EXTRA_TOKEN:
        raise UserError(f"the split holds {tokens_per_epoch} tokens in {documents.size} documents: "
                        "too few for even one sample; use more data or a different --split")
    num_epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length)
    separate_final_epoch = False
    num_samples_sans_final_epoch = 0
    if num_epochs > 1:
        num_samples_sans_final_epoch = ((num_epochs - 1) * tokens_per_epoch - ADD_EXTRA_TOKEN) // seq_length
        num_samples_from_final_epoch = num_samples - num_samples_sans_final_epoch
        num_samples_per_epoch = (tokens_per_epoch - ADD_EXTRA_TOKEN) // seq_length
        separate_final_epoch = num_samples_from_final_epoch < int(
            SEPARATE_FINAL_EPOCH_THRESHOLD * num_samples_per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
    sample_index = build_sample_index(sizes, document_index, seq_length)
    total = sample_index.shape[0] - 1
    first = num_samples_sans_final_epoch if separate_final_epoch else total
    shuffle_index = build_shuffle_index(first, total, rng)
    return document_index, sample_index, shuffle_index


# ------------------------------------------------------------------------------------------ cache
def default_cache_dir(prefix: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")


def description_hash(description: dict) -> str:
    return hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()


class IndexCache:
    """``.npy`` files ``{dir}/{hash}-{name}-{array}.npy``, written atomically, memory-mapped on load.

    When the folder cannot be written the arrays stay in memory (one clear warning), so a read-only
    data folder still trains; every rank then builds its own indices.
    """

    def __init__(self, cache_dir: Optional[str], description: dict, name: str, verbose: bool = True):
        self.description = description
        self.hash = description_hash(description)
        self.dir = cache_dir
        self.name = name
        self.verbose = verbose

    def path(self, array: str) -> str:
        return os.path.join(self.dir, f"{self.hash}-{self.name}-{array}.npy")

    def load(self, arrays: tuple[str, ...]) -> Optional[dict]:
        if not self.dir:
            return None
        paths = {a: self.path(a) for a in arrays}
        if not all(os.path.isfile(p) for p in paths.values()):
            return None
        try:
            return {a: np.load(p, mmap_mode="r", allow_pickle=False) for a, p in paths.items()}
        except (OSError, ValueError) as e:
            log(f" > warning: unreadable index cache {self.dir} ({e}); rebuilding", self.verbose)
            return None

    def save(self, values: dict) -> bool:
        if not self.dir:
            return False
        try:
            os.makedirs(self.dir, exist_ok=True)
            for array, value in values.items():
                final = self.path(array)
                tmp = f"{final[:-4]}.tmp{os.getpid()}.npy"
                np.save(tmp, value, allow_pickle=False)
                os.replace(tmp, final)
            desc = os.path.join(self.dir, f"{self.hash}-{self.name}-description.json")
            with open(desc + f".tmp{os.getpid()}", "w") as f:
                json.dump(self.description, f, indent=1, sort_keys=True)
            os.replace(desc + f".tmp{os.getpid()}", desc)
            return True
        except OSError as e:
            log(f" > warning: cannot write the index cache in {self.dir} ({e.strerror or e}); keeping the "
                "indices in memory (every rank builds its own). Pass --data-cache-path DIR with a "
                "writable DIR to cache them.", self.verbose)
            return False


# ---------------------------------------------------------------------------------------- dataset
class CachedArrays:
    """A dataset whose index arrays (its ``ARRAYS`` attributes) are memory-mapped from an IndexCache when
    ``cache_paths`` names their files: it pickles (to a data-loader worker) by those paths, not the
    arrays' contents, and the worker maps the same files again."""
    ARRAYS: tuple = ()
    cache_paths: Optional[dict] = None

    def __getstate__(self):
        state = self.__dict__.copy()
        if self.cache_paths:
            for a in self.ARRAYS:
                del state[a]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.cache_paths:
            for a, p in self.cache_paths.items():
                setattr(self, a, np.load(p, mmap_mode="r"))


class GPTDataset(CachedArrays):
    """Samples of ``seq_length + 1`` tokens from documents ``[start, end)`` of an indexed dataset.

    ``len()`` is the number of samples the indices hold (at least ``num_samples``); item i is a
    ``make_sample`` dict under the flags ``eod_mask_loss``, ``reset_position_ids`` and
    ``reset_attention_mask``. ``cache_dir``: folder for the index cache (None: ``cache/`` beside the
    data; False: never cache).
    """

    ARRAYS = ("document_index", "sample_index", "shuffle_index")

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], num_samples: Optional[int],
                 seq_length: int, seed: int, eod: int, eod_mask_loss: bool = False, split_name: str = "train",
                 cache_dir=None, verbose: bool = True, reset_position_ids: bool = False,
                 reset_attention_mask: bool = False):
        start, end = int(document_range[0]), int(document_range[1])
        if not 0 <= start < end <= len(indexed):
            raise UserError(f"{indexed.prefix}: document range [{start}, {end}) is empty or outside its "
                            f"{len(indexed)} documents")
        self.indexed = indexed
        self.document_range = (start, end)
        self.num_samples = num_samples
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.eod = int(eod)
        # what each sample emits (gpt_sample.py); not part of the index, which serves every setting
        self.sample_flags = dict(eod_mask_loss=bool(eod_mask_loss), reset_position_ids=bool(reset_position_ids),
                                 reset_attention_mask=bool(reset_attention_mask))
        self.split_name = split_name
        sizes = indexed.sequence_lengths
        description = {
            "class": "GPTDataset",
            "format": INDEX_FORMAT_VERSION,
            "document_range": [start, end],
            "split_sizes_md5": hashlib.md5(np.ascontiguousarray(sizes[start:end]).tobytes()).hexdigest(),
            "num_samples": num_samples,
            "seq_length": self.seq_length,
            "seed": self.seed,
            "add_extra_token": ADD_EXTRA_TOKEN,
        }
        if cache_dir is None:
            cache_dir = default_cache_dir(indexed.prefix)
        cache = IndexCache(os.path.join(cache_dir, "GPTDataset_indices") if cache_dir else None, description,
                           f"GPTDataset-{split_name}", verbose)
        self.cache_paths = {a: cache.path(a) for a in self.ARRAYS} if cache.dir else None
        loaded = cache.load(self.ARRAYS)
        t0 = time.time()
        if loaded is not None:
            arrays, self.index_source = loaded, "cache"
        else:
            docs = np.arange(start, end, dtype=np.int32 if end <= np.iinfo(np.int32).max else np.int64)
            built = build_gpt_indices(sizes, docs, num_samples, self.seq_length, self.seed)
            arrays = dict(zip(self.ARRAYS, built))
            self.index_source = "built" if cache.save(arrays) else "memory"
            if self.index_source == "memory":
                self.cache_paths = None
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        if num_samples is not None and len(self) < num_samples:
            raise UserError(f"index cache {cache.dir} holds {len(self)} samples, fewer than the {num_samples} "
                            "asked for; delete that folder")
        tokens = int(sizes[start:end].sum(dtype=np.int64))
        source = {"cache": f"loaded from {cache.dir}",
                  "built": f"built in {time.time() - t0:.2f} s, cached in {cache.dir}",
                  "memory": f"built in {time.time() - t0:.2f} s (not cached)"}[self.index_source]
        log(f" > {split_name}: {indexed.prefix} documents [{start}, {end}) = {tokens:,} tokens; "
            f"{len(self):,} samples of {self.seq_length} tokens, "
            f"{len(self.document_index) // max(1, end - start)} epoch(s); indices {source}", verbose)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample ``idx`` (after shuffling)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range ({len(self)} samples)")
        i = int(self.shuffle_index[idx])
        doc_beg, off_beg = (int(v) for v in self.sample_index[i])
        doc_end, off_end = (int(v) for v in self.sample_index[i + 1])
        get = self.indexed.get
        if doc_beg == doc_end:
            return get(int(self.document_index[doc_beg]), off_beg, off_end - off_beg + 1)
        parts = [get(int(self.document_index[doc_beg]), off_beg)]
        parts += [get(int(d)) for d in self.document_index[doc_beg + 1:doc_end]]
        parts.append(get(int(self.document_index[doc_end]), 0, off_end + 1))
        return np.concatenate(parts)

    def __getitem__(self, idx: int) -> dict:
        tokens = self.sample_tokens(int(idx))
        if tokens.size != self.seq_length + 1:  # an index/data mismatch would otherwise train silently
            raise RuntimeError(f"sample {idx} of {self.indexed.prefix} has {tokens.size} tokens, expected "
                               f"{self.seq_length + 1}; delete the index cache and retry")
        return make_sample(tokens, self.eod, **self.sample_flags)
