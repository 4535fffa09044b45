"""A training checkpoint's tensor index, sharded so that no rank sends, holds or reads the whole of it.

The index says where each piece of each stored tensor is (files.py describes a piece). A piece is
listed under a key: the tensor's global name and a band of its rows, ``name#band``, and under every band
it spans. A band is ``band_rows`` whole rows, chosen per tensor from the save's layout (``band_rows``):
about the rows one writer wrote at a time, so that a band lists a few pieces of each column block and a
piece spans a few bands, however many ranks wrote the tensor. The tensor's header, keyed by its bare
name, records its shape, dtype and band rows; the writer of its element (0, 0) sends it. A key's entry
lives in the index file of its holder: rank ``crc32(name) % shards`` for a header, the next ranks in
turn for band 0, 1, ... (``band_holder``), so a tensor's bands spread evenly. Index files are
``index-rankNNNNN.json``, one per rank of the saving run, written by that rank (possibly empty, so a
missing file is an incomplete checkpoint rather than an absent tensor). The CRC records of each rank's
RNG file are held by ``crc32(file name) % shards``. metadata.json holds the number of shards, not the
pieces.

Saving (``outgoing``, ``exchange``, ``merge``): each rank sends the entries of the pieces it wrote to
their holders, with two all-to-alls (the byte counts, then the bytes), so a rank sends what its own
pieces take and holds what its keys take. Loading (``IndexShards``): a rank reads the header of each
tensor it needs, computes the keys of the boxes it needs and reads their holders' files, each once; a
data file's size is checked against the one the index file that names it records.

    {"tensors": {"decoder.final_layernorm.weight#0": {"name": "decoder.final_layernorm.weight",
                   "shape": [64], "dtype": "F32", "band_rows": 64,
                   "pieces": [{"file", "key", "box", "crc32"}, ...]}},
     "headers": {"decoder.final_layernorm.weight": {"shape": [64], "dtype": "F32", "band_rows": 64}},
     "rng": {"rng-rank00003.safetensors": {"cpu": {"file", "shape", "dtype", "crc32"}}},
     "files": {"model-pp000.safetensors": 123456, ...}}
"""
from __future__ import annotations

import json
import math
import os
import zlib

import torch

from megalite.errors import UserError
from megalite.parallel import collectives

BAND_ELEMENTS = 1 << 24      # the most elements a band holds
SEPARATOR = "#"
BANDS = "per tensor"         # metadata.json's index description: each tensor's header has its band rows


def as_2d(shape) -> tuple[int, int]:
    """[rows, columns] of a tensor of ``shape`` viewed 2-D (1-D tensors are one column)."""
    return shape[0], math.prod(shape[1:])


def pieces_of(name: str, entry: dict) -> list[dict]:
    """An index entry's pieces; a whole-tensor record (conversion tools, RNG states) is one
    piece: the whole tensor, stored under its own name."""
    if "pieces" in entry:
        return entry["pieces"]
    rows, cols = as_2d(entry["shape"])
    return [{"file": entry["file"], "key": name, "box": [[0, rows], [0, cols]], "crc32": entry["crc32"]}]


def files_of(index: dict) -> set:
    """The files an index (tensors, or one rank's RNG states) refers to."""
    return {piece["file"] for name, entry in index.items() for piece in pieces_of(name, entry)}


