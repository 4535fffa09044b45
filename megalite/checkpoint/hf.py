"""Convert Hugging Face causal LMs to megalite checkpoints and back (Llama, Mistral, Qwen2, Phi-3, GPT-2).

    hf_to_megalite(HF_DIR, CKPT_DIR)       -> CKPT_DIR/iter_0000000 (+ tracker), tokenizer copied inside
    megalite_to_hf(CKPT_DIR, HF_DIR)       -> HF_DIR/config.json + model.safetensors (+ tokenizer files)

Both directions are exact: tensors are only renamed, transposed, concatenated or split, never cast
(except float64, which megalite does not store). What differs between the formats (REFERENCE §3-§4):

- Llama/Mistral/Qwen2 keep q, k, v as three nn.Linear weights; megalite fuses them into one
  ``linear_qkv`` whose rows are grouped per KV head g: [q heads of group g, k_g, v_g]. The grouping
  (not plain [q; k; v]) is what lets a tensor-parallel shard be a contiguous row block.
- SwiGLU: HF's gate_proj and up_proj become megalite's ``linear_fc1`` rows [gate ; up].
- GPT-2 uses Conv1D, whose weight is [in, out] (transposed vs nn.Linear), and its ``c_attn``
  concatenates q, k, v on the out dimension ([q; k; v], not grouped per head).
- HF Llama applies RoPE in the rotate-half convention, as megalite does, so q/k rows need no
  permutation (Meta's original checkpoints interleave and would; HF's already do not).
- Phi-3 is Llama with fused ``qkv_proj`` ([q; k; v], not grouped) and ``gate_up_proj`` ([gate; up], as
  megalite's fc1), and the one Llama-like family whose RoPE honours ``partial_rotary_factor``: it is
  where ``--rotary-percent`` < 1 maps (Llama's RoPE ignores the factor and rotates every dimension).
- ``--apply-layernorm-1p`` stores norm weights as gamma - 1; no HF family does, so the export folds
  the + 1 into the weights (exact: one rounding of the exact sum, as the norm itself computes it).

What megalite cannot represent is refused with one line (UserError) before anything is written: rope
scaling (rope_type other than "default"), Llama o_proj / MLP biases, other activations. A sliding
attention window is converted with a warning: megalite attention is full causal, which is exact for
sequences no longer than the window.
"""
from __future__ import annotations

import contextlib
import glob
import json
import warnings
import os
import re
import shutil
import sys

import torch

from megalite.checkpoint.files import (ARCHITECTURE_FIELDS, METADATA, TRACKER, CheckpointReader, prepare_temporary_dir,
                                       publish, with_architecture_defaults, write_metadata, write_tensor_file)
from megalite.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "phi3", "gpt2")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "gpt2": "GPT2LMHeadModel"}
MODEL_FILE = "model-00000.safetensors"          # the one tensor file of a converted megalite checkpoint
TOKENIZER_SUBDIR = "tokenizer"                  # inside the iteration directory
# Files a Hugging Face tokenizer may consist of; only these are copied (never the weights next to them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt",
                   "chat_template.jinja", "chat_template.json")
# Any one of these makes a loadable tokenizer (tokenizer_config.json alone does not).
TOKENIZER_CORE = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
# HF weight files a previous export may have left; removed by --overwrite so no stale shard is loaded.
HF_WEIGHT_PATTERNS = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
                      "pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Buffers some checkpoints contain that are not parameters: old Llama RoPE tables, GPT-2's causal mask.
