"""The tensors of a Hugging Face model directory, read on demand and only as tensors.

Sources, in order: model.safetensors, model.safetensors.index.json (shards), pytorch_model.bin(.index.json).
Block-scaled FP8 weights are dequantised as they are read (hf_fp8.py).
A .bin is read with torch.load(weights_only=True), which unpickles tensors only; a file that holds other
pickled objects is refused rather than trusted.
"""
from __future__ import annotations

import json
import os
import re
import warnings

import torch

from megalite.checkpoint.hf_config import first_line
from megalite.checkpoint.hf_fp8 import FP8_DTYPES, dequantize, scale_name
from megalite.errors import UserError

# Buffers some checkpoints contain that are not parameters: Llama RoPE tables (inv_freq), GPT-2's causal mask.
IGNORED_HF_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$|(^|\.)attn\.(bias|masked_bias)$")


class HFWeights:
    """The tensors of a Hugging Face model directory by name, read on demand.

    Sources, in order: model.safetensors, model.safetensors.index.json (shards), pytorch_model.bin(.index.json)
    (torch.load with weights_only=True, which unpickles tensors only). Checkpoints saved from the base
    model (GPT-2 on the hub: "h.0.attn..." instead of "transformer.h.0.attn...") get ``base_prefix``
    added. ``take`` marks a tensor used; ``check_all_used`` then refuses any tensor the converter does
    not know, rather than silently dropping part of a model.
    """

    def __init__(self, hf_dir: str, base_prefix: str, fp8_block: tuple[int, int] | None = None,
                 dtype: torch.dtype = torch.bfloat16):
        self.hf_dir = hf_dir
        self.fp8_block, self.dtype = fp8_block, dtype      # FP8 weights are dequantised into dtype (hf_fp8.py)
        self._where: dict[str, tuple[str, str]] = {}      # canonical name -> (file, stored name)
        self._handles: dict[str, object] = {}
        self._bins: dict[str, dict] = {}
        for path, names in self._files():
            for name in names:
                self._where[name] = (path, name)
        if self._where and not any(n.startswith(base_prefix) for n in self._where):
            self._where = {(n if n.startswith("lm_head.") else base_prefix + n): w for n, w in self._where.items()}
        self.unused = set(self._where)

    def _files(self):
        d = self.hf_dir
        single, index = os.path.join(d, "model.safetensors"), os.path.join(d, "model.safetensors.index.json")
        bin_single, bin_index = os.path.join(d, "pytorch_model.bin"), os.path.join(d, "pytorch_model.bin.index.json")
        if os.path.isfile(single):
            return [(single, self._safetensors(single).keys())]
        if os.path.isfile(index) or os.path.isfile(bin_index):
            path = index if os.path.isfile(index) else bin_index
            try:
                with open(path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise UserError(f"{path} is not a valid weight index ({first_line(e)})") from None
            files: dict[str, list[str]] = {}
            for name, file in weight_map.items():
                files.setdefault(os.path.join(d, file), []).append(name)
            for file in files:
                if not os.path.isfile(file):
                    raise UserError(f"{path} names {os.path.basename(file)}, which is missing; download the whole model")
            return list(files.items())
        if os.path.isfile(bin_single):
            return [(bin_single, list(self._bin(bin_single)))]
        raise UserError(f"--input {d} has no weights (model.safetensors, model.safetensors.index.json or "
                        "pytorch_model.bin)")

    def _safetensors(self, path: str):
        from safetensors import SafetensorError, safe_open
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(path, framework="pt", device="cpu")
            except (SafetensorError, OSError, ValueError) as e:
                raise UserError(f"{path} cannot be read as safetensors ({first_line(e)})") from None
        return self._handles[path]

    def _bin(self, path: str) -> dict:
        if path not in self._bins:
            try:
                with warnings.catch_warnings():      # torch warns about old pickle protocols on stderr
                    warnings.simplefilter("ignore")
                    self._bins[path] = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:      # pickle, zip and unpickler errors come in many types
                text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
                found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
                why = (f"it holds pickled objects, not only tensors ({found.group(1).strip()[:120]})" if found
                       else first_line(Exception(text)))
                raise UserError(f"{path} cannot be read with torch.load(weights_only=True): {why}; refusing it (never "
                                "load it with weights_only=False unless you trust its source), or use the model's "
                                "safetensors files") from None
        return self._bins[path]

    def names(self) -> list[str]:
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def take(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise UserError(f"--input {self.hf_dir} has no tensor {name!r}; the weights do not match config.json")
        self.unused.discard(name)
        path, stored = self._where[name]
        tensor = self._safetensors(path).get_tensor(stored) if path.endswith(".safetensors") else self._bin(path)[stored]
        if tensor.dtype in FP8_DTYPES:
            scale = self.take(scale_name(name)) if self.has(scale_name(name)) else None
            tensor = dequantize(tensor, scale, self.fp8_block, name, self.dtype)
        return tensor

    def check_all_used(self) -> None:
        unknown = sorted(n for n in self.unused if not IGNORED_HF_TENSORS.search(n))
        if unknown:
            more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
            raise UserError(f"--input {self.hf_dir} has tensors this converter does not know ({', '.join(unknown[:3])}"
                            f"{more}); the model is not a plain variant of its model_type")
