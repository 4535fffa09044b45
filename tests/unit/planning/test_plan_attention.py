"""The attended fraction of masked attention: pair counts by hand, packing as Megatron packs, a corpus."""
import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDatasetBuilder
from megalite.planning.attention import attended_fraction, causal_pairs, corpus_document_lengths, packed_pieces


def brute_pairs(length, left):
    return sum(1 for i in range(length) for j in range(length) if j <= i and (left < 0 or i - j <= left))


@pytest.mark.parametrize("length, left", [(1, -1), (7, -1), (7, 0), (7, 2), (7, 6), (7, 10), (64, 5)])
def test_causal_pairs_count_what_the_mask_keeps(length, left):
    assert causal_pairs([length], left)[0] == brute_pairs(length, left)


def test_documents_continue_into_the_next_sample():
    # samples of 8: [3 | 5], [4 | 4 (the 6-token document's first part)], [2 (its rest) | 6 ...]
    assert packed_pieces([3, 5, 4, 6, 6], 8).tolist() == [3, 5, 4, 4, 2, 6]


def test_fraction_is_one_for_plain_causal_and_the_pair_ratio_otherwise():
    assert attended_fraction(8) == 1.0
    assert attended_fraction(8, document_lengths=[8, 8, 8]) == 1.0
    kept = brute_pairs(3, -1) + brute_pairs(5, -1) + 2 * brute_pairs(4, -1)
    assert attended_fraction(8, document_lengths=[3, 5, 4, 4, 3]) == pytest.approx(kept / (2 * brute_pairs(8, -1)))
    assert attended_fraction(8, window_left=2) == pytest.approx(brute_pairs(8, 2) / brute_pairs(8, -1))
    with pytest.raises(ValueError, match="fewer than one sample"):
        attended_fraction(8, document_lengths=[3])


def test_a_corpus_gives_its_document_lengths(tmp_path):
    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix)
    for doc in ([np.arange(5)], [np.arange(2), np.arange(3)], [np.arange(7)]):   # the second has two sentences
        for sentence in doc:
            builder.add_item(sentence)
        builder.end_document()
    builder.finalize()
    assert corpus_document_lengths(prefix).tolist() == [5, 5, 7]
    assert corpus_document_lengths(prefix, tokens=6).tolist() == [5, 5]
