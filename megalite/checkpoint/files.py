"""megalite's checkpoint directory: safetensors files, metadata.json and an index of every tensor.

    SAVE_DIR/
      latest_checkpointed_iteration.txt      "10"  (Megatron's tracker file, replaced atomically)
      iter_0000010/
        metadata.json                        iteration, model config, run arguments, train state,
                                             scheduler, loss scaler, how the index is sharded
        index-rank00000.json                 one shard of the tensor index per rank (index.py)
        model-pp000[-tp001][-dp00002].safetensors       the parts of the weights one rank owns
        optimizer-pp000[-tp001][-dp00002].safetensors   its parts of the fp32 master weights and Adam moments
        rng-rank00000.safetensors            each rank's generator states (same-layout resume)

Every tensor has a global name and its full shape (the vocabulary trimmed to the tokenizer's true
size), so the checkpoint does not depend on the layout that wrote it. A training save is written in
shards: each rank writes the parts it owns (sharded.py), and the index says where each part of each
tensor is. A single writer (tools/convert_checkpoint.py, ``write_checkpoint``) puts the whole index in
metadata.json, with the sizes of the files ("files") and the RNG files' records ("rng_files"); a
training save shards it over index files (index.py), whose entries have the same form:

    "tensors": {"decoder.layers.0.mlp.linear_fc1.weight": {"shape": [352, 64], "dtype": "F32",
                 "pieces": [{"file": "model-pp000-tp000.safetensors", "key": "...weight[0:176,0:64]",
                             "box": [[0, 176], [0, 64]], "crc32": 1234}, ...]}, ...}

A piece is a rectangle ("box": rows [r0, r1) x columns [c0, c1)) of the tensor viewed 2-D as
[shape[0], rest], stored 2-D under ``key``; a piece covering the whole tensor is stored under the
tensor's own name and shape. A single writer's entry may be one whole tensor instead:
``{"file", "shape", "dtype", "crc32"}`` (tools/convert_checkpoint.py writes these; so are RNG records).

Nothing is pickled: tensors go through safetensors and everything else through JSON, so loading never
runs code. Reading streams each piece in bounded row blocks, checks its CRC-32 and copies only the
parts the caller asks for (``read_into``). A missing, truncated, corrupt or mismatched tensor is
reported by name. A save is written to ``iter_N.tmp`` and published by renaming it to ``iter_N``
once every rank has finished; the tracker file is replaced last. A crash mid-save therefore leaves
the previous checkpoint as the latest one.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import zlib

import torch

from megalite.checkpoint.index import IndexShards, as_2d, check_filename, checked_entries, files_of
from megalite.checkpoint.tensor_file import (STAGING_BYTES, TORCH_DTYPES, StoredTensor, as_bytes,
                                             read_safetensors_header, write_tensor_file)
from megalite.config.deepseek_fields import DeepSeekFields
from megalite.config.model_variants import ModelVariantFields
from megalite.config.schema import DataConfig, ModelConfig, padded_vocab_size
from megalite.errors import UserError
from megalite.parallel.launch_env import finish_before_exit

FORMAT = "megalite-checkpoint"
VERSION = 4                  # the format this megalite writes and reads; metadata.json records it
TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
Box = tuple[int, int, int, int]   # rows [r0, r1) x columns [c0, c1) of a tensor viewed 2-D


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def temporary_dir(root: str, iteration: int) -> str:
    return iteration_dir(root, iteration) + ".tmp"


# ---- writing -------------------------------------------------------------------------------------
def write_metadata(directory: str, metadata: dict) -> None:
    metadata = {"format": FORMAT, "version": VERSION, **metadata}
    files = files_of(metadata.get("tensors", {})) | set(metadata.get("rng_files", {}))
    metadata["files"] = {name: os.path.getsize(os.path.join(directory, name)) for name in sorted(files)}
    path = os.path.join(directory, METADATA)
    with open(path, "w") as f:
        json.dump(metadata, f, indent=1, sort_keys=True)
    _fsync(path)


def check_writable(root: str, flag: str = "--save") -> None:
    """--save (or ``flag``) must be a directory we can write, known before any training time is spent."""
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".writable-{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise UserError(f"{flag} {root}: cannot write there ({e.strerror}); choose a writable directory") from None


def remove_leftovers(root: str, flag: str = "--save") -> None:
    """Remove the iter_N.tmp directories of saves that were killed."""
    check_writable(root, flag)
    try:
        for name in os.listdir(root):
            if name.startswith("iter_") and name.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    except OSError as e:
        raise UserError(f"{flag} {root}: cannot write there ({e.strerror}); choose a writable directory") from None


def prepare_temporary_dir(root: str, iteration: int, flag: str = "--save", exist_ok: bool = False) -> str:
    """A fresh, empty iter_N.tmp under ``root`` (``exist_ok``: or the one another rank just made);
    leftovers of saves that were killed are removed first, unless ``exist_ok`` (then already done)."""
    if not exist_ok:
        remove_leftovers(root, flag)
    tmp = temporary_dir(root, iteration)
    try:
        os.makedirs(tmp, exist_ok=exist_ok)
    except OSError as e:
        raise UserError(f"{flag} {root}: cannot write there ({e.strerror}); choose a writable directory") from None
    return tmp


def published_iterations(root: str) -> list[int]:
    """The iterations of the complete (published) iter_N directories under ``root``, ascending."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(n[5:]) for n in names if n.startswith("iter_") and n[5:].isdigit()
                  and os.path.isfile(os.path.join(root, n, METADATA)))


