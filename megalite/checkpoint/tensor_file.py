"""One safetensors file, written and read in bounded blocks: what every checkpoint file is.

The format (safetensors): 8 bytes of little-endian header length, a JSON header {key: {dtype, shape,
data_offsets}} padded with spaces to 8 bytes, then the tensors' bytes in row-major order. Nothing is
pickled, so reading a file never runs code.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import zlib

import numpy as np
import torch

DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
               torch.uint8: "U8", torch.int32: "I32"}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
STAGING_BYTES = 64 << 20     # host memory a tensor passes through at a time, when written or read


def write_tensor_file(directory: str, filename: str, tensors: dict[str, "torch.Tensor | HostArray"]) -> dict[str, dict]:
    """Write ``tensors`` (contiguous or strided, on any device, or HostArrays) to directory/filename in the
    safetensors format; returns their index records ``{key: {file, shape, dtype, crc32}}``.

    Written by hand rather than with safetensors.torch.save_file so that a tensor passes through host
    memory in blocks of STAGING_BYTES (save_file needs every tensor on the CPU at once), and its CRC-32
    is computed in the same pass. Given only HostArrays it calls nothing of torch (a forked writer)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, t in tensors.items():
        dtype, shape, nbytes = _layout(t)
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)          # the data starts 8-byte aligned, as safetensors writes it
    records = {}
    with open(os.path.join(directory, filename), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for key, t in tensors.items():
            crc = 0
            for block in _byte_blocks(t):
                f.write(block)
                crc = zlib.crc32(block, crc)
            records[key] = {"file": filename, "shape": header[key]["shape"], "dtype": header[key]["dtype"],
                            "crc32": crc}
        f.flush()
        os.fsync(f.fileno())
    return records


@dataclasses.dataclass(frozen=True)
class HostArray:
    """A host tensor's bytes as a NumPy view of its memory (no copy; unsigned integers of the tensor's
    element size, with its strides), so that a writer can run where torch must not be called: a process
    forked from a rank whose torch has threads of its own (background.py)."""
    dtype: str                     # DTYPE_NAMES
    shape: list[int]
    array: np.ndarray

    @staticmethod
    def of(tensor: torch.Tensor) -> "HostArray":
        raw = tensor.detach().view(_RAW[tensor.element_size()])
        return HostArray(DTYPE_NAMES[tensor.dtype], list(tensor.shape), raw.numpy())


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _layout(t) -> tuple[str, list[int], int]:
    """(dtype name, shape, byte count) of a tensor or HostArray."""
    if isinstance(t, HostArray):
        return t.dtype, t.shape, t.array.nbytes
    return DTYPE_NAMES[t.dtype], list(t.shape), t.numel() * t.element_size()


def _byte_blocks(tensor):
    """The tensor's bytes, at most STAGING_BYTES at a time, as CPU uint8 arrays."""
    if isinstance(tensor, HostArray):
        yield from _array_blocks(tensor.array)
        return
    flat = tensor.detach().contiguous().view(-1)
    step = max(1, STAGING_BYTES // flat.element_size())
    for start in range(0, flat.numel(), step):
        yield flat[start:start + step].cpu().view(torch.uint8).numpy()


def _array_blocks(array: np.ndarray):
    """A strided array's bytes in row order, at most STAGING_BYTES (or one row) at a time, with NumPy's
    copies only: a contiguous array is sliced, a strided one (a box of a wider tensor) copied by rows."""
    if array.flags.c_contiguous:
        flat = array.reshape(-1).view(np.uint8)
        for start in range(0, flat.size, STAGING_BYTES):
            yield flat[start:start + STAGING_BYTES]
        return
    rows = max(1, STAGING_BYTES // max(1, array[:1].nbytes))
    for start in range(0, array.shape[0], rows):
        yield np.ascontiguousarray(array[start:start + rows]).reshape(-1).view(np.uint8)


def as_bytes(tensor: torch.Tensor):
    """A CPU tensor's bytes as a flat uint8 array (a copy only where it is not contiguous)."""
    return tensor.contiguous().view(-1).view(torch.uint8).numpy()


def read_safetensors_header(path: str) -> dict[str, tuple]:
    """{key: (dtype, shape, first byte, end byte)} of a safetensors file, offsets from the file's start.

    Tensors are then read with plain reads into a staging block, not through a memory map: mapped file
    pages count in the process's RSS for as long as the file stays mapped, so reading a rank's share of a
    checkpoint through mmap would hold that share a second time."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        if size > 100 << 20:
            raise ValueError(f"header of {size} bytes")
        header = json.loads(f.read(size))
    base, total, tensors = 8 + size, os.path.getsize(path), {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        dtype = TORCH_DTYPES[entry["dtype"]]
        shape = [int(n) for n in entry["shape"]]
        if not 0 <= begin <= end or base + end > total or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {key!r} has inconsistent offsets")
        tensors[key] = (dtype, shape, base + begin, base + end)
    return tensors


class StoredTensor:
    """One tensor of a safetensors file, read a block of rows at a time."""

    def __init__(self, path: str, dtype: torch.dtype, shape: list[int], begin: int, end: int):
        self.path, self.dtype, self.shape, self.begin, self.end = path, dtype, shape, begin, end

    def rows(self, a: int, b: int) -> torch.Tensor:
        row_bytes = (self.end - self.begin) // max(self.shape[0], 1)
        with open(self.path, "rb") as f:
            f.seek(self.begin + a * row_bytes)
            data = bytearray(f.read((b - a) * row_bytes))
        if len(data) != (b - a) * row_bytes:
            raise ValueError("file ends early")
        return torch.frombuffer(data, dtype=self.dtype).view(b - a, *self.shape[1:])
