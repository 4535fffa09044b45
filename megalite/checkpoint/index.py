"""A training checkpoint's tensor index, sharded so that no rank sends, holds or reads the whole of it.

The index says where each piece of each stored tensor is (files.py describes a piece). A piece is
listed under a key: the tensor's global name and a band of its rows, ``name#band`` (a band is whole rows
holding BAND_ELEMENTS elements, so a small tensor is one band; a piece is listed under every band it
spans). A key's entry lives in the index file of its holder, rank ``crc32(key) % shards``:
``index-rankNNNNN.json``, one per rank of the saving run, written by that rank (possibly empty, so a
missing file is an incomplete checkpoint rather than an absent tensor). The CRC records of each rank's
RNG file are keyed the same way, by the file's name. metadata.json holds the number of shards and the
band size, not the pieces.

Saving (``outgoing``, ``exchange``, ``merge``): each rank sends the entries of the pieces it wrote to
their holders, with two all-to-alls (the byte counts, then the bytes), so a rank sends what its own
pieces take and holds what its keys take. Loading (``IndexShards``): a rank computes the keys of the
boxes it needs and reads their holders' files, each once; a data file's size is checked against the
one the index file that names it records.

    {"tensors": {"decoder.final_layernorm.weight#0": {"name": "decoder.final_layernorm.weight",
                   "shape": [64], "dtype": "F32", "pieces": [{"file", "key", "box", "crc32"}, ...]}},
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

BAND_ELEMENTS = 1 << 24
SEPARATOR = "#"


def as_2d(shape) -> tuple[int, int]:
    """[rows, columns] of a tensor of ``shape`` viewed 2-D (1-D tensors are one column)."""
    return shape[0], math.prod(shape[1:])


def pieces_of(name: str, entry: dict) -> list[dict]:
    """An index entry's pieces; a whole-tensor record (format 1, conversion tools, RNG states) is one
    piece: the whole tensor, stored under its own name."""
    if "pieces" in entry:
        return entry["pieces"]
    rows, cols = as_2d(entry["shape"])
    return [{"file": entry["file"], "key": name, "box": [[0, rows], [0, cols]], "crc32": entry["crc32"]}]


def files_of(index: dict) -> set:
    """The files an index (tensors, or one rank's RNG states) refers to."""
    return {piece["file"] for name, entry in index.items() for piece in pieces_of(name, entry)}


def band_rows(shape) -> int:
    rows, cols = as_2d(shape)
    return max(1, BAND_ELEMENTS // max(cols, 1))


def bands(shape, r0: int, r1: int) -> range:
    """The bands that rows [r0, r1) of a tensor of ``shape`` touch."""
    step = band_rows(shape)
    return range(r0 // step, (r1 - 1) // step + 1)


def key_of(name: str, band: int) -> str:
    return f"{name}{SEPARATOR}{band}"


def holder(key: str, shards: int) -> int:
    return zlib.crc32(key.encode()) % shards


def index_filename(rank: int) -> str:
    return f"index-rank{rank:05d}.json"


def check_filename(directory: str, source: str, name) -> None:
    """A crafted index must not make us read files outside the checkpoint directory."""
    if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
        raise UserError(f"checkpoint {directory}/{source} names the file {name!r} outside the checkpoint directory; "
                        "refusing to read it")


def checked_entries(raw: dict, where: str, dtypes, bands_of: dict | None = None) -> dict[str, dict]:
    """Every entry as {shape, dtype, pieces}, its pieces inside the tensor and covering all of it (or,
    where ``bands_of`` gives an entry's band, all of that band's rows)."""
    index = {}
    for name, entry in raw.items():
        try:
            shape = [int(n) for n in entry["shape"]]
            rows, cols = as_2d(shape)
            lo, hi = 0, rows
            if bands_of is not None:
                step = band_rows(shape)
                lo, hi = bands_of[name] * step, min(rows, (bands_of[name] + 1) * step)
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


# ---- saving --------------------------------------------------------------------------------------
def outgoing(index: dict[str, dict], rng: dict[str, dict], sizes: dict[str, int], shards: int) -> dict[int, dict]:
    """What this rank sends to each holder: the entries of its pieces (``index``, as write_shards
    returns it), its RNG records, and the sizes of the files they are in."""
    out: dict[int, dict] = {}

    def part(key: str) -> dict:
        return out.setdefault(holder(key, shards), {"tensors": {}, "rng": {}, "files": {}})

    for name, entry in index.items():
        for piece in entry["pieces"]:
            (r0, r1), _ = piece["box"]
            for band in bands(entry["shape"], r0, r1):
                key = key_of(name, band)
                target = part(key)
                target["tensors"].setdefault(key, {"name": name, "shape": entry["shape"], "dtype": entry["dtype"],
                                                   "pieces": []})["pieces"].append(piece)
                target["files"][piece["file"]] = sizes[piece["file"]]
    for filename, records in rng.items():
        target = part(filename)
        target["rng"][filename] = records
        target["files"][filename] = sizes[filename]
    return out


def encode(parts: dict[int, dict], world: int) -> list[bytes]:
    """The bytes this rank sends to each rank (empty where it sends nothing)."""
    return [json.dumps(parts[r], separators=(",", ":")).encode() if r in parts else b"" for r in range(world)]


def exchange(payloads: list[bytes], device) -> list[bytes]:
    """All-to-all of byte strings over the default group: payloads[r] goes to rank r; returns what each
    rank sent here. First the byte counts, then the bytes with uneven splits, both on ``device`` (NCCL
    needs the group's device) and posted in the same order on every rank."""
    counts = torch.tensor([len(p) for p in payloads], dtype=torch.int64, device=device)
    incoming = torch.empty_like(counts)
    collectives.all_to_all_single(incoming, counts)
    send, recv = [len(p) for p in payloads], incoming.tolist()
    joined = b"".join(payloads)
    data = (torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8))
    out = torch.empty(sum(recv), dtype=torch.uint8, device=device)
    collectives.all_to_all_single(out, data.to(device), recv, send)
    received, start = out.cpu().numpy().tobytes(), 0
    parts = []
    for n in recv:
        parts.append(received[start:start + n])
        start += n
    return parts


def merge(received: list[bytes]) -> dict:
    """One holder's index file from the parts every rank sent it."""
    held = {"tensors": {}, "rng": {}, "files": {}}
    for data in received:
        if not data:
            continue
        part = json.loads(data)
        for key, entry in part["tensors"].items():
            held["tensors"].setdefault(key, {**entry, "pieces": []})["pieces"].extend(entry["pieces"])
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
            self.shards, band = int(sharding["shards"]), int(sharding["band_elements"])
        except (KeyError, TypeError, ValueError):
            raise UserError(f"checkpoint {directory}/metadata.json is corrupt (bad index description); "
                            "load an earlier checkpoint") from None
        if self.shards < 1 or band != BAND_ELEMENTS:
            raise UserError(f"checkpoint {directory}/metadata.json describes an index of {self.shards} shards in bands "
                            f"of {band} elements; this megalite reads bands of {BAND_ELEMENTS}: upgrade megalite")
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
            keyed = {key: entry["name"] for key, entry in tensors.items()}
            band_of = {key: int(key.rpartition(SEPARATOR)[2]) for key in tensors}
            if any(key_of(name, band_of[key]) != key for key, name in keyed.items()):
                raise ValueError("key")
            if not all(type(n) is int and n >= 0 for n in files.values()):
                raise ValueError("size")
        except FileNotFoundError:
            raise UserError(f"checkpoint file {path} is missing; the checkpoint is incomplete, "
                            "load an earlier one") from None
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError):
            raise UserError(f"checkpoint {path} is corrupt; load an earlier checkpoint") from None
        entries = checked_entries(tensors, path, self.dtypes, band_of)
        records = {name: checked_entries(r, path, self.dtypes) for name, r in rng.items()}
        for name in set(files) | files_of(entries) | set(records) | {f for r in records.values() for f in files_of(r)}:
            check_filename(self.directory, filename, name)
            if name not in files:
                raise UserError(f"checkpoint {path} is corrupt (no size for {name}); load an earlier checkpoint")
            if self.sizes.setdefault(name, files[name]) != files[name]:
                raise UserError(f"checkpoint {path} is corrupt (two sizes for {name}); load an earlier checkpoint")
        return {"tensors": {key: {**entry, "name": keyed[key]} for key, entry in entries.items()}, "rng": records}

    def entry(self, name: str, band: int = 0) -> dict | None:
        """The entry of one band of tensor ``name`` (its pieces that touch the band), or None."""
        key = key_of(name, band)
        return self._file(holder(key, self.shards))["tensors"].get(key)

    def pieces(self, name: str, shape, row_ranges) -> list[dict]:
        """The pieces of tensor ``name`` that touch any of ``row_ranges`` ([r0, r1) pairs), each once."""
        needed = sorted({b for r0, r1 in row_ranges for b in bands(shape, r0, r1)})
        found, seen = [], set()
        for band in needed:
            entry = self.entry(name, band)
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
