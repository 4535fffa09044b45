"""megalite's checkpoint directory: safetensors files of full tensors by global name, plus metadata.

    SAVE_DIR/
      latest_checkpointed_iteration.txt      "10"  (Megatron's tracker file, replaced atomically)
      iter_0000010/
        metadata.json                        iteration, model config, run arguments, train state,
                                             scheduler, loss scaler, and the tensor index
        model-pp000.safetensors              weights of pipeline stage 0, full (unsharded) tensors
        optimizer-pp000.safetensors          fp32 master weights and Adam moments, same names
        rng-rank00000.safetensors            each rank's generator states (same-layout resume)

Tensors are stored under their global names and full shapes, the vocabulary trimmed to the
tokenizer's true size, so the checkpoint does not depend on the layout that wrote it. Nothing is
pickled: tensors go through safetensors and everything else through JSON, so loading never runs code.

The tensor index in metadata.json records each tensor's file, shape, dtype and CRC-32, so a missing,
truncated, corrupt or mismatched tensor is reported by name. A save is written to ``iter_N.tmp`` and
published by renaming it to ``iter_N`` once every rank has finished; the tracker file is replaced
last. A crash mid-save therefore leaves the previous checkpoint as the latest one.
"""
from __future__ import annotations

import json
import os
import shutil
import zlib

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megalite.errors import UserError

FORMAT = "megalite-checkpoint"
VERSION = 1
TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
               torch.uint8: "U8", torch.int32: "I32"}


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def temporary_dir(root: str, iteration: int) -> str:
    return iteration_dir(root, iteration) + ".tmp"


def crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes (any dtype, via a uint8 view)."""
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(data)


# ---- writing -------------------------------------------------------------------------------------
def write_tensor_file(directory: str, filename: str, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Write ``tensors`` to directory/filename; returns their entries for the tensor index."""
    tensors = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    path = os.path.join(directory, filename)
    save_file(tensors, path)
    _fsync(path)
    return {name: {"file": filename, "shape": list(t.shape), "dtype": DTYPE_NAMES[t.dtype], "crc32": crc32(t)}
            for name, t in tensors.items()}


def write_metadata(directory: str, metadata: dict) -> None:
    metadata = {"format": FORMAT, "version": VERSION, **metadata}
    files = {e["file"] for e in metadata.get("tensors", {}).values()} | set(metadata.get("rng_files", {}))
    metadata["files"] = {name: os.path.getsize(os.path.join(directory, name)) for name in sorted(files)}
    path = os.path.join(directory, METADATA)
    with open(path, "w") as f:
        json.dump(metadata, f, indent=1, sort_keys=True)
    _fsync(path)


def check_writable(root: str) -> None:
    """--save must be a directory we can write, known before any training time is spent."""
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".writable-{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise UserError(f"--save {root}: cannot write there ({e.strerror}); choose a writable directory") from None


def prepare_temporary_dir(root: str, iteration: int) -> str:
    """A fresh, empty iter_N.tmp under ``root``; leftovers of saves that were killed are removed."""
    check_writable(root)
    try:
        for name in os.listdir(root):
            if name.startswith("iter_") and name.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        tmp = temporary_dir(root, iteration)
        os.makedirs(tmp)
    except OSError as e:
        raise UserError(f"--save {root}: cannot write there ({e.strerror}); choose a writable directory") from None
    return tmp


