"""--no-mmap-bin-files: reading each .bin into memory gives the tokens memory-mapping gives."""

import pickle

import numpy as np



def test_no_mmap_bin_files_reads_the_same_tokens_without_mapping(tmp_path):
    from megalite.config.schema import DataConfig
    from megalite.data.builder import _Builder
    from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix, dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(20):
        builder.add_document(rng.integers(0, 500, size=int(rng.integers(1, 50))))
    builder.finalize()
    mapped, read = IndexedDataset(prefix), IndexedDataset(prefix, mmap=False)
    assert read._bin is None and isinstance(mapped._bin, np.memmap)
    for i in range(len(mapped)):
        assert np.array_equal(read[i], mapped[i])
        assert np.array_equal(read.get(i, 1, max(0, len(mapped[i]) - 2)), mapped.get(i, 1, max(0, len(mapped[i]) - 2)))
    assert all(np.array_equal(a, b) for a, b in zip(read[3:9], mapped[3:9]))
    assert (read.max_token(), read.max_token(64), read.min_token()) == \
        (mapped.max_token(), mapped.max_token(64), mapped.min_token())
    assert pickle.loads(pickle.dumps(read)).mmap is False           # DataLoader workers keep the choice
    data = DataConfig(data_path=[prefix], mmap_bin_files=False)
    tok = type("Tok", (), {"vocab_size": 600, "eod": 599})()
    assert _Builder(data, tok, 1, verbose=False).indexed(prefix).mmap is False
