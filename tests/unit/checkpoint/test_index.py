"""The sharded tensor index (megalite/checkpoint/index.py), without processes: a checkpoint of 8
writers and 64 index shards assembled the way save_checkpoint does it (each writer's ``outgoing``
parts, merged per holder). A reader opens only the index files of the keys it asks for; what a rank
sends, and what the busiest holder holds, do not grow with the world at a fixed shard per rank."""
import json
import os

import pytest
import torch

from megalite.checkpoint.files import CheckpointReader, write_metadata
from megalite.checkpoint.tensor_file import DTYPE_NAMES, write_tensor_file
from megalite.checkpoint.index import (BANDS, IndexShards, band_holder, band_rows, encode, holder, index_filename,
                                       key_of, merge, outgoing, write_index_file)
from megalite.errors import UserError

WRITERS, SHARDS, ROWS, COLS = 8, 64, 16, 4


def tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"decoder.layers.{i}.weight": torch.randn(ROWS, COLS) for i in range(12)}


def writer_parts(directory: str, writer: int, shards: int, full: dict[str, torch.Tensor],
                 rows_per_band: int = ROWS) -> dict[int, dict]:
    """Writer ``writer`` stores rows [2w, 2w + 2) of every tensor (and its RNG state), as write_shards does,
    the tensor's bands ``rows_per_band`` rows."""
    r0, r1 = 2 * writer, 2 * writer + 2
    model, rng_file = f"model-dp{writer:05d}.safetensors", f"rng-rank{writer:05d}.safetensors"
    blocks = {f"{name}[{r0}:{r1},0:{COLS}]": t[r0:r1] for name, t in full.items()}
    records = write_tensor_file(directory, model, blocks)
    index = {name: {"shape": [ROWS, COLS], "dtype": DTYPE_NAMES[t.dtype], "band_rows": rows_per_band, "pieces": [
        {"file": model, "key": key, "box": [[r0, r1], [0, COLS]], "crc32": records[key]["crc32"]}]}
        for (name, t), key in zip(full.items(), blocks)}
    rng = {rng_file: write_tensor_file(directory, rng_file, {"cpu": torch.full((3,), writer, dtype=torch.uint8)})}
    sizes = {f: os.path.getsize(os.path.join(directory, f)) for f in (model, rng_file)}
    return outgoing(index, rng, sizes, shards)


@pytest.fixture
def sharded(tmp_path):
    full = tensors()
    payloads = [encode(writer_parts(str(tmp_path), w, SHARDS, full), SHARDS) for w in range(WRITERS)]
    for rank in range(SHARDS):          # what save_checkpoint's all-to-all delivers to each holder
        write_index_file(str(tmp_path), rank, merge([payloads[w][rank] for w in range(WRITERS)]))
    write_metadata(str(tmp_path), {"iteration": 1, "index": {"shards": SHARDS, "bands": BANDS}})
    return tmp_path, full


def opened(monkeypatch) -> list[str]:
    seen, read = [], IndexShards._read
    monkeypatch.setattr(IndexShards, "_read", lambda self, name: seen.append(name) or read(self, name))
    return seen


def test_every_tensor_and_rng_state_round_trips(sharded):
    directory, full = sharded
    reader = CheckpointReader(str(directory))
    assert sorted(reader.names()) == sorted(full)
    assert all(torch.equal(reader.tensor(name), t) for name, t in full.items())
    assert torch.equal(reader.rng_tensors("rng-rank00005.safetensors")["cpu"], torch.full((3,), 5, dtype=torch.uint8))
    assert reader.rng_tensors("rng-rank00099.safetensors") is None


def test_a_reader_opens_only_the_index_files_of_what_it_reads(sharded, monkeypatch):
    directory, full = sharded
    seen = opened(monkeypatch)
    reader = CheckpointReader(str(directory))
    assert seen == []                                         # metadata.json holds no pieces
    name = "decoder.layers.3.weight"
    out = torch.empty(2, COLS)
    reader.read_into([(name, (4, 6, 0, COLS), out)])
    assert torch.equal(out, full[name][4:6])
    assert seen == list(dict.fromkeys(index_filename(r) for r in (holder(name, SHARDS), band_holder(name, 0, SHARDS))))
    before = len(seen)
    reader.rng_tensors("rng-rank00002.safetensors")
    assert seen[before:] in ([], [index_filename(holder("rng-rank00002.safetensors", SHARDS))])
    assert len(set(seen)) == len(seen) <= 3                   # the header's, the band's, the RNG's: each once


def test_a_tensor_in_several_bands_is_read_from_the_bands_it_needs(tmp_path, monkeypatch):
    full = tensors()
    payloads = [encode(writer_parts(str(tmp_path), w, SHARDS, full, rows_per_band=3), SHARDS) for w in range(WRITERS)]
    for rank in range(SHARDS):
        write_index_file(str(tmp_path), rank, merge([payloads[w][rank] for w in range(WRITERS)]))
    write_metadata(str(tmp_path), {"iteration": 1, "index": {"shards": SHARDS, "bands": BANDS}})
    seen = opened(monkeypatch)
    reader = CheckpointReader(str(tmp_path))
    name, out = "decoder.layers.7.weight", torch.empty(2, COLS)
    reader.read_into([(name, (9, 11, 0, COLS), out)])                       # rows 9-10: band 3 of 3 rows
    assert torch.equal(out, full[name][9:11])
    assert set(seen) == {index_filename(holder(name, SHARDS)), index_filename(band_holder(name, 3, SHARDS))}
    assert all(torch.equal(reader.tensor(n), t) for n, t in full.items())


