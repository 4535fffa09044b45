"""How much of a sample's causal attention a masked run computes: the attended fraction of the planner's
attention FLOPs.

Model FLOPs count attention as every query against all s keys (Megatron's convention, no causal
discount). A run with document masks (--reset-attention-mask) or a causal sliding window
(--window-size left 0) computes only the query/key pairs its mask keeps, so its attention FLOPs are that
figure times the fraction of a plain causal mask's pairs that the mask keeps (1 for plain causal).

Pairs a causal mask keeps over a piece of L tokens with a left window w (query i sees keys
max(0, i - w)..i): sum over i of min(i + 1, w + 1), i.e. L(L + 1)/2 without a window. With documents,
the pieces are the documents as packed into samples: Megatron's GPT dataset concatenates documents and
cuts samples of s tokens, so a document continues into the next sample, and each sample's pieces are the
parts of documents it holds.
"""
from __future__ import annotations

import numpy as np

from megalite.data.indexed_dataset import IndexedDataset

TOKENS_SAMPLED = 1 << 24       # a corpus's first documents up to this many tokens give its length histogram


def causal_pairs(lengths, left: int = -1) -> np.ndarray:
    """Query/key pairs a causal mask with left window ``left`` (-1: unbounded) keeps over pieces of
    ``lengths`` tokens."""
    n = np.asarray(lengths, dtype=np.float64)
    full = n * (n + 1) / 2
    if left < 0:
        return full
    w = float(left + 1)                           # keys a query sees once the window is full
    return np.where(n <= w, full, w * (w + 1) / 2 + (n - w) * w)


def packed_pieces(document_lengths, seq_length: int) -> np.ndarray:
    """Lengths of the pieces that packing ``document_lengths`` in order into samples of ``seq_length``
    tokens gives (documents cut at sample boundaries), over whole samples only."""
    ends = np.cumsum(np.asarray(document_lengths, dtype=np.int64))
    samples = int(ends[-1]) // seq_length if len(ends) else 0
    if samples == 0:
        raise ValueError(f"the documents hold fewer than one sample of {seq_length} tokens")
    total = samples * seq_length
    cuts = np.union1d(ends[ends < total], np.arange(0, total + 1, seq_length))
    return np.diff(cuts)


def attended_fraction(seq_length: int, window_left: int = -1, document_lengths=None) -> float:
    """The fraction of a plain causal mask's query/key pairs that a run keeps: a causal left window
    ``window_left`` (-1: none) and, when ``document_lengths`` is given, document masks over documents of
    those lengths packed into samples."""
    pieces = [seq_length] if document_lengths is None else packed_pieces(document_lengths, seq_length)
    kept = causal_pairs(pieces, window_left).sum()
    return float(kept / (causal_pairs([seq_length])[0] * (np.sum(pieces) / seq_length)))


def corpus_document_lengths(prefix: str, tokens: int = TOKENS_SAMPLED) -> np.ndarray:
    """The lengths of the first documents of the ``.bin/.idx`` corpus at ``prefix``, up to about
    ``tokens`` tokens (a document is its sequences between document_indices)."""
    dataset = IndexedDataset(prefix)
    ends = np.concatenate([[0], np.cumsum(dataset.sequence_lengths, dtype=np.int64)])
    bounds = np.asarray(dataset.document_indices, dtype=np.int64)
    lengths = ends[bounds[1:]] - ends[bounds[:-1]]
    keep = np.searchsorted(np.cumsum(lengths), tokens) + 1
    return lengths[:keep]


def model_attended_fraction(model, document_lengths=None) -> float:
    """``attended_fraction`` averaged over the layers of ``model`` (a ModelConfig), each with its window
    (ModelConfig.attention_window: --window-size, --window-attn-skip-freq)."""
    lefts = [model.attention_window(n)[0] for n in range(1, model.num_layers + 1)]
    by_left = {left: attended_fraction(model.seq_length, left, document_lengths) for left in set(lefts)}
    return sum(by_left[left] for left in lefts) / len(lefts)
