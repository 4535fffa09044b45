"""From ``DataConfig`` to the train/valid/test datasets the training loop reads.

- ``--mock-data``: ``MockGPTDataset`` per split.
- ``--data-path PREFIX`` with ``--split 969,30,1``: one ``GPTDataset`` per split, over contiguous
  document ranges.
- ``--data-path 0.3 A 0.7 B``: every prefix is split the same way and the splits are blended with
  the normalised weights (``BlendedDataset``); each component gets ``ceil(ceil(w * n) * 1.005)``
  samples, as in Megatron. Several prefixes without weights are weighted by their token counts.
- ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path``: each split from its own
  (possibly weighted) prefixes, each used whole.

With torch.distributed initialised, rank 0 builds (and caches) every index first; the other ranks
wait at a barrier and then memory-map the cached files.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from megalite.config.schema import DataConfig
from megalite.data.blended_dataset import BlendedDataset, normalize_weights
from megalite.data.gpt_dataset import SPLIT_NAMES, GPTDataset, default_cache_dir, log, parse_split, split_ranges
from megalite.data.indexed_dataset import IndexedDataset, normalize_prefix
from megalite.data.mock_dataset import MockGPTDataset
from megalite.errors import UserError

if TYPE_CHECKING:
    from megalite.parallel.dry_run import RealRun

BLEND_MARGIN = 1.005  # extra samples per blend component, as in Megatron


def parse_data_path(tokens: Sequence[str], flag: str = "--data-path") -> tuple[list[str], Optional[list[float]]]:
    """``["A"]`` -> (["A"], None); ``["0.3", "A", "0.7", "B"]`` -> (["A", "B"], [0.3, 0.7]);
    ``["A", "B"]`` -> (["A", "B"], None). Items containing spaces are split."""
    items = [t for tok in tokens for t in str(tok).split()]
    if not items:
        return [], None

    def is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    numeric = [is_number(s) for s in items]
    if not any(numeric):
        return items, None
    if len(items) % 2 or not all(numeric[0::2]) or any(numeric[1::2]):
        raise UserError(f"{flag} {' '.join(items)}: expected prefixes, or weight/prefix pairs like "
                        f"'{flag} 0.3 data/a_text_document 0.7 data/b_text_document'")
    weights = [float(s) for s in items[0::2]]
    normalize_weights(weights)  # validates
    return items[1::2], weights


def sample_flags(data: DataConfig) -> dict:
    """The data flags that change what each sample emits (gpt_sample.make_sample), not the index."""
    return dict(eod_mask_loss=data.eod_mask_loss, reset_position_ids=data.reset_position_ids,
                reset_attention_mask=data.reset_attention_mask)


class _Builder:
    def __init__(self, data: DataConfig, tokenizer, seed: int, verbose: bool):
        self.data = data
        self.tokenizer = tokenizer
        self.seed = seed
        self.verbose = verbose
        self.check_vocab = verbose          # rank 0 scans the tokens; the other ranks open the same files
        self._indexed: dict[str, IndexedDataset] = {}

    def indexed(self, prefix: str) -> IndexedDataset:
        prefix = normalize_prefix(prefix)
        if prefix not in self._indexed:
            ds = IndexedDataset(prefix, mmap=self.data.mmap_bin_files)
            if len(ds) == 0:
                raise UserError(f"dataset {prefix} holds no documents; check the preprocessing input")
            if self.check_vocab:
                check_tokens_fit(ds, self.tokenizer.vocab_size, self.data)
            self._indexed[prefix] = ds
        return self._indexed[prefix]

    def cache_dir(self, prefix: str) -> str:
        return self.data.data_cache_path or default_cache_dir(prefix)

    def gpt(self, prefix: str, rng: tuple[int, int], num_samples: int, split: str) -> GPTDataset:
        ds = self.indexed(prefix)
        return GPTDataset(ds, rng, num_samples, self.data.seq_length, self.seed, self.tokenizer.eod,
                          split_name=split, cache_dir=self.cache_dir(ds.prefix), verbose=self.verbose,
                          **sample_flags(self.data))

    def split_of(self, prefixes: list[str], weights: Optional[list[float]], fractions: list[float], i: int,
                 num_samples: int, name: Optional[str] = None):
        """Split ``i`` (0 train, 1 valid, 2 test) of the prefixes under ``fractions``, or None."""
        name = name or SPLIT_NAMES[i]
        if num_samples <= 0:
            return None
        ranges = [split_ranges(fractions, len(self.indexed(p)))[i] for p in prefixes]
        live = [k for k, (a, b) in enumerate(ranges) if b > a]
        if not live:
            if name == "train":
                raise UserError(f"--split {self.data.split!r} leaves no documents for training in "
                                + ", ".join(f"{p} ({len(self.indexed(p))} documents)" for p in prefixes))
            log(f" > {name}: --split gives it no documents; no {name} dataset", self.verbose)
            return None
        if len(prefixes) == 1:
            return self.gpt(prefixes[0], ranges[0], num_samples, name)
        if weights is None:  # weight by tokens in the split
            weights = [float(self.indexed(p).sequence_lengths[a:b].sum(dtype=np.int64))
                       for p, (a, b) in zip(prefixes, ranges)]
        dropped = [prefixes[k] for k in range(len(prefixes)) if k not in live]
        if dropped:
            log(f" > warning: {name} split of {', '.join(dropped)} is empty; blending the others", self.verbose)
        w = normalize_weights([weights[k] for k in live])
        parts = [self.gpt(prefixes[k], ranges[k], int(math.ceil(math.ceil(num_samples * wk) * BLEND_MARGIN)), name)
                 for k, wk in zip(live, w)]
        return BlendedDataset(parts, w, num_samples, self.cache_dir(self.indexed(prefixes[live[0]]).prefix),
                              name, self.verbose)

    def build(self, num_samples: tuple[int, int, int]):
        data = self.data
        per_split = (data.train_data_path, data.valid_data_path, data.test_data_path)
        if data.data_path and any(per_split):
            raise UserError("pass either --data-path (with --split) or --train/valid/test-data-path, not both")
        for prefix in dataset_prefixes(data):    # every file named is checked, even a split that is not used
            self.indexed(prefix)
        if data.data_path:
            prefixes, weights = parse_data_path(data.data_path)
            fractions = parse_split(data.split)
            return tuple(self.split_of(prefixes, weights, fractions, i, num_samples[i]) for i in range(3))
        if any(per_split):
            if not data.train_data_path and num_samples[0] > 0:
                raise UserError("--valid/test-data-path given without --train-data-path; pass the training data too")
            flags = ("--train-data-path", "--valid-data-path", "--test-data-path")
            out = []
            for i in range(3):
                prefixes, weights = parse_data_path(per_split[i], flags[i])
                out.append(self.split_of(prefixes, weights, [1.0, 0.0, 0.0], 0, num_samples[i], SPLIT_NAMES[i])
                           if prefixes else None)
            return tuple(out)
        raise UserError("no training data: pass --data-path PREFIX (from tools/preprocess_data.py), "
                        "--train-data-path, or --mock-data")


def build_train_valid_test_datasets(data: DataConfig, tokenizer, num_samples: tuple[int, int, int], seed: int,
                                    run: RealRun | None = None):
    """(train, valid, test): datasets of ``make_sample`` dicts, or None for an empty split / 0 samples.

    ``num_samples``: samples each split must provide (the datasets may hold more). With
    torch.distributed initialised, rank 0 of the ranks ``run`` says cooperate (parallel/dry_run.py; None:
    the real run) builds the index caches first and the other ranks then memory-map them; a rank without
    peers builds them itself.
    """
    num_samples = tuple(int(n) for n in num_samples)
    if len(num_samples) != 3:
        raise ValueError("num_samples must be (train, valid, test)")
    if data.mock_data:
        return tuple(MockGPTDataset(n, data.seq_length, tokenizer.eod, tokenizer.vocab_size, seed + i,
                                    **sample_flags(data)) if n > 0 else None
                     for i, n in enumerate(num_samples))
    if run is None:      # the real run's; imported here: the data package needs no torch until it cooperates
        from megalite.parallel.dry_run import REAL_RUN as run
    rank, world, dist = run.cooperating_ranks()
    result, error = None, None
    if rank == 0:
        try:
            result = _Builder(data, tokenizer, seed, verbose=True).build(num_samples)
        except UserError as e:
            if dist is None or world == 1:
                raise
            error = str(e)
    if dist is not None and world > 1:
        # rank 0's verdict reaches every rank (instead of a barrier the others would wait at forever
        # when rank 0 stops at a bad file): all of them fail with the same one line
        verdict = [error]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise UserError(verdict[0])
    if rank != 0:
        result = _Builder(data, tokenizer, seed, verbose=False).build(num_samples)
    return result


def check_tokens_fit(ds: IndexedDataset, vocab_size: int, data: Optional[DataConfig] = None,
                     max_tokens_scanned: Optional[int] = 1 << 28) -> None:
    """Before training: every token id of ``ds`` is an id of the tokenizer (a dataset preprocessed with a
    bigger vocabulary would index past the embedding table, or train on rows no token maps to)."""
    if ds.dtype.kind not in "iu":
        raise UserError(f"dataset {ds.prefix}: token dtype {ds.dtype.name} is not an integer type; "
                        "preprocess the text with tools/preprocess_data.py")
    hi = ds.max_token(max_tokens_scanned)
    if hi >= vocab_size:
        which = "the tokenizer"
        if data is not None and data.tokenizer_type == "NullTokenizer":
            which = f"--tokenizer-type NullTokenizer --vocab-size {data.vocab_size} (ids 0..{vocab_size - 1} with eod)"
        elif data is not None and data.tokenizer_type:
            which = f"--tokenizer-type {data.tokenizer_type}"
        raise UserError(f"dataset {ds.prefix}: token id {hi} is outside the vocabulary of {vocab_size} of {which}; "
                        "the data was preprocessed with another tokenizer: preprocess it again with the training "
                        "tokenizer, or train with the tokenizer it was made with")
    if ds.dtype.kind == "i" and ds.num_tokens and ds.min_token() < 0:
        raise UserError(f"dataset {ds.prefix}: negative token id {ds.min_token()}: the file is corrupt")


# ------------------------------------------------------------------------------ vocabulary check
def _indexed_datasets(item, out: dict) -> None:
    if item is None:
        return
    if isinstance(item, str):
        item = IndexedDataset(item)
    if isinstance(item, IndexedDataset):
        out.setdefault(item.prefix, item)
    elif isinstance(item, GPTDataset):
        out.setdefault(item.indexed.prefix, item.indexed)
    elif isinstance(item, BlendedDataset):
        for d in item.datasets:
            _indexed_datasets(d, out)
    elif isinstance(item, (list, tuple)):
        for d in item:
            _indexed_datasets(d, out)
    elif isinstance(item, MockGPTDataset):
        pass
    else:
        raise TypeError(f"cannot check the vocabulary of {type(item).__name__}")


def validate_dataset_vocab(datasets, padded_vocab_size: int, max_tokens_scanned: Optional[int] = 1 << 28) -> int:
    """Raise ``UserError`` when a dataset holds a token id >= ``padded_vocab_size``.

    ``datasets``: prefixes, IndexedDatasets, GPT/Blended datasets, or the (train, valid, test) tuple.
    Datasets above ``max_tokens_scanned`` tokens are checked on 64 evenly spaced chunks of that total
    size (a full scan of 2^28 uint16 tokens takes about a quarter of a second). Returns the largest id seen.
    """
    found: dict[str, IndexedDataset] = {}
    _indexed_datasets(datasets, found)
    largest = -1
    for prefix, ds in found.items():
        hi = ds.max_token(max_tokens_scanned)
        if hi >= padded_vocab_size:
            raise UserError(f"dataset {prefix}: token id {hi} >= padded vocab size {padded_vocab_size}: "
                            "wrong tokenizer? (preprocess and train with the same --tokenizer-type/-model)")
        if ds.dtype.kind == "i" and ds.num_tokens and ds.min_token() < 0:
            raise UserError(f"dataset {prefix}: negative token id {ds.min_token()}: the file is corrupt")
        largest = max(largest, hi)
    return largest


def dataset_prefixes(data: DataConfig) -> list[str]:
    """Every prefix named by --data-path / --train/valid/test-data-path."""
    out = []
    for tokens, flag in ((data.data_path, "--data-path"), (data.train_data_path, "--train-data-path"),
                         (data.valid_data_path, "--valid-data-path"), (data.test_data_path, "--test-data-path")):
        out += [normalize_prefix(p) for p in parse_data_path(tokens, flag)[0]]
    return list(dict.fromkeys(out))
