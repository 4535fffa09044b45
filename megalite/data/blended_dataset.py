"""Weighted mixing of several datasets: ``--data-path 0.3 A 0.7 B``.

Sample i of the blend comes from the dataset whose share so far lags its weight most: the error of
dataset j is ``w_j * max(i, 1) - taken_j`` (ties go to the lower index), and the chosen dataset gives
its next unused sample. This is the rule of Megatron's ``build_blending_indices`` (helpers.cpp), whose
error term uses ``max(i, 1)`` (not ``i + 1``), so megalite reproduces Megatron's blend order. The achieved
count of every dataset stays within about one sample of ``w_j * N`` (exactly within one for two datasets).

The choice of sample i depends on every earlier choice, so this is a plain Python loop over samples; its
result is cached like the GPT indices.
"""
from __future__ import annotations

import os
import time
from typing import Optional, Sequence

import numpy as np

from megalite.data.gpt_dataset import INDEX_FORMAT_VERSION, CachedArrays, IndexCache, log
from megalite.errors import UserError


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray([float(x) for x in weights], dtype=np.float64)
    if w.size == 0 or np.any(~np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise UserError(f"blend weights {list(weights)} must be non-negative numbers with a positive sum")
    return w / w.sum()


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) for ``size`` blended samples."""
    w = [float(x) for x in normalize_weights(weights)]
    n = len(w)
    if n > np.iinfo(np.int16).max:
        raise UserError(f"{n} datasets in one blend; at most {np.iinfo(np.int16).max} are supported")
    counts = [0] * n
    choice = [0] * size
    nth = [0] * size
    others = range(1, n)
    for i in range(size):
        t = float(i) if i > 1 else 1.0
        best, best_err = 0, w[0] * t - counts[0]
        for j in others:
            err = w[j] * t - counts[j]
            if err > best_err:
                best, best_err = j, err
        choice[i] = best
        nth[i] = counts[best]
        counts[best] += 1
    return np.asarray(choice, dtype=np.int16), np.asarray(nth, dtype=np.int64)


class BlendedDataset(CachedArrays):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``."""

    ARRAYS = ("dataset_index", "dataset_sample_index")

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int, cache_dir: Optional[str] = None,
                 split_name: str = "train", verbose: bool = True):
        if len(datasets) != len(weights):
            raise ValueError("one weight per dataset")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = int(size)
        self.split_name = split_name
        description = {
            "class": "BlendedDataset",
            "format": INDEX_FORMAT_VERSION,
            "weights": [float(x) for x in self.weights],
            "size": self.size,
        }
        cache = IndexCache(os.path.join(cache_dir, "BlendedDataset_indices") if cache_dir else None,
                           description, f"BlendedDataset-{split_name}", verbose)
        t0 = time.time()
        loaded, saved = cache.load(self.ARRAYS), False
        if loaded is not None:
            self.dataset_index = loaded["dataset_index"]
            self.dataset_sample_index = loaded["dataset_sample_index"]
            source = "loaded from cache"
        else:
            self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, self.size)
            saved = cache.save(dict(zip(self.ARRAYS, (self.dataset_index, self.dataset_sample_index))))
            source = f"built in {time.time() - t0:.2f} s" + (f", cached in {cache.dir}" if saved else "")
        if loaded is not None or saved:
            self.cache_paths = {a: cache.path(a) for a in self.ARRAYS}
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for j, ds in enumerate(self.datasets):
            if counts[j] > len(ds):
                raise UserError(f"blend component {j} has {len(ds)} samples but the blend needs {counts[j]}")
        log(f" > {split_name} blend of {len(self.datasets)} datasets, {self.size:,} samples; indices {source}; "
            "achieved shares " + ", ".join(f"{c / max(1, self.size):.4f} (weight {w:.4f})"
                                          for c, w in zip(counts, self.weights)), verbose)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range ({self.size} samples)")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