@pytest.mark.parametrize("version", [1, 3, 5])
def test_a_checkpoint_of_another_format_version_is_refused_in_one_line(sharded, version):
    """Only the current format is read: a pre-release one (1: whole tensors, 3: fixed bands) or a newer
    one is named, with what to do."""
    directory = str(sharded[0])
    path = os.path.join(directory, "metadata.json")
    with open(path) as f:
        meta = json.load(f)
    with open(path, "w") as f:
        json.dump({**meta, "version": version}, f)
    with pytest.raises(UserError) as error:
        CheckpointReader(directory)
    message = str(error.value)
    assert "\n" not in message and f"format version {version}, this megalite reads version 4" in message
    assert ("upgrade megalite" in message) == (version == 5)


def test_what_a_rank_sends_does_not_grow_with_the_world(tmp_path):
    """The same writer's pieces at worlds 8, 1,024 and 16,384: the same entries go out (to other holders),
    and a holder holds only the entries of its keys."""
    full = tensors()
    sent = {}
    for world in (8, 1024, 16384):
        payloads = encode(writer_parts(str(tmp_path), 3, world, full), world)
        sent[world] = sum(len(p) for p in payloads)
        assert len(payloads) == world and sum(1 for p in payloads if p) <= len(full) + 1
    assert max(sent.values()) <= min(sent.values()) * 1.2, sent
    assert sent[16384] < 4096


def zero_writer_index(writer: int, writers: int, tensors: int = 2, rows: int = 2, cols: int = 64) -> dict:
    """Writer ``writer`` of ``writers`` (a ZeRO layout: each writes ``rows`` rows of every tensor, so the
    tensors grow with the writers and a writer's shard does not), as write_shards lists its pieces."""
    shape = [rows * writers, cols]
    r0 = rows * writer
    return {f"decoder.layers.{i}.weight": {
        "shape": shape, "dtype": "F32", "band_rows": band_rows(shape, rows), "pieces": [
            {"file": f"model-dp{writer:05d}.safetensors", "key": f"w{i}[{r0}:{r0 + rows},0:{cols}]",
             "box": [[r0, r0 + rows], [0, cols]], "crc32": 0xFFFFFFFF}]} for i in range(tensors)}


def busiest_holder_bytes(world: int) -> int:
    """The most index bytes any rank receives on save when every rank writes its rows of every tensor."""
    held = {}
    for writer in range(world):
        sizes = {f"model-dp{writer:05d}.safetensors": 10 ** 12 - 1}
        for rank, part in outgoing(zero_writer_index(writer, world), {}, sizes, world).items():
            held[rank] = held.get(rank, 0) + len(json.dumps(part, separators=(",", ":")))
    return max(held.values())


def test_the_busiest_holder_holds_no_more_at_a_larger_world():
    """At a fixed shard per rank, more writers of a tensor mean more bands of it, not bigger ones, and
    its bands go to consecutive holders: the busiest holder at 16,384 ranks holds what it holds at 8."""
    small, large = busiest_holder_bytes(8), busiest_holder_bytes(16384)
    assert large <= 1.2 * small, (small, large)


def test_a_missing_or_corrupt_index_file_is_one_clear_error(sharded):
    directory, _ = sharded
    name = "decoder.layers.0.weight"
    path = directory / index_filename(band_holder(name, 0, SHARDS))
    path.write_text("{not json")
    with pytest.raises(UserError, match="is corrupt; load an earlier checkpoint"):
        CheckpointReader(str(directory)).tensor(name)
    path.unlink()
    with pytest.raises(UserError, match="is missing; the checkpoint is incomplete"):
        CheckpointReader(str(directory)).tensor(name)


def test_a_truncated_data_file_is_caught_before_it_is_read(sharded):
    directory, _ = sharded
    with open(directory / "model-dp00002.safetensors", "r+b") as f:
        f.truncate(100)
    reader = CheckpointReader(str(directory))
    with pytest.raises(UserError, match="model-dp00002.safetensors is truncated or altered"):
        reader.tensor("decoder.layers.0.weight")


def test_an_index_entry_that_does_not_cover_its_band_is_corrupt(sharded):
    directory, _ = sharded
    name = "decoder.layers.1.weight"
    path = directory / index_filename(band_holder(name, 0, SHARDS))
    held = json.loads(path.read_text())
    held["tensors"][key_of(name, 0)]["pieces"].pop()
    path.write_text(json.dumps(held))
    with pytest.raises(UserError, match=f"bad index entry for '{key_of(name, 0)}'"):
        CheckpointReader(str(directory)).tensor(name)
