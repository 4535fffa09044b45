"""--mock-data: synthetic documents with a learnable pattern, no files needed.

Like Megatron's mock dataset, each document counts upwards (1, 2, 3, ...) and ends with the eod
token, so a model can drive the loss towards zero; document lengths come from a seeded generator.
Samples are ``seq_length + 1`` tokens of the concatenated document stream, like a real GPT dataset.
"""
from __future__ import annotations

import numpy as np

from megalite.data.gpt_sample import make_sample

MOCK_NUM_DOCUMENTS = 1 << 16


class MockGPTDataset:
    def __init__(self, num_samples: int, seq_length: int, eod: int, vocab_size: int, seed: int,
                 eod_mask_loss: bool = False, reset_position_ids: bool = False, reset_attention_mask: bool = False):
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.eod = eod
        self.sample_flags = dict(eod_mask_loss=eod_mask_loss, reset_position_ids=reset_position_ids,
                                 reset_attention_mask=reset_attention_mask)
        rng = np.random.default_rng(seed)
        lengths = rng.integers(2, max(3, 2 * seq_length), size=MOCK_NUM_DOCUMENTS)
        # keep enough documents for 1024 distinct samples, then lay them out as one token stream
        wanted = 1024 * (seq_length + 1)
        lengths = lengths[:int(np.searchsorted(np.cumsum(lengths), wanted)) + 1]
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        position_in_doc = np.arange(int(lengths.sum())) - starts      # 0, 1, 2, ... within each document
        body = 1 + (position_in_doc % max(1, min(eod, vocab_size) - 1))
        last_of_doc = np.cumsum(lengths) - 1
        body[last_of_doc] = eod
        self.stream = body.astype(np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        span = self.seq_length + 1
        start = (idx * self.seq_length) % (len(self.stream) - span)
        return make_sample(self.stream[start:start + span], self.eod, **self.sample_flags)