def publish(root: str, iteration: int) -> str:
    """Rename iter_N.tmp to iter_N, then atomically point the tracker file at N."""
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
    """Reads one iter_N directory: metadata plus tensors by global name, each checked against the index."""

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
        if self.metadata.get("version", 0) > VERSION:
            raise UserError(f"checkpoint {meta_path} has format version {self.metadata['version']}, newer than this "
                            f"megalite ({VERSION}); upgrade megalite")
        self.index: dict[str, dict] = self.metadata.get("tensors", {})
        self._check_file_sizes()
        self._open: dict[str, object] = {}

    @property
    def iteration(self) -> int:
        return int(self.metadata["iteration"])

    def _check_file_sizes(self) -> None:
        files = self.metadata.get("files", {})
        named = {e.get("file") for e in self.index.values()} | set(self.metadata.get("rng_files", {})) | set(files)
        for name in named:     # a crafted metadata.json must not make us read files outside the checkpoint
            if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
                raise UserError(f"checkpoint {self.directory}/{METADATA} names the file {name!r} outside the "
                                "checkpoint directory; refusing to read it")
        for name, size in files.items():
            path = os.path.join(self.directory, name)
            if not os.path.isfile(path):
                raise UserError(f"checkpoint file {path} is missing; the checkpoint is incomplete, load an earlier one")
            actual = os.path.getsize(path)
            if actual != size:
                raise UserError(f"checkpoint file {path} is truncated or altered ({actual} bytes, {size} written); "
                                "load an earlier checkpoint")

    def has(self, name: str) -> bool:
        return name in self.index

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self.index if n.startswith(prefix)]

    def shape(self, name: str) -> tuple:
        return tuple(self._entry(name)["shape"])

    def _entry(self, name: str) -> dict:
        if name not in self.index:
            raise UserError(f"checkpoint {self.directory} has no tensor {name!r}; it was saved from a different "
                            "model (compare its metadata.json with your model flags, or use --use-checkpoint-args)")
        return self.index[name]

    def tensor(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` (CPU), verified against its recorded shape and CRC-32."""
        return self._read(name, self._entry(name))

    def rng_tensors(self, filename: str) -> dict[str, torch.Tensor] | None:
        """One rank's generator states, or None when the checkpoint has none for that file."""
        entries = self.metadata.get("rng_files", {}).get(filename)
        if entries is None:
            return None
        return {name: self._read(name, entry) for name, entry in entries.items()}

    def _read(self, name: str, entry: dict) -> torch.Tensor:
        path = os.path.join(self.directory, entry["file"])
        try:
            handle = self._open.get(path)
            if handle is None:
                handle = self._open[path] = safe_open(path, framework="pt", device="cpu")
            t = handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise UserError(f"checkpoint tensor {name!r} in {path} cannot be read ({str(e).splitlines()[0]}); "
                            "the file is corrupt, load an earlier checkpoint") from None
        if list(t.shape) != list(entry["shape"]) or crc32(t) != entry["crc32"]:
            raise UserError(f"checkpoint tensor {name!r} in {path} is corrupt (checksum mismatch); "
                            "load an earlier checkpoint")
        return t


# ---- the model's description ---------------------------------------------------------------------
# ModelConfig fields that define the architecture (and so the tensors); recorded in metadata["model"]
# and taken back by --use-checkpoint-args, load_model and the Hugging Face exporter.
ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
                       "num_query_groups", "seq_length", "max_position_embeddings", "vocab_size",
                       "position_embedding_type", "rotary_base", "normalization", "norm_epsilon", "swiglu",
                       "openai_gelu", "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights")


def model_metadata(config) -> dict:
    """metadata["model"] for a ModelConfig: its architecture fields plus the weights' dtype."""
    return {**{name: getattr(config, name) for name in ARCHITECTURE_FIELDS}, "params_dtype": config.params_dtype}


def model_config_from_metadata(model: dict, make_vocab_size_divisible_by: int = 128, tensor_parallel_size: int = 1,
                               **overrides):
    """A ModelConfig for metadata["model"] (dropout off by default: inference and conversion)."""
    from megalite.arguments import padded_vocab_size
    from megalite.config import ModelConfig
    fields = {name: model[name] for name in ARCHITECTURE_FIELDS}
    fields.update(attention_dropout=0.0, hidden_dropout=0.0, params_dtype=model.get("params_dtype", "float32"))
    fields.update(overrides)
    fields["padded_vocab_size"] = padded_vocab_size(fields["vocab_size"], make_vocab_size_divisible_by,
                                                    tensor_parallel_size)
    return ModelConfig(**fields)


def tokenizer_metadata(data_config, base_dir: str | None = None) -> dict | None:
    """metadata["tokenizer"]: how to rebuild the run's tokenizer (paths absolute, or relative to the
    iteration directory when a converter copied the files into it)."""
    if data_config.tokenizer_type is None:
        return None
    absolute = lambda p: os.path.abspath(p) if p else None     # noqa: E731
    return {"tokenizer_type": data_config.tokenizer_type, "tokenizer_model": absolute(data_config.tokenizer_model),
            "vocab_file": absolute(data_config.vocab_file), "merge_file": absolute(data_config.merge_file),
            "vocab_size": data_config.vocab_size}