def prune(root: str, keep: int) -> None:
    """Remove all but the newest ``keep`` published checkpoints under ``root`` (non-persistent ones)."""
    for iteration in published_iterations(root)[:-keep]:
        shutil.rmtree(iteration_dir(root, iteration), ignore_errors=True)


def publish(root: str, iteration: int) -> str:
    """Rename iter_N.tmp to iter_N, then atomically point the tracker file at N; a rank whose launcher
    dies meanwhile finishes this first (launch_env.finish_before_exit)."""
    with finish_before_exit():
        return _publish(root, iteration)


def _publish(root: str, iteration: int) -> str:
    tmp, final = temporary_dir(root, iteration), iteration_dir(root, iteration)
    if os.path.exists(final):          # saving the same iteration again (e.g. after a resume)
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    tracker_tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tracker_tmp, "w") as f:
        f.write(str(iteration))
    _fsync(tracker_tmp)
    os.replace(tracker_tmp, os.path.join(root, TRACKER))
    _fsync_dir(root)
    return final


def write_checkpoint(root: str, iteration: int, files: dict[str, dict[str, torch.Tensor]], metadata: dict) -> str:
    """Single-process save (conversion tools): {filename: tensors} plus metadata, published atomically."""
    tmp = prepare_temporary_dir(root, iteration)
    index = {}
    for filename, tensors in files.items():
        index.update(write_tensor_file(tmp, filename, tensors))
    write_metadata(tmp, {**metadata, "iteration": iteration, "tensors": index})
    return publish(root, iteration)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        _fsync(path)
    except OSError:      # some filesystems cannot fsync a directory; the rename is still atomic
        pass


# ---- reading -------------------------------------------------------------------------------------
def resolve_checkpoint_dir(path: str) -> str:
    """``path`` is a save directory (its tracker names the iteration) or an iter_N directory itself."""
    if os.path.isfile(os.path.join(path, METADATA)):
        return path
    tracker = os.path.join(path, TRACKER)
    if not os.path.isdir(path):
        raise UserError(f"--load {path}: no such directory; give a directory written by --save or "
                        "tools/convert_checkpoint.py")
    if not os.path.isfile(tracker):
        raise UserError(f"--load {path}: no {TRACKER} and no {METADATA} there; is it a megalite checkpoint "
                        "directory? (tools/convert_checkpoint.py converts Hugging Face models)")
    text = open(tracker).read().strip()
    if not text.isdigit():
        raise UserError(f"--load {path}: {TRACKER} holds {text[:40]!r}, not an iteration number; "
                        "write the iteration of a complete iter_N directory into it")
    directory = iteration_dir(path, int(text))
    if not os.path.isfile(os.path.join(directory, METADATA)):
        raise UserError(f"--load {path}: {TRACKER} names iteration {text} but {directory} has no {METADATA}; "
                        "the checkpoint is incomplete, point the tracker at an earlier iter_N")
    return directory