IGNORED_HF_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$|(^|\.)attn\.(bias|masked_bias)$")


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _quiet_transformers():
    """transformers logs deprecation notes (e.g. ``torch_dtype``) on stderr; the tools' contract is one
    line on stderr for a mistake, so keep its logger at error level while we use it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")      # everything here is local; never reach for a hub
    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# ==================================================================================================
# Tensor layouts shared by the families
# ==================================================================================================
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nq: int, nkv: int, d: int) -> torch.Tensor:
    """Separate q [nq*d, ...], k, v [nkv*d, ...] (weights or biases) -> megalite's grouped linear_qkv:
    for each KV group g, the nq/nkv query heads of g, then k_g, then v_g (REFERENCE §3)."""
    rest = q.shape[1:]
    q = q.reshape(nkv, nq // nkv, d, *rest)
    k = k.reshape(nkv, 1, d, *rest)
    v = v.reshape(nkv, 1, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape((nq + 2 * nkv) * d, *rest)


def split_qkv(qkv: torch.Tensor, nq: int, nkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_qkv: megalite's grouped linear_qkv -> contiguous q, k, v."""
    rest = qkv.shape[1:]
    grouped = qkv.reshape(nkv, nq // nkv + 2, d, *rest)
    q, k, v = torch.split(grouped, [nq // nkv, 1, 1], dim=1)
    return (q.reshape(nq * d, *rest).contiguous(), k.reshape(nkv * d, *rest).contiguous(),
            v.reshape(nkv * d, *rest).contiguous())


def fuse_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """megalite computes silu(first half of fc1) * second half: rows [gate ; up]."""
    return torch.cat([gate, up], dim=0)


def split_swiglu(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def conv1d_to_linear(weight: torch.Tensor) -> torch.Tensor:
    """GPT-2's Conv1D stores [in, out] and computes x @ W; nn.Linear stores [out, in] (x @ W.T)."""
    return weight.t().contiguous()


linear_to_conv1d = conv1d_to_linear      # the transpose is its own inverse


# ==================================================================================================
# Reading a Hugging Face directory
# ==================================================================================================
def read_hf_config(hf_dir: str):
    """The directory's transformers config (local only, never remote code), for a supported family."""
    if not os.path.isdir(hf_dir):
        raise UserError(f"--input {hf_dir}: no such directory; give a Hugging Face model directory "
                        "(with config.json and model.safetensors)")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"--input {hf_dir} is not a Hugging Face model directory (no config.json there)")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"--input {path} is not valid JSON ({_first_line(e)})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"--input {hf_dir}: model_type {model_type!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    with _quiet_transformers():
        from transformers import AutoConfig
        try:
            return AutoConfig.from_pretrained(hf_dir, local_files_only=True, trust_remote_code=False)
        except Exception as e:      # transformers raises many types for a bad config; report the first line
            raise UserError(f"--input {path}: transformers cannot read it ({_first_line(e)})") from None


class HFWeights:
    """The tensors of a Hugging Face model directory by name, read on demand.

    Sources, in order: model.safetensors, model.safetensors.index.json (shards), pytorch_model.bin(.index.json)
    (torch.load with weights_only=True, which unpickles tensors only). Checkpoints saved from the base
    model (GPT-2 on the hub: "h.0.attn..." instead of "transformer.h.0.attn...") get ``base_prefix``
    added. ``take`` marks a tensor used; ``check_all_used`` then refuses any tensor the converter does
    not know, rather than silently dropping part of a model.
    """

    def __init__(self, hf_dir: str, base_prefix: str):
        self.hf_dir = hf_dir
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
                raise UserError(f"{path} is not a valid weight index ({_first_line(e)})") from None
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
                raise UserError(f"{path} cannot be read as safetensors ({_first_line(e)})") from None
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
                       else _first_line(Exception(text)))
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
        if path.endswith(".safetensors"):
            return self._safetensors(path).get_tensor(stored)
        return self._bin(path)[stored]

    def check_all_used(self) -> None:
        unknown = sorted(n for n in self.unused if not IGNORED_HF_TENSORS.search(n))
        if unknown:
            more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
            raise UserError(f"--input {self.hf_dir} has tensors this converter does not know ({', '.join(unknown[:3])}"
                            f"{more}); the model is not a plain variant of its model_type")


def _dtype_name(config) -> str | None:
    """HF config dtype (``dtype`` in transformers 5, ``torch_dtype`` before) as megalite's name."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if value is None:
        return None
    name = str(value).replace("torch.", "")
    return name if name in DTYPE_NAMES.values() else None


def rope_theta(config, partial_rotary: bool = False) -> float:
    """RoPE base from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling`` (4.x);
    scaled RoPE (llama3, yarn, linear, dynamic, ...) has no megalite equivalent and is refused, and so
    is ``partial_rotary_factor`` unless the family applies it (``partial_rotary``: see rotary_factor)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        distinct = {json.dumps(v, sort_keys=True) for v in params.values()}     # per-layer-type parameters
        if len(distinct) > 1:
            raise UserError(f"model has different RoPE parameters per layer type ({', '.join(params)}); "
                            "megalite has one RoPE for all layers")
        params = next(iter(params.values()))
    if not params:
        params = {"rope_type": "default", "rope_theta": getattr(config, "rope_theta", 10000.0)}
        scaling = getattr(config, "rope_scaling", None)
        if scaling:
            params.update(scaling)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise UserError(f"rope scaling rope_type={rope_type!r} is not supported: megalite implements plain RoPE "
                        "only (rope_type 'default')")
    if params.get("partial_rotary_factor", 1.0) != 1.0 and not partial_rotary:
        raise UserError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported for "
                        f"{config.model_type}: its RoPE ignores the factor (Phi-3 applies it)")
    return float(params.get("rope_theta", 10000.0))


def rotary_factor(config) -> float:
    """Phi-3's ``partial_rotary_factor`` (in ``rope_parameters`` in transformers 5, or top level)."""
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        params = next(iter(params.values()))
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return float(factor) if factor is not None else 1.0


def _sliding_window(config, model_type: str) -> int | None:
    """The attention window a Mistral/Qwen2 model actually applies, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    if model_type == "qwen2":
        layer_types = getattr(config, "layer_types", None) or []
        uses = getattr(config, "use_sliding_window", False) and (not layer_types or "sliding_attention" in layer_types)
        window = window if uses else None
    if window is None or window >= config.max_position_embeddings:
        return None
    return int(window)


# ==================================================================================================
# Configs: Hugging Face -> megalite metadata["model"]
# ==================================================================================================
def llama_like_model_config(config, model_type: str, log=_warn) -> dict:
    """Llama 1/2/3, Mistral, Qwen2 and Phi-3: RoPE, RMSNorm, SwiGLU, GQA; Qwen2 adds q/k/v biases, Phi-3
    partial rotary."""
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UserError(f"hidden_act={config.hidden_act!r} is not supported: megalite's SwiGLU uses silu")
    if getattr(config, "attention_bias", False):
        raise UserError(f"{model_type} attention_bias=True is not supported: megalite has q/k/v biases "
                        "(add_qkv_bias) but no o_proj bias without MLP biases")
    if getattr(config, "mlp_bias", False):
        raise UserError(f"{model_type} mlp_bias=True is not supported: megalite's MLP biases come only with "
                        "biases on every linear layer")
    nq = config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nq
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // nq
    theta = rope_theta(config, partial_rotary=model_type == "phi3")
    factor = rotary_factor(config) if model_type == "phi3" else 1.0
    if factor != 1.0 and (int(head_dim * factor) % 2 or int(head_dim * factor) < 2):
        raise UserError(f"partial_rotary_factor={factor} rotates {int(head_dim * factor)} of {head_dim} head dimensions; "
                        "megalite needs an even number >= 2")
    window = _sliding_window(config, model_type)
    if window is not None:
        log(f"{model_type} sliding_window={window} < max_position_embeddings={config.max_position_embeddings}: "
            f"megalite attention is full causal, exact only for sequences of up to {window} tokens")
    return {
        "num_layers": config.num_hidden_layers, "hidden_size": config.hidden_size, "num_attention_heads": nq,
        "ffn_hidden_size": config.intermediate_size, "kv_channels": head_dim, "num_query_groups": nkv,
        "seq_length": config.max_position_embeddings, "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size, "position_embedding_type": "rope", "rotary_base": theta,
        "normalization": "RMSNorm", "norm_epsilon": float(config.rms_norm_eps), "swiglu": True, "openai_gelu": False,
        "add_bias_linear": False, "add_qkv_bias": model_type == "qwen2",
        "untie_embeddings_and_output_weights": not getattr(config, "tie_word_embeddings", False),
        "rotary_percent": factor, "apply_layernorm_1p": False,
    }


# GPT-2 activation names -> openai_gelu. gelu_new is the tanh approximation written out by hand
# (NewGELUActivation); it equals F.gelu(approximate="tanh") to float rounding.
GPT2_ACTIVATIONS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}


def gpt2_model_config(config) -> dict:
    """GPT-2: learned positions, LayerNorm with biases, GELU, biases on every linear layer, MHA."""
    act = config.activation_function
    if act not in GPT2_ACTIVATIONS:
        raise UserError(f"gpt2 activation_function={act!r} is not supported (supported: {', '.join(GPT2_ACTIVATIONS)})")
    if not getattr(config, "scale_attn_weights", True) or getattr(config, "scale_attn_by_inverse_layer_idx", False):
        raise UserError("gpt2 attention scaling other than 1/sqrt(head_dim) (scale_attn_weights=False or "
                        "scale_attn_by_inverse_layer_idx=True) is not supported")
    if getattr(config, "add_cross_attention", False):
        raise UserError("gpt2 add_cross_attention=True (an encoder-decoder variant) is not supported")
    h, heads = config.n_embd, config.n_head
    return {
        "num_layers": config.n_layer, "hidden_size": h, "num_attention_heads": heads,
        "ffn_hidden_size": config.n_inner or 4 * h, "kv_channels": h // heads, "num_query_groups": heads,
        "seq_length": config.n_positions, "max_position_embeddings": config.n_positions,
        "vocab_size": config.vocab_size, "position_embedding_type": "learned_absolute", "rotary_base": 10000.0,
        "normalization": "LayerNorm", "norm_epsilon": float(config.layer_norm_epsilon), "swiglu": False,
        "openai_gelu": GPT2_ACTIVATIONS[act], "add_bias_linear": True, "add_qkv_bias": False,
        "untie_embeddings_and_output_weights": not getattr(config, "tie_word_embeddings", True),
        "rotary_percent": 1.0, "apply_layernorm_1p": False,
    }


# ==================================================================================================
# Tensors: Hugging Face -> megalite
# ==================================================================================================
def llama_like_to_megalite(w: HFWeights, m: dict, model_type: str = "llama") -> dict[str, torch.Tensor]:
    nq, nkv, d = m["num_attention_heads"], m["num_query_groups"], m["kv_channels"]
    out = {"embedding.word_embeddings.weight": w.take("model.embed_tokens.weight")}
    for i in range(m["num_layers"]):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf + "self_attn."
        out[mg + "input_layernorm.weight"] = w.take(hf + "input_layernorm.weight")
        if model_type == "phi3":       # qkv_proj rows [q; k; v], gate_up_proj rows [gate; up] (megalite's fc1)
            q, k, v = w.take(attn + "qkv_proj.weight").split([nq * d, nkv * d, nkv * d])
            out[mg + "self_attention.linear_qkv.weight"] = fuse_qkv(q, k, v, nq, nkv, d)
            out[mg + "self_attention.linear_proj.weight"] = w.take(attn + "o_proj.weight")
            out[mg + "pre_mlp_layernorm.weight"] = w.take(hf + "post_attention_layernorm.weight")
            out[mg + "mlp.linear_fc1.weight"] = w.take(hf + "mlp.gate_up_proj.weight")
            out[mg + "mlp.linear_fc2.weight"] = w.take(hf + "mlp.down_proj.weight")
            continue
        out[mg + "self_attention.linear_qkv.weight"] = fuse_qkv(
            *(w.take(attn + f"{p}_proj.weight") for p in "qkv"), nq, nkv, d)
        if m["add_qkv_bias"]:
            out[mg + "self_attention.linear_qkv.bias"] = fuse_qkv(
                *(w.take(attn + f"{p}_proj.bias") for p in "qkv"), nq, nkv, d)
        out[mg + "self_attention.linear_proj.weight"] = w.take(attn + "o_proj.weight")
        out[mg + "pre_mlp_layernorm.weight"] = w.take(hf + "post_attention_layernorm.weight")
        out[mg + "mlp.linear_fc1.weight"] = fuse_swiglu(w.take(hf + "mlp.gate_proj.weight"),
                                                        w.take(hf + "mlp.up_proj.weight"))
        out[mg + "mlp.linear_fc2.weight"] = w.take(hf + "mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = w.take("model.norm.weight")
    _take_output_layer(w, m, out)
    return out


def gpt2_to_megalite(w: HFWeights, m: dict) -> dict[str, torch.Tensor]:
    heads, d = m["num_attention_heads"], m["kv_channels"]
    out = {"embedding.word_embeddings.weight": w.take("transformer.wte.weight"),
           "embedding.position_embeddings.weight": w.take("transformer.wpe.weight")}
    for i in range(m["num_layers"]):
        hf, mg = f"transformer.h.{i}.", f"decoder.layers.{i}."
        for norm_hf, norm_mg in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
            for p in ("weight", "bias"):
                out[f"{mg}{norm_mg}.{p}"] = w.take(f"{hf}{norm_hf}.{p}")
        # c_attn: [h, 3h] Conv1D -> [3h, h] rows [q; k; v] -> grouped per head (nkv = heads)
        qkv_w = conv1d_to_linear(w.take(hf + "attn.c_attn.weight"))
        out[mg + "self_attention.linear_qkv.weight"] = fuse_qkv(*qkv_w.chunk(3, dim=0), heads, heads, d)
        out[mg + "self_attention.linear_qkv.bias"] = fuse_qkv(*w.take(hf + "attn.c_attn.bias").chunk(3), heads, heads, d)
        for hf_name, mg_name in (("attn.c_proj", "self_attention.linear_proj"), ("mlp.c_fc", "mlp.linear_fc1"),
                                 ("mlp.c_proj", "mlp.linear_fc2")):
            out[f"{mg}{mg_name}.weight"] = conv1d_to_linear(w.take(f"{hf}{hf_name}.weight"))
            out[f"{mg}{mg_name}.bias"] = w.take(f"{hf}{hf_name}.bias")
    out["decoder.final_layernorm.weight"] = w.take("transformer.ln_f.weight")
    out["decoder.final_layernorm.bias"] = w.take("transformer.ln_f.bias")
    _take_output_layer(w, m, out)
    return out


def _take_output_layer(w: HFWeights, m: dict, out: dict) -> None:
    if m["untie_embeddings_and_output_weights"]:
        out["output_layer.weight"] = w.take("lm_head.weight")
    elif w.has("lm_head.weight"):
        w.take("lm_head.weight")        # a tied model saved with its lm_head copy: the same tensor, stored once


# ==================================================================================================
# Tensors: megalite -> Hugging Face
# ==================================================================================================
class _MegaliteTensors:
    """A checkpoint's model tensors by global name. Biases megalite's config does not have but the HF
    family always has (Qwen2 q/k/v, GPT-2 linear layers) are zeros: exact, since megalite adds none."""

    def __init__(self, reader: CheckpointReader, dtype: torch.dtype):
        self.reader, self.dtype = reader, dtype

    def get(self, name: str) -> torch.Tensor:
        return self.reader.tensor(name)

    def norm(self, name: str, zero_centered: bool) -> torch.Tensor:
        """A norm weight as HF computes with it: --apply-layernorm-1p's stored gamma - 1, plus 1."""
        weight = self.get(name)
        return (weight.float() + 1.0).to(weight.dtype) if zero_centered else weight

    def bias(self, name: str, size: int) -> torch.Tensor:
        return self.get(name) if self.reader.has(name) else torch.zeros(size, dtype=self.dtype)


def megalite_to_llama_like(t: _MegaliteTensors, m: dict, model_type: str) -> dict[str, torch.Tensor]:
    nq, nkv, d = m["num_attention_heads"], m["num_query_groups"], m["kv_channels"]
    one_p = m["apply_layernorm_1p"]
    out = {"model.embed_tokens.weight": t.get("embedding.word_embeddings.weight")}
    for i in range(m["num_layers"]):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf + "self_attn."
        out[hf + "input_layernorm.weight"] = t.norm(mg + "input_layernorm.weight", one_p)
        q, k, v = split_qkv(t.get(mg + "self_attention.linear_qkv.weight"), nq, nkv, d)
        if model_type == "phi3":
            out[attn + "qkv_proj.weight"] = torch.cat([q, k, v])
            out[attn + "o_proj.weight"] = t.get(mg + "self_attention.linear_proj.weight")
            out[hf + "post_attention_layernorm.weight"] = t.norm(mg + "pre_mlp_layernorm.weight", one_p)
            out[hf + "mlp.gate_up_proj.weight"] = t.get(mg + "mlp.linear_fc1.weight")
            out[hf + "mlp.down_proj.weight"] = t.get(mg + "mlp.linear_fc2.weight")
            continue
        out.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v})
        if model_type == "qwen2":
            bias = t.bias(mg + "self_attention.linear_qkv.bias", (nq + 2 * nkv) * d)
            q, k, v = split_qkv(bias, nq, nkv, d)
            out.update({attn + "q_proj.bias": q, attn + "k_proj.bias": k, attn + "v_proj.bias": v})
        out[attn + "o_proj.weight"] = t.get(mg + "self_attention.linear_proj.weight")
        out[hf + "post_attention_layernorm.weight"] = t.norm(mg + "pre_mlp_layernorm.weight", one_p)
        gate, up = split_swiglu(t.get(mg + "mlp.linear_fc1.weight"))
        out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = gate, up
        out[hf + "mlp.down_proj.weight"] = t.get(mg + "mlp.linear_fc2.weight")
    out["model.norm.weight"] = t.norm("decoder.final_layernorm.weight", one_p)
    if m["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = t.get("output_layer.weight")
    return out


def megalite_to_gpt2(t: _MegaliteTensors, m: dict) -> dict[str, torch.Tensor]:
    h, heads, d, ffn = m["hidden_size"], m["num_attention_heads"], m["kv_channels"], m["ffn_hidden_size"]
    out = {"transformer.wte.weight": t.get("embedding.word_embeddings.weight"),
           "transformer.wpe.weight": t.get("embedding.position_embeddings.weight")}
    for i in range(m["num_layers"]):
        hf, mg = f"transformer.h.{i}.", f"decoder.layers.{i}."
        for norm_hf, norm_mg in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
            out[f"{hf}{norm_hf}.weight"] = t.norm(f"{mg}{norm_mg}.weight", m["apply_layernorm_1p"])
            out[f"{hf}{norm_hf}.bias"] = t.get(f"{mg}{norm_mg}.bias")
        q, k, v = split_qkv(t.get(mg + "self_attention.linear_qkv.weight"), heads, heads, d)
        out[hf + "attn.c_attn.weight"] = linear_to_conv1d(torch.cat([q, k, v]))
        out[hf + "attn.c_attn.bias"] = torch.cat(split_qkv(t.bias(mg + "self_attention.linear_qkv.bias", 3 * h),
                                                           heads, heads, d))
        for hf_name, mg_name, size in (("attn.c_proj", "self_attention.linear_proj", h),
                                       ("mlp.c_fc", "mlp.linear_fc1", ffn), ("mlp.c_proj", "mlp.linear_fc2", h)):
            out[f"{hf}{hf_name}.weight"] = linear_to_conv1d(t.get(f"{mg}{mg_name}.weight"))
            out[f"{hf}{hf_name}.bias"] = t.bias(f"{mg}{mg_name}.bias", size)
    out["transformer.ln_f.weight"] = t.norm("decoder.final_layernorm.weight", m["apply_layernorm_1p"])
    out["transformer.ln_f.bias"] = t.get("decoder.final_layernorm.bias")
    if m["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = t.get("output_layer.weight")
    return out


# ==================================================================================================
# Configs: megalite -> Hugging Face
# ==================================================================================================
def default_model_type(metadata: dict) -> str:
    """The family a checkpoint came from, else the one its architecture implies."""
    source = metadata.get("source") or {}
    if source.get("model_type") in SUPPORTED_MODEL_TYPES:
        return source["model_type"]
    m = metadata["model"]
    if m["position_embedding_type"] == "learned_absolute" and m["normalization"] == "LayerNorm":
        return "gpt2"
    if m.get("rotary_percent", 1.0) != 1.0:
        return "phi3"
    return "qwen2" if m["add_qkv_bias"] else "llama"


def check_representable(m: dict, model_type: str) -> None:
    """Refuse (one line) a megalite architecture the chosen HF family cannot express exactly."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise UserError(f"--model-type {model_type} cannot represent this checkpoint: {what}")
    if model_type == "gpt2":
        need(m["position_embedding_type"] == "learned_absolute", "GPT-2 has learned absolute positions, the "
             f"checkpoint uses {m['position_embedding_type']}")
        need(m["normalization"] == "LayerNorm", f"GPT-2 uses LayerNorm, the checkpoint {m['normalization']}")
        need(not m["swiglu"], "GPT-2 has a GELU MLP, the checkpoint SwiGLU")
        need(m["num_query_groups"] == m["num_attention_heads"], "GPT-2 has no grouped-query attention")
        need(m["kv_channels"] * m["num_attention_heads"] == m["hidden_size"],
             "GPT-2 needs kv_channels x num_attention_heads == hidden_size")
        return
    need(m["position_embedding_type"] == "rope", f"{model_type} uses RoPE, the checkpoint "
         f"{m['position_embedding_type']} position embeddings")
    need(m["normalization"] == "RMSNorm", f"{model_type} uses RMSNorm, the checkpoint {m['normalization']}")
    need(m["swiglu"], f"{model_type} has a SwiGLU MLP, the checkpoint a GELU MLP")
    need(not m["add_bias_linear"], f"{model_type} has no biases on its linear layers (add_bias_linear=True)")
    if model_type != "qwen2":
        need(not m["add_qkv_bias"], f"{model_type} has no q/k/v biases (add_qkv_bias=True); use --model-type qwen2")
    if model_type != "phi3":
        need(m["rotary_percent"] == 1.0, f"{model_type}'s RoPE rotates whole heads, the checkpoint has "
             f"--rotary-percent {m['rotary_percent']:g}; use --model-type phi3")


def build_hf_config(m: dict, model_type: str, token_ids: dict):
    """The transformers config object for metadata["model"] ``m`` (already checked representable)."""
    with _quiet_transformers():
        from transformers import GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config
        common = {"vocab_size": m["vocab_size"], "tie_word_embeddings": not m["untie_embeddings_and_output_weights"],
                  "architectures": [ARCHITECTURES[model_type]], "dtype": m.get("params_dtype", "float32"), **token_ids}
        if model_type == "gpt2":
            h = m["hidden_size"]
            return GPT2Config(n_embd=h, n_layer=m["num_layers"], n_head=m["num_attention_heads"],
                              n_positions=m["max_position_embeddings"],
                              n_inner=None if m["ffn_hidden_size"] == 4 * h else m["ffn_hidden_size"],
                              activation_function="gelu_new" if m["openai_gelu"] else "gelu",
                              layer_norm_epsilon=m["norm_epsilon"], **common)
        rope = {"rope_type": "default", "rope_theta": float(m["rotary_base"])}
        fields = dict(hidden_size=m["hidden_size"], intermediate_size=m["ffn_hidden_size"],
                      num_hidden_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
                      num_key_value_heads=m["num_query_groups"], head_dim=m["kv_channels"],
                      max_position_embeddings=m["max_position_embeddings"], rms_norm_eps=m["norm_epsilon"],
                      hidden_act="silu", rope_parameters=rope, **common)
        if model_type == "phi3":
            rope["partial_rotary_factor"] = float(m["rotary_percent"])
            # Phi3Config's own token ids (eos/pad 32000) belong to Phi-3's vocabulary, not this model's
            ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
            return Phi3Config(sliding_window=None, original_max_position_embeddings=m["max_position_embeddings"],
                              **{**ids, **fields})
        if model_type == "llama":
            return LlamaConfig(attention_bias=False, mlp_bias=False, **fields)
        if model_type == "mistral":
            return MistralConfig(sliding_window=None, **fields)     # megalite attention is full causal
        return Qwen2Config(use_sliding_window=False, sliding_window=None, **fields)


# ==================================================================================================
# Tokenizer files
# ==================================================================================================
def tokenizer_files(directory: str) -> list[str]:
    """The tokenizer files in ``directory`` (empty when there is no loadable tokenizer)."""
    present = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, f))]
    return present if any(f in TOKENIZER_CORE for f in present) else []


def copy_tokenizer(source: str, destination: str) -> list[str]:
    files = tokenizer_files(source)
    os.makedirs(destination, exist_ok=True)
    for f in files:
        shutil.copyfile(os.path.join(source, f), os.path.join(destination, f))
    return files


def _names_tokenizer_class(directory: str) -> bool:
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("tokenizer_class"))
    except (OSError, ValueError, AttributeError):
        return False


def _token_ids(config) -> dict:
    """bos/eos/pad ids, recorded so an export writes the model's own (LlamaConfig defaults to 1/2)."""
    return {key: getattr(config, key, None) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}


def _token_ids_from_tokenizer(directory: str) -> dict:
    """bos/eos/pad ids of the tokenizer in ``directory`` (empty when it cannot be loaded)."""
    try:
        with _quiet_transformers():
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except Exception:       # a tokenizer transformers cannot load: keep the config class defaults
        return {}
    return {k: getattr(tok, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


# ==================================================================================================
# Public API
# ==================================================================================================
def hf_to_megalite(hf_dir: str, output_dir: str, overwrite: bool = False, log=_warn) -> str:
    """Convert a Hugging Face model directory into a megalite checkpoint at iteration 0 under
    ``output_dir``; returns the published iteration directory. Tokenizer files, when present, are
    copied into ``<iter dir>/tokenizer`` and recorded (relative to the iteration directory) so that
    ``--use-checkpoint-args`` and generation find them."""
    config = read_hf_config(hf_dir)
    model_type = config.model_type
    m = gpt2_model_config(config) if model_type == "gpt2" else llama_like_model_config(config, model_type, log)
    _check_output_free(output_dir, overwrite, kind="megalite")

    weights = HFWeights(hf_dir, "transformer." if model_type == "gpt2" else "model.")
    tensors = gpt2_to_megalite(weights, m) if model_type == "gpt2" else llama_like_to_megalite(weights, m, model_type)
    weights.check_all_used()
    embeddings = tensors["embedding.word_embeddings.weight"]
    if embeddings.shape[0] != m["vocab_size"]:
        raise UserError(f"--input {hf_dir}: config.json says vocab_size={m['vocab_size']} but the embeddings have "
                        f"{embeddings.shape[0]} rows")
    dtype_name = _dtype_name(config) or DTYPE_NAMES.get(embeddings.dtype, "float32")
    # megalite stores float32/bfloat16/float16; a float64 model is stored as its params dtype
    tensors = {n: t if t.dtype in DTYPE_NAMES else t.to(getattr(torch, dtype_name)) for n, t in tensors.items()}
    model = {**{k: m[k] for k in ARCHITECTURE_FIELDS}, "params_dtype": dtype_name}

    _make_output_dir(output_dir)
    # written as iter_0000000.tmp (tokenizer included) and published by one rename, as training saves
    tmp = prepare_temporary_dir(output_dir, 0)
    index = write_tensor_file(tmp, MODEL_FILE, tensors)
    tokenizer = None
    if tokenizer_files(hf_dir):
        copy_tokenizer(hf_dir, os.path.join(tmp, TOKENIZER_SUBDIR))
        if not _names_tokenizer_class(hf_dir):
            # AutoTokenizer then picks the class from config.json's model_type; keep it next to the files
            shutil.copyfile(os.path.join(hf_dir, "config.json"), os.path.join(tmp, TOKENIZER_SUBDIR, "config.json"))
        tokenizer = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": TOKENIZER_SUBDIR,
                     "vocab_file": None, "merge_file": None, "vocab_size": None}
    metadata = {"iteration": 0, "model": model, "tokenizer": tokenizer, "tensors": index,
                "source": {"format": "huggingface", "model_type": model_type,
                           "architectures": list(getattr(config, "architectures", None) or []),
                           "path": os.path.abspath(hf_dir), **_token_ids(config)}}
    write_metadata(tmp, metadata)
    return publish(output_dir, 0)


def megalite_to_hf(checkpoint_dir: str, output_dir: str, model_type: str | None = None, overwrite: bool = False,
                   log=_warn) -> str:
    """Export a megalite checkpoint (a save directory or an iter_N directory) as a Hugging Face model
    directory: config.json, model.safetensors and the checkpoint's tokenizer files. Training-state
    tensors (optimizer.*) are not exported. Returns ``output_dir``."""
    if not os.path.isdir(checkpoint_dir):
        raise UserError(f"--input {checkpoint_dir}: no such directory; give a megalite checkpoint directory")
    if not any(os.path.isfile(os.path.join(checkpoint_dir, f)) for f in (TRACKER, METADATA)):
        raise UserError(f"--input {checkpoint_dir} has no {TRACKER} and no {METADATA}; is it a megalite checkpoint "
                        "directory? (convert a Hugging Face model with --from hf --to megalite)")
    reader = CheckpointReader(checkpoint_dir)
    meta = reader.metadata
    m = meta.get("model")
    m = with_architecture_defaults(m) if isinstance(m, dict) else m
    if not isinstance(m, dict) or any(k not in m for k in ARCHITECTURE_FIELDS):
        raise UserError(f"checkpoint {reader.directory}: metadata.json has no complete model description")
    model_type = model_type or default_model_type(meta)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"--model-type {model_type} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    check_representable(m, model_type)
    _check_output_free(output_dir, overwrite, kind="hf")

    # zero biases (see _MegaliteTensors) take the stored weights' dtype, so the file has one dtype
    tensors = _MegaliteTensors(reader, reader.tensor("embedding.word_embeddings.weight").dtype)
    hf_tensors = megalite_to_gpt2(tensors, m) if model_type == "gpt2" else megalite_to_llama_like(tensors, m, model_type)
    tokenizer_dir = _checkpoint_tokenizer_dir(reader, log)
    source = meta.get("source") or {}
    token_ids = {k: source[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in source}
    if not token_ids and tokenizer_dir:
        token_ids = {k: v for k, v in _token_ids_from_tokenizer(tokenizer_dir).items() if v is not None}
    config = build_hf_config(m, model_type, token_ids)

    from safetensors.torch import save_file
    _make_output_dir(output_dir)
    if overwrite:
        _remove_previous_export(output_dir)
    # each file is written under a temporary name and renamed; config.json last, so an interrupted
    # export never leaves a directory that loads with the wrong weights
    weights_tmp = os.path.join(output_dir, "model.safetensors.tmp")
    save_file({n: t.contiguous() for n, t in hf_tensors.items()}, weights_tmp, metadata={"format": "pt"})
    os.replace(weights_tmp, os.path.join(output_dir, "model.safetensors"))
    if tokenizer_dir:
        copy_tokenizer(tokenizer_dir, output_dir)
    with _quiet_transformers():
        config_tmp = os.path.join(output_dir, "config.json.tmp")
        config.to_json_file(config_tmp)
    os.replace(config_tmp, os.path.join(output_dir, "config.json"))
    return output_dir


def _checkpoint_tokenizer_dir(reader: CheckpointReader, log) -> str | None:
    """The checkpoint's Hugging Face tokenizer directory (relative paths are inside the iteration dir)."""
    tok = reader.metadata.get("tokenizer") or {}
    if not tok:
        return None
    if tok.get("tokenizer_type") != "HuggingFaceTokenizer" or not tok.get("tokenizer_model"):
        log(f"the checkpoint's tokenizer ({tok.get('tokenizer_type')}) is not a Hugging Face tokenizer "
            "directory; no tokenizer files exported")
        return None
    path = tok["tokenizer_model"]
    path = path if os.path.isabs(path) else os.path.join(reader.directory, path)
    if not tokenizer_files(path):
        log(f"tokenizer directory {path} has no tokenizer files (moved or deleted?); no tokenizer exported")
        return None
    return path


def _check_output_free(output_dir: str, overwrite: bool, kind: str) -> None:
    if overwrite or not os.path.exists(output_dir):
        return
    if not os.path.isdir(output_dir):
        raise UserError(f"--output {output_dir} exists and is not a directory")
    if kind == "megalite":
        holds = any(os.path.exists(os.path.join(output_dir, f)) for f in (TRACKER, METADATA))
        what = "a megalite checkpoint"
    else:
        holds = os.path.exists(os.path.join(output_dir, "config.json")) or any(
            glob.glob(os.path.join(output_dir, p)) for p in HF_WEIGHT_PATTERNS)
        what = "a Hugging Face model"
    if holds:
        raise UserError(f"--output {output_dir} already holds {what}; pass --overwrite to replace it, or choose "
                        "another directory")


def _make_output_dir(output_dir: str) -> None:
    try:
        os.makedirs(output_dir, exist_ok=True)
        probe = os.path.join(output_dir, ".megalite-writable")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise UserError(f"--output {output_dir}: cannot write there ({e.strerror}); choose a writable directory") from None


def _remove_previous_export(output_dir: str) -> None:
    for pattern in HF_WEIGHT_PATTERNS + TOKENIZER_FILES:
        for path in glob.glob(os.path.join(output_dir, pattern)):
            if os.path.isfile(path):
                os.remove(path)
