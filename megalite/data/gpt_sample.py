"""Turning ``seq_length + 1`` tokens into one training sample (shared by every GPT-style dataset)."""
from __future__ import annotations

import numpy as np


def make_sample(tokens: np.ndarray, eod: int, eod_mask_loss: bool) -> dict:
    """Inputs are tokens[:-1], labels tokens[1:] (consecutive samples share one token).

    With ``eod_mask_loss`` the loss ignores positions whose *input* is the end-of-document token,
    as Megatron's ``--eod-mask-loss`` does.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    text, labels = tokens[:-1], tokens[1:]
    loss_mask = np.ones(len(text), dtype=np.float32)
    if eod_mask_loss:
        loss_mask[text == eod] = 0.0
    return {
        "tokens": text,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": np.arange(len(text), dtype=np.int64),
    }