class CheckpointReader:
    """Reads one iter_N directory: metadata, and tensors by global name (whole, or only the parts a
    rank holds), each stored piece checked against the index.

    The index is the whole one in metadata.json (single-writer checkpoints: conversion tools), or a
    training save's sharded one (index.py), of which only the files holding the tensors
    asked for are read. A data file's size is checked against the index before it is first read (a
    whole index's files all at once)."""

    def __init__(self, path: str):
        self.directory = resolve_checkpoint_dir(path)
        meta_path = os.path.join(self.directory, METADATA)
        try:
            with open(meta_path) as f:
                self.metadata = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"checkpoint {meta_path} is corrupt ({e}); load an earlier checkpoint") from None
        if self.metadata.get("format") != FORMAT:
            raise UserError(f"checkpoint {meta_path} is not a megalite checkpoint (format "
                            f"{self.metadata.get('format')!r}); convert it with tools/convert_checkpoint.py")
        version = self.metadata.get("version")
        if version != VERSION:
            raise UserError(f"checkpoint {meta_path} has format version {version}, this megalite reads version "
                            f"{VERSION}; " + ("upgrade megalite" if isinstance(version, int) and version > VERSION
                                              else "save it again with the megalite that wrote it"))
        self._open: dict[str, object] = {}
        self.shards = None
        if "index" in self.metadata:
            self.shards = IndexShards(self.directory, self.metadata["index"], TORCH_DTYPES)
            self.sizes = self.shards.sizes
            return
        self.index = checked_entries(self.metadata.get("tensors", {}), meta_path, TORCH_DTYPES)
        self.rng_index = {filename: checked_entries(entries, meta_path, TORCH_DTYPES)
                          for filename, entries in self.metadata.get("rng_files", {}).items()}
        self.sizes = self.metadata.get("files", {})
        self._check_file_sizes()

    @property
    def iteration(self) -> int:
        return int(self.metadata["iteration"])

    def _check_file_sizes(self) -> None:
        named = files_of(self.index) | set(self.rng_index) | set(self.sizes)
        for entries in self.rng_index.values():
            named |= files_of(entries)
        for name in named:
            check_filename(self.directory, METADATA, name)
        for name in self.sizes:
            self._check_size(name)

    def _check_size(self, name: str) -> None:
        path = os.path.join(self.directory, name)
        if not os.path.isfile(path):
            raise UserError(f"checkpoint file {path} is missing; the checkpoint is incomplete, load an earlier one")
        actual, size = os.path.getsize(path), self.sizes[name]
        if actual != size:
            raise UserError(f"checkpoint file {path} is truncated or altered ({actual} bytes, {size} written); "
                            "load an earlier checkpoint")

    def all_entries(self) -> dict[str, dict]:
        """{name: {shape, dtype, pieces}} of every tensor; of a sharded index, every index file is read
        (single-process tools and tests)."""
        return self.shards.everything() if self.shards else self.index

    def has(self, name: str) -> bool:
        return (self.shards.header(name) if self.shards else self.index.get(name)) is not None

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self.all_entries() if n.startswith(prefix)]

    def shape(self, name: str) -> tuple:
        return tuple(self._entry(name)["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return TORCH_DTYPES[self._entry(name)["dtype"]]

    def _entry(self, name: str) -> dict:
        """The tensor's entry: of a sharded index, its header (the shape and dtype, no pieces)."""
        entry = self.shards.header(name) if self.shards else self.index.get(name)
        if entry is None:
            raise UserError(f"checkpoint {self.directory} has no tensor {name!r}; it was saved from a different "
                            "model (compare its metadata.json with your model flags, or use --use-checkpoint-args)")
        return entry

    def _pieces(self, name: str, row_ranges) -> list[dict]:
        """The stored pieces of tensor ``name`` that may touch rows ``row_ranges``."""
        entry = self._entry(name)
        return self.shards.pieces(name, row_ranges) if self.shards else entry["pieces"]

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (CPU), assembled from its pieces (single-process consumers)."""
        entry = self._entry(name)
        rows, cols = as_2d(entry["shape"])
        out = torch.empty(rows, cols, dtype=TORCH_DTYPES[entry["dtype"]])
        self._fill(name, self._pieces(name, [(0, rows)]), [((0, rows, 0, cols), out)])
        return out.view(entry["shape"])

    def rng_tensors(self, filename: str) -> dict[str, torch.Tensor] | None:
        """One rank's generator states, or None when the checkpoint has none for that file."""
        entries = self.shards.rng(filename) if self.shards else self.rng_index.get(filename)
        if entries is None:
            return None
        out = {}
        for name, entry in entries.items():
            rows, cols = as_2d(entry["shape"])
            out[name] = torch.empty(rows, cols, dtype=TORCH_DTYPES[entry["dtype"]])
            self._fill(name, entry["pieces"], [((0, rows, 0, cols), out[name])])
            out[name] = out[name].view(entry["shape"])
        return out

    def read_into(self, targets: list[tuple[str, Box, torch.Tensor]]) -> None:
        """For each target (name, box, out) copy the elements in ``box`` of the stored tensor ``name``
        (viewed 2-D) into ``out``, a [r1 - r0, c1 - c0] tensor on any device, in any dtype. Only the
        stored pieces that intersect some target are read, each once."""
        wanted: dict[str, list] = {}
        for name, box, out in targets:
            wanted.setdefault(name, []).append((box, out))
        for name, boxes in wanted.items():
            self._fill(name, self._pieces(name, [(b[0], b[1]) for b, _ in boxes]), boxes)

    def _fill(self, name: str, pieces: list[dict], wanted: list[tuple[Box, torch.Tensor]]) -> None:
        copied = [0] * len(wanted)
        for piece in pieces:
            (r0, r1), (c0, c1) = piece["box"]
            hits = [i for i, ((a0, a1, b0, b1), _) in enumerate(wanted) if r0 < a1 and a0 < r1 and c0 < b1 and b0 < c1]
            if hits:
                counts = self._read_piece(name, piece, [wanted[i] for i in hits])
                for i, n in zip(hits, counts):
                    copied[i] += n
        for ((r0, r1, c0, c1), _), n in zip(wanted, copied):
            if n < (r1 - r0) * (c1 - c0):
                raise UserError(f"checkpoint {self.directory} has no data for part of tensor {name!r} (rows {r0}-{r1}, "
                                f"columns {c0}-{c1}); the checkpoint is incomplete, load an earlier one")

    def _read_piece(self, name: str, piece: dict, wanted: list[tuple[Box, torch.Tensor]]) -> list[int]:
        """Stream one stored piece in row blocks of at most STAGING_BYTES, copying the parts inside
        ``wanted`` as they pass, and check its CRC-32 once all of it has been read. Returns the number
        of elements copied into each target."""
        (r0, r1), (c0, c1) = piece["box"]
        rows, cols = r1 - r0, c1 - c0
        path = os.path.join(self.directory, piece["file"])
        try:
            stored = self._stored(path, piece["key"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise self._unreadable(name, path, e) from None
        shape, dtype = stored.shape, stored.dtype
        if not shape or shape[0] != rows or math.prod(shape) != rows * cols:
            raise self._corrupt(name, path)
        copied, crc = [0] * len(wanted), 0
        step = max(1, STAGING_BYTES // (cols * dtype.itemsize))
        for a in range(r0, r1, step):
            b = min(a + step, r1)
            try:
                block = stored.rows(a - r0, b - r0)
            except (OSError, RuntimeError, ValueError) as e:
                raise self._unreadable(name, path, e) from None
            crc = zlib.crc32(as_bytes(block), crc)
            block = block.reshape(b - a, cols)
            for i, ((t0, t1, u0, u1), out) in enumerate(wanted):
                lo, hi, left, right = max(a, t0), min(b, t1), max(c0, u0), min(c1, u1)
                if lo < hi and left < right:
                    out[lo - t0:hi - t0, left - u0:right - u0].copy_(block[lo - a:hi - a, left - c0:right - c0])
                    copied[i] += (hi - lo) * (right - left)
        if crc != piece["crc32"]:
            raise self._corrupt(name, path)
        return copied

    def _stored(self, path: str, key: str) -> "StoredTensor":
        if path not in self._open:
            if self.shards:
                self._check_size(os.path.basename(path))
            self._open[path] = read_safetensors_header(path)
        return StoredTensor(path, *self._open[path][key])

    @staticmethod
    def _unreadable(name: str, path: str, error: Exception) -> UserError:
        return UserError(f"checkpoint tensor {name!r} in {path} cannot be read ({str(error).splitlines()[0]}); "
                         "the file is corrupt, load an earlier checkpoint")

    @staticmethod
    def _corrupt(name: str, path: str) -> UserError:
        return UserError(f"checkpoint tensor {name!r} in {path} is corrupt (checksum mismatch); "
                         "load an earlier checkpoint")


# ---- the model's description ---------------------------------------------------------------------
# ModelConfig fields that define the architecture (and so the tensors); recorded in metadata["model"]
# and taken back by --use-checkpoint-args, load_model and the Hugging Face exporter.
# the MoE fields that shape the weights or the forward; a dense model's metadata lacks them
MOE_DEFAULTS = {"num_experts": None, "moe_layer_freq": 1, "moe_ffn_hidden_size": None,
                "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False, "moe_router_topk": 2,
                "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
                "moe_router_topk_scaling_factor": None, "moe_router_enable_expert_bias": False}
MOE_FIELDS = tuple(MOE_DEFAULTS)
# the attention's shape (ModelConfig: --window-size, --window-attn-skip-freq, --softmax-type)
ATTENTION_DEFAULTS = {"window_size": None, "window_attn_skip_freq": None, "softmax_type": "vanilla"}
# YaRN and the quick GEGLU (config/model_variants.py), at their defaults in a model without them
VARIANT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelVariantFields)}
# multi-latent attention, multi-token prediction and group-limited routing (config/deepseek_fields.py), at
# their defaults in a model without them; the MTP loss weight is a training setting, not the architecture's
DEEPSEEK_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DeepSeekFields)
                     if f.name != "mtp_loss_scaling_factor"}
ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
                       "num_query_groups", "seq_length", "max_position_embeddings", "vocab_size",
                       "position_embedding_type", "rotary_base", "normalization", "norm_epsilon", "swiglu",
                       "openai_gelu", "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights",
                       "rotary_percent", "apply_layernorm_1p", "qk_layernorm", *MOE_FIELDS, *ATTENTION_DEFAULTS,
                       *VARIANT_DEFAULTS, *DEEPSEEK_DEFAULTS)
