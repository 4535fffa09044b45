"""Write a converted model a bounded amount at a time, in both directions of the Hugging Face conversion.

The converters (hf.py) yield a model in parts: the embedding, each transformer layer, each
multi-token-prediction layer, the final norm and output head. These writers gather consecutive parts
into one file until it holds SHARD_BYTES or more and write it at once, dropping their references to it
before the next part is converted. A conversion therefore holds at most one file's tensors plus one
part, never the whole model (DeepSeek-V3 is ~1.3 TB in bf16; one of its layers ~23 GB).

- megalite side: the files ``model-00000.safetensors``, ``model-00001.safetensors``, ... of one
  iteration directory, each tensor recorded whole under its own name with the file that holds it, in the
  index that metadata.json carries (files.py reads several files of one iteration directory).
- Hugging Face side: ``model.safetensors`` when the model fits one file, else transformers' sharded form,
  ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json`` mapping each tensor to its
  file. Each file is written under a temporary name and renamed once all are written (N is known only
  then), so an interrupted export leaves no file that loads as part of a model.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Iterable

import torch

from megalite.checkpoint.tensor_file import write_tensor_file

SHARD_BYTES = 5 << 30          # a file is written once the parts gathered for it reach this size
HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
HF_PARTIAL = ".partial"        # suffix of an export's files until all of them are written


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_in_files(parts: Iterable[dict], write: Callable[[int, dict], None], prepare) -> int:
    """Feed ``parts`` (dicts of tensors), each passed through ``prepare``, to ``write(file number,
    tensors)`` in files of at least SHARD_BYTES (the last one may be smaller; a model with no tensors still
    gets one file). No reference to a part outlives the write of its file; returns the number of files."""
    batch, count = {}, 0
    for part in parts:
        batch.update(prepare(part))
        del part                # the next part is converted while only ``batch`` holds this one's tensors
        if tensor_bytes(batch) >= SHARD_BYTES:
            write(count, batch)
            batch, count = {}, count + 1
    if batch or not count:
        write(count, batch)
        count += 1
    return count


def megalite_file(number: int) -> str:
    return f"model-{number:05d}.safetensors"


def write_megalite_parts(directory: str, parts: Iterable[dict], prepare) -> dict[str, dict]:
    """A converted model's parts written into ``directory`` as megalite tensor files; returns the index
    records of every tensor, ``{name: {file, shape, dtype, crc32}}``."""
    index: dict[str, dict] = {}
    write_in_files(parts, lambda n, tensors: index.update(write_tensor_file(directory, megalite_file(n), tensors)),
                   prepare)
    return index


def write_hf_parts(directory: str, parts: Iterable[dict], prepare) -> list[str]:
    """A converted model's parts written into ``directory`` as Hugging Face safetensors files (one, or
    shards with their index); returns the file names written. On an error the partial files are removed."""
    from safetensors.torch import save_file
    weight_map: dict[str, int] = {}
    sizes: list[int] = []               # each file's tensor bytes (the index's total_size)

    def write(number: int, tensors: dict) -> None:
        weight_map.update(dict.fromkeys(tensors, number))
        sizes.append(tensor_bytes(tensors))
        save_file({n: t.contiguous() for n, t in tensors.items()}, _partial(directory, number),
                  metadata={"format": "pt"})

    count = 0
    try:
        count = write_in_files(parts, write, prepare)
    except BaseException:
        for number in range(max(weight_map.values(), default=-1) + 1):
            if os.path.exists(_partial(directory, number)):
                os.remove(_partial(directory, number))
        raise
    names = [HF_SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    for number, name in enumerate(names):
        os.replace(_partial(directory, number), os.path.join(directory, name))
    if count > 1:
        index = {"metadata": {"total_size": sum(sizes)},
                 "weight_map": {n: names[number] for n, number in sorted(weight_map.items())}}
        tmp = os.path.join(directory, HF_INDEX + HF_PARTIAL)
        with open(tmp, "w") as f:
            json.dump(index, f, indent=2)
        os.replace(tmp, os.path.join(directory, HF_INDEX))
        names.append(HF_INDEX)
    return names


def _partial(directory: str, number: int) -> str:
    return os.path.join(directory, f"model-{number:05d}.safetensors{HF_PARTIAL}")