def band_rows(shape, writer_rows: int) -> int:
    """Rows per band of a tensor of ``shape`` of which each writer wrote at most ``writer_rows`` rows at a
    time (the same number on every writer of it), at most BAND_ELEMENTS elements a band."""
    rows, cols = as_2d(shape)
    return max(1, min(writer_rows, rows, BAND_ELEMENTS // max(cols, 1)))


def bands(step: int, r0: int, r1: int) -> range:
    """The bands of ``step`` rows that rows [r0, r1) touch."""
    return range(r0 // step, (r1 - 1) // step + 1)


def key_of(name: str, band: int) -> str:
    return f"{name}{SEPARATOR}{band}"


def holder(key: str, shards: int) -> int:
    return zlib.crc32(key.encode()) % shards


def band_holder(name: str, band: int, shards: int) -> int:
    """The holder of band ``band`` of tensor ``name``: consecutive bands on consecutive ranks, so a
    tensor's bands spread evenly whatever their number."""
    return (holder(name, shards) + band) % shards


def index_filename(rank: int) -> str:
    return f"index-rank{rank:05d}.json"


def check_filename(directory: str, source: str, name) -> None:
    """A crafted index must not make us read files outside the checkpoint directory."""
    if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
        raise UserError(f"checkpoint {directory}/{source} names the file {name!r} outside the checkpoint directory; "
                        "refusing to read it")


def checked_entries(raw: dict, where: str, dtypes, bands_of: dict | None = None) -> dict[str, dict]:
    """Every entry as {shape, dtype, pieces}, its pieces inside the tensor and covering all of it (or,
    where ``bands_of`` gives an entry's (band, band rows), all of that band's rows)."""
    index = {}
    for name, entry in raw.items():
        try:
            shape = [int(n) for n in entry["shape"]]
            rows, cols = as_2d(shape)
            lo, hi = 0, rows
            if bands_of is not None:
                band, step = bands_of[name]
                if type(step) is not int or step < 1:
                    raise ValueError(name)
                lo, hi = band * step, min(rows, (band + 1) * step)
            pieces, covered = pieces_of(name, entry), 0
            for piece in pieces:
                (r0, r1), (c0, c1) = piece["box"]
                numbers = (r0, r1, c0, c1, piece["crc32"])
                if not (all(type(n) is int for n in numbers) and 0 <= r0 < r1 <= rows and 0 <= c0 < c1 <= cols
                        and isinstance(piece["key"], str) and isinstance(piece["file"], str)):
                    raise ValueError(name)
                covered += max(0, min(r1, hi) - max(r0, lo)) * (c1 - c0)
            if not lo < hi or covered < (hi - lo) * cols or entry["dtype"] not in dtypes:
                raise ValueError(name)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):
            raise UserError(f"checkpoint {where} is corrupt (bad index entry for {name!r}); "
                            "load an earlier checkpoint") from None
        index[name] = {"shape": shape, "dtype": entry["dtype"], "pieces": pieces}
    return index


def checked_headers(raw: dict, where: str, dtypes) -> dict[str, dict]:
    """Every tensor header as {shape, dtype, band_rows}, each field of the right type."""
    try:
        headers = {name: {"shape": [int(n) for n in h["shape"]], "dtype": h["dtype"], "band_rows": h["band_rows"]}
                   for name, h in raw.items()}
        if not all(h["dtype"] in dtypes and type(h["band_rows"]) is int and h["band_rows"] >= 1
                   and min(h["shape"], default=0) >= 0 for h in headers.values()):
            raise ValueError("header")
    except (KeyError, TypeError, ValueError, AttributeError):
        raise UserError(f"checkpoint {where} is corrupt (bad tensor header); load an earlier checkpoint") from None
    return headers


# ---- saving --------------------------------------------------------------------------------------
def outgoing(index: dict[str, dict], rng: dict[str, dict], sizes: dict[str, int], shards: int) -> dict[int, dict]:
    """What this rank sends to each holder: the entries of its pieces (``index``, as write_shards
    returns it: {name: {shape, dtype, band_rows, pieces}}), the header of each tensor whose element
    (0, 0) it wrote, its RNG records, and the sizes of the files they are in."""
    out: dict[int, dict] = {}

    def part(rank: int) -> dict:
        return out.setdefault(rank, {"tensors": {}, "headers": {}, "rng": {}, "files": {}})

    for name, entry in index.items():
        step = entry["band_rows"]
        header = {"shape": entry["shape"], "dtype": entry["dtype"], "band_rows": step}
        for piece in entry["pieces"]:
            (r0, r1), (c0, _) = piece["box"]
            if r0 == 0 and c0 == 0:               # exactly one piece holds element (0, 0)
                part(holder(name, shards))["headers"][name] = header
            for band in bands(step, r0, r1):
                key = key_of(name, band)
                target = part(band_holder(name, band, shards))
                target["tensors"].setdefault(key, {"name": name, **header, "pieces": []})["pieces"].append(piece)
                target["files"][piece["file"]] = sizes[piece["file"]]
    for filename, records in rng.items():
        target = part(holder(filename, shards))
        target["rng"][filename] = records
        target["files"][filename] = sizes[filename]
    return out


def encode_part(part: dict) -> bytes:
    return json.dumps(part, separators=(",", ":")).encode()


def encode(parts: dict[int, dict], world: int) -> list[bytes]:
    """The bytes this rank sends to each rank (empty where it sends nothing)."""
    return [encode_part(parts[r]) if r in parts else b"" for r in range(world)]


def exchange(payloads: list[bytes], device, group=None) -> list[bytes]:
    """All-to-all of byte strings over ``group`` (the default group: all ranks): payloads[r] goes to rank r;
    returns what each rank sent here. First the byte counts, then the bytes with uneven splits, both on
    ``device`` (NCCL needs the group's device) and posted in the same order on every rank."""
    counts = torch.tensor([len(p) for p in payloads], dtype=torch.int64, device=device)
    incoming = torch.empty_like(counts)
    collectives.all_to_all_single(incoming, counts, group=group)
    send, recv = [len(p) for p in payloads], incoming.tolist()
    joined = b"".join(payloads)
    data = (torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8))
    out = torch.empty(sum(recv), dtype=torch.uint8, device=device)
    collectives.all_to_all_single(out, data.to(device), recv, send, group=group)
    received, start = out.cpu().numpy().tobytes(), 0
    parts = []
    for n in recv:
        parts.append(received[start:start + n])
        start += n
    return parts


def merge(received: list[bytes]) -> dict:
    """One holder's index file from the parts every rank sent it. The writers of a tensor size its bands
    alike (sharded.py); a band entry that differs in them is refused rather than written."""
    held = {"tensors": {}, "headers": {}, "rng": {}, "files": {}}
    for data in received:
        if not data:
            continue
        part = json.loads(data)
        for key, entry in part["tensors"].items():
            merged = held["tensors"].setdefault(key, {**entry, "pieces": []})
            if any(merged[field] != entry[field] for field in ("shape", "dtype", "band_rows")):
                raise UserError(f"checkpoint index: the writers of {entry['name']!r} disagree on its bands "
                                f"({merged['band_rows']} and {entry['band_rows']} rows); this is a megalite bug")
            merged["pieces"].extend(entry["pieces"])
        held["headers"].update(part["headers"])
        held["rng"].update(part["rng"])
        held["files"].update(part["files"])
    return held


def write_index_file(directory: str, rank: int, held: dict) -> None:
    path = os.path.join(directory, index_filename(rank))
    with open(path, "w") as f:
        json.dump(held, f, separators=(",", ":"), sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


# ---- loading -------------------------------------------------------------------------------------
class IndexShards:
    """A sharded index, read on demand: the holder's file of each key asked for, once."""

    def __init__(self, directory: str, sharding: dict, dtypes):
        self.directory, self.dtypes = directory, dtypes
        try:
            self.shards, bands_of = int(sharding["shards"]), sharding["bands"]
        except (KeyError, TypeError, ValueError, AttributeError):
            raise UserError(f"checkpoint {directory}/metadata.json is corrupt (bad index description); "
                            "load an earlier checkpoint") from None
        if self.shards < 1 or bands_of != BANDS:
            raise UserError(f"checkpoint {directory}/metadata.json describes an index of {self.shards} shards in bands "
                            f"{bands_of}; this megalite reads bands {BANDS}: upgrade megalite")
        self.loaded: dict[int, dict] = {}          # rank -> its parsed index file
        self.sizes: dict[str, int] = {}            # data file -> its size, as the index files read so far record

    def _file(self, rank: int) -> dict:
        if rank not in self.loaded:
            self.loaded[rank] = self._read(index_filename(rank))
        return self.loaded[rank]

    def _read(self, filename: str) -> dict:
        path = os.path.join(self.directory, filename)
        try:
            with open(path) as f:
                raw = json.load(f)
            tensors, rng, files = raw["tensors"], raw["rng"], raw["files"]
            headers = raw["headers"]
            keyed = {key: entry["name"] for key, entry in tensors.items()}
            bands_of = {key: (int(key.rpartition(SEPARATOR)[2]), entry["band_rows"]) for key, entry in tensors.items()}
            if any(key_of(name, bands_of[key][0]) != key for key, name in keyed.items()):
                raise ValueError("key")
            if not all(type(n) is int and n >= 0 for n in files.values()):
                raise ValueError("size")
        except FileNotFoundError:
            raise UserError(f"checkpoint file {path} is missing; the checkpoint is incomplete, "
                            "load an earlier one") from None
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError):
            raise UserError(f"checkpoint {path} is corrupt; load an earlier checkpoint") from None
        entries = checked_entries(tensors, path, self.dtypes, bands_of)
        records = {name: checked_entries(r, path, self.dtypes) for name, r in rng.items()}
        for name in set(files) | files_of(entries) | set(records) | {f for r in records.values() for f in files_of(r)}:
            check_filename(self.directory, filename, name)
            if name not in files:
                raise UserError(f"checkpoint {path} is corrupt (no size for {name}); load an earlier checkpoint")
            if self.sizes.setdefault(name, files[name]) != files[name]:
                raise UserError(f"checkpoint {path} is corrupt (two sizes for {name}); load an earlier checkpoint")
        return {"tensors": {key: {**entry, "name": keyed[key], "band_rows": bands_of[key][1]}
                            for key, entry in entries.items()},
                "headers": checked_headers(headers, path, self.dtypes), "rng": records}

    def header(self, name: str) -> dict | None:
        """Tensor ``name``'s {shape, dtype, band_rows}, or None when the checkpoint lacks it."""
        return self._file(holder(name, self.shards))["headers"].get(name)

    def entry(self, name: str, band: int) -> dict | None:
        """The entry of one band of tensor ``name`` (its pieces that touch the band), or None."""
        return self._file(band_holder(name, band, self.shards))["tensors"].get(key_of(name, band))

    def pieces(self, name: str, row_ranges) -> list[dict]:
        """The pieces of tensor ``name`` that touch any of ``row_ranges`` ([r0, r1) pairs), each once."""
        header = self.header(name)
        needed = sorted({b for r0, r1 in row_ranges for b in bands(header["band_rows"], r0, r1)})
        found, seen = [], set()
        for band in needed:
            entry = self.entry(name, band)
            if entry and any(entry[field] != header[field] for field in ("shape", "dtype", "band_rows")):
                raise UserError(f"checkpoint {self.directory} is corrupt (band {band} of {name!r} does not match "
                                "its header); load an earlier checkpoint")
            for piece in entry["pieces"] if entry else ():
                ident = (piece["file"], piece["key"])
                if ident not in seen:
                    seen.add(ident)
                    found.append(piece)
        return found

    def rng(self, filename: str) -> dict | None:
        return self._file(holder(filename, self.shards))["rng"].get(filename)

    def everything(self) -> dict[str, dict]:
        """Every tensor's entry with all its pieces: reads every index file (single-process tools)."""
        whole: dict[str, dict] = {}
        for rank in range(self.shards):
            for entry in self._file(rank)["tensors"].values():
                name = entry["name"]
                merged = whole.setdefault(name, {"shape": entry["shape"], "dtype": entry["dtype"], "pieces": []})
                known = {(p["file"], p["key"]) for p in merged["pieces"]}
                merged["pieces"] += [p for p in entry["pieces"] if (p["file"], p["key"]) not in known]
        return whole
