"""What a packed sample emits under Megatron's document flags (--eod-mask-loss, --reset-position-ids,
--reset-attention-mask), byte for byte against hand-worked samples, through the GPT and mock datasets,
their shared index cache and the loader's collation."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from megalite.data.gpt_dataset import GPTDataset
from megalite.data.gpt_sample import make_sample
from megalite.data.mock_dataset import MockGPTDataset
from unit.data.test_data_gpt_dataset import EOD, make_dataset

E = 9
# the s + 1 = 10 tokens of one sample: the tail of a document, a whole one, an empty one (a lone EOD),
# and the head of the next; the EOD ends its document and the token after it starts the next one
TOKENS = np.array([5, 6, E, 7, 8, E, E, 1, 2, 3])
HAND_WORKED = {
    "tokens": np.array([5, 6, E, 7, 8, E, E, 1, 2], dtype=np.int64),
    "labels": np.array([6, E, 7, 8, E, E, 1, 2, 3], dtype=np.int64),
    "loss_mask": np.array([1, 1, 0, 1, 1, 0, 0, 1, 1], dtype=np.float32),   # inputs that are EOD
    "position_ids": np.array([0, 1, 2, 0, 1, 2, 0, 0, 1], dtype=np.int64),
    "cu_seqlens": np.array([0, 3, 6, 7, 9, 9, 9, 9, 9, 9], dtype=np.int32),  # documents, then s repeated
}


def assert_bytes_equal(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for key, want in expected.items():
        assert got[key].dtype == want.dtype and got[key].shape == want.shape, key
        assert got[key].tobytes() == want.tobytes(), (key, got[key], want)


def test_every_flag_emits_the_hand_worked_fields():
    sample = make_sample(TOKENS, E, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    assert_bytes_equal(sample, HAND_WORKED)


@pytest.mark.parametrize("flags", [{}, {"eod_mask_loss": True}, {"reset_position_ids": True},
                                   {"reset_attention_mask": True}])
def test_each_flag_changes_only_its_own_field(flags):
    plain = {**HAND_WORKED, "loss_mask": np.ones(9, np.float32), "position_ids": np.arange(9, dtype=np.int64)}
    del plain["cu_seqlens"]
    expected = dict(plain)
    for flag, key in (("eod_mask_loss", "loss_mask"), ("reset_position_ids", "position_ids"),
                      ("reset_attention_mask", "cu_seqlens")):
        if flags.get(flag):
            expected[key] = HAND_WORKED[key]
    assert_bytes_equal(make_sample(TOKENS, E, **flags), expected)


def test_an_eod_at_the_last_input_ends_the_last_document_and_none_means_one_document():
    last = make_sample(np.array([1, 2, E, 3]), E, reset_position_ids=True, reset_attention_mask=True)
    np.testing.assert_array_equal(last["position_ids"], [0, 1, 2])
    np.testing.assert_array_equal(last["cu_seqlens"], [0, 3, 3, 3])
    # the EOD as the label only (the sample's extra token) ends nothing inside the sample
    none = make_sample(np.array([1, 2, 3, E]), E, reset_position_ids=True, reset_attention_mask=True)
    np.testing.assert_array_equal(none["position_ids"], [0, 1, 2])
    np.testing.assert_array_equal(none["cu_seqlens"], [0, 3, 3, 3])


def test_collation_stacks_the_boundaries_per_sample():
    samples = [make_sample(TOKENS, E, reset_attention_mask=True),
               make_sample(np.array([1, 2, 3, 4, E, 5, 6, 7, 8, 9]), E, reset_attention_mask=True)]
    batch = default_collate(samples)
    assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"].shape == (2, 10)
    assert batch["cu_seqlens"][1].tolist() == [0, 5, 9, 9, 9, 9, 9, 9, 9, 9]


def test_gpt_dataset_flags_change_only_the_fields_and_share_the_index_cache(tmp_path):
    ds = make_dataset(tmp_path / "d", np.random.default_rng(5).integers(2, 12, size=60))
    cache = str(tmp_path / "cache")
    plain = GPTDataset(ds, (0, 60), 40, 16, seed=3, eod=EOD, cache_dir=cache, verbose=False)
    flagged = GPTDataset(ds, (0, 60), 40, 16, seed=3, eod=EOD, cache_dir=cache, verbose=False,
                         eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    assert (plain.index_source, flagged.index_source) == ("built", "cache")
    for idx in range(len(plain)):
        tokens = plain.sample_tokens(idx)
        assert_bytes_equal(flagged[idx], make_sample(tokens, EOD, True, True, True))
        assert_bytes_equal(plain[idx], make_sample(tokens, EOD))
    assert len(set(int((flagged[i]["tokens"] == EOD).sum()) for i in range(len(plain)))) > 1


def test_mock_data_emits_the_boundaries_of_its_documents():
    mock = MockGPTDataset(4, 32, eod=50, vocab_size=51, seed=0, reset_position_ids=True, reset_attention_mask=True)
    sample = mock[1]
    assert_bytes_equal(sample, make_sample(mock.stream[32:65], 50, reset_position_ids=True,
                                           reset_attention_mask=True))
    assert (sample["tokens"] == 50).any()