# values for metadata that lacks these fields (the model they describe has none of the feature)
ARCHITECTURE_DEFAULTS = {"rotary_percent": 1.0, "apply_layernorm_1p": False, "qk_layernorm": False, **MOE_DEFAULTS,
                         **ATTENTION_DEFAULTS, **VARIANT_DEFAULTS, **DEEPSEEK_DEFAULTS}


def with_architecture_defaults(model: dict) -> dict:
    """metadata["model"] with the fields it lacks filled in (ARCHITECTURE_DEFAULTS)."""
    return {**ARCHITECTURE_DEFAULTS, **model}


def model_metadata(config: ModelConfig) -> dict:
    """metadata["model"] for a ModelConfig: its architecture fields plus the weights' dtype."""
    fields = dataclasses.asdict(config)
    return {**{name: fields[name] for name in ARCHITECTURE_FIELDS}, "params_dtype": config.params_dtype}


def model_config_from_metadata(model: dict, make_vocab_size_divisible_by: int = 128, tensor_parallel_size: int = 1,
                               **overrides):
    """A ModelConfig for metadata["model"] (dropout off by default: inference and conversion)."""
    model = with_architecture_defaults(model)
    fields = {name: model[name] for name in ARCHITECTURE_FIELDS}
    fields.update(attention_dropout=0.0, hidden_dropout=0.0, params_dtype=model.get("params_dtype", "float32"))
    fields.update(overrides)
    fields["padded_vocab_size"] = padded_vocab_size(fields["vocab_size"], make_vocab_size_divisible_by,
                                                    tensor_parallel_size)
    return ModelConfig(**fields)


def tokenizer_metadata(data_config: DataConfig) -> dict | None:
    """metadata["tokenizer"]: how to rebuild the run's tokenizer, its paths absolute (a converted
    checkpoint's are relative to the iteration directory, which holds the copied files)."""
    if data_config.tokenizer_type is None:
        return None
    absolute = lambda p: os.path.abspath(p) if p else None     # noqa: E731
    return {"tokenizer_type": data_config.tokenizer_type, "tokenizer_model": absolute(data_config.tokenizer_model),
            "vocab_file": absolute(data_config.vocab_file), "merge_file": absolute(data_config.merge_file),
            "vocab_size": data_config.vocab_size}
