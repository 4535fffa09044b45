"""Turning ``seq_length + 1`` tokens into one training sample (shared by every GPT-style dataset).

A sample packs several documents, each ended by the end-of-document (EOD) token. Megatron's data flags
change only what a sample emits, never which tokens it holds, so one corpus and its cached sample index
serve runs with and without them:

- ``--eod-mask-loss``: the loss ignores each position whose *input* is the EOD token (its label is the
  first token of the next document);
- ``--reset-position-ids``: ``position_ids`` restart at 0 on the token after each EOD;
- ``--reset-attention-mask``: the sample carries ``cu_seqlens``, the cumulative lengths of its documents
  (int32 [s + 1]: 0, the end of each document, then s repeated as padding), so that attention keeps each
  token to its own document; never a dense s x s mask.

As in Megatron's ``get_ltor_masks_and_position_ids``, the EOD token is the last token of its document and
the token after it starts the next one; the first document of a sample may be the tail of a longer one.
"""
from __future__ import annotations

import numpy as np


def make_sample(tokens: np.ndarray, eod: int, eod_mask_loss: bool = False, reset_position_ids: bool = False,
                reset_attention_mask: bool = False) -> dict:
    """Inputs are tokens[:-1], labels tokens[1:] (consecutive samples share one token); the flags as above."""
    tokens = np.asarray(tokens, dtype=np.int64)
    text, labels = tokens[:-1], tokens[1:]
    s = len(text)
    loss_mask = np.ones(s, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[text == eod] = 0.0
    sample = {"tokens": text, "labels": labels, "loss_mask": loss_mask,
              "position_ids": np.arange(s, dtype=np.int64)}
    if reset_position_ids or reset_attention_mask:
        starts = document_starts(text, eod)
        if reset_position_ids:
            lengths = np.diff(np.append(starts, s))
            sample["position_ids"] -= np.repeat(starts, lengths)
        if reset_attention_mask:
            cu_seqlens = np.full(s + 1, s, dtype=np.int32)
            cu_seqlens[:len(starts)] = starts
            sample["cu_seqlens"] = cu_seqlens
    return sample


def document_starts(text: np.ndarray, eod: int) -> np.ndarray:
    """The first position of each document of ``text``: 0 and every position after an EOD (but s)."""
    after_eod = np.flatnonzero(text[:-1] == eod) + 1
    return np.concatenate([[0], after_eod]).astype(np.int64)
