"""Convert Hugging Face causal LMs to megalite checkpoints and back (Llama, Mistral, Qwen2, Qwen3, Phi-3, GPT-2,
and the Mixture-of-Experts Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS, GLM-4.5 and DeepSeek-V3).

    hf_to_megalite(HF_DIR, CKPT_DIR)       -> CKPT_DIR/iter_0000000 (+ tracker), tokenizer copied inside
    megalite_to_hf(CKPT_DIR, HF_DIR)       -> HF_DIR/config.json + model.safetensors or its shards (+ tokenizer)

Both directions convert and write a bounded amount at a time, part by part (the embedding, each
layer, the head), into several files when the model is large (hf_shards.py).

Both directions are exact: tensors are only renamed, transposed, concatenated or split, never cast
(except float64, which megalite does not store). What differs between the formats:

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
- Qwen3 and Qwen3-MoE normalise each q and k head (``q_norm`` / ``k_norm`` [head_dim]): megalite's
  --qk-layernorm, ``self_attention.q_layernorm`` / ``k_layernorm``.
- MoE layers (hf_moe.py): the router is ``mlp.router``, the experts are stacked into one fc1 and one fc2
  tensor per layer, Qwen2-MoE's gated shared expert is ``mlp.shared_experts``. metadata["model"] records
  the MoE fields and --qk-layernorm next to files.ARCHITECTURE_FIELDS (hf_config.EXTRA_FIELDS).
- DeepSeek-V3 / Kimi K2 / DeepSeek-V2-Lite's form and GLM-4.5 (hf_deepseek.py): multi-latent attention
  (RoPE rows de-interleaved), sigmoid routing with expert biases and groups, and the multi-token-prediction
  layers stored after the main model's (``model.layers.{L + k}`` -> ``mtp.layers.{k}``).
- ``--apply-layernorm-1p`` stores norm weights as gamma - 1; no HF family does, so the export folds
  the + 1 into the weights (exact: one rounding of the exact sum, as the norm itself computes it).

What megalite cannot represent is refused with one line (UserError) before anything is written: rope
scaling (rope_type other than "default", but YaRN for GPT-OSS and DeepSeek-V3), Llama o_proj / MLP biases,
other activations, windows that differ between layers. A sliding attention window becomes --window-size (and --window-attn-skip-freq for
the layers without it) and is written back on export (hf_window.py). The config mapping lives in
hf_config.py, the reading of HF weight files in hf_weights.py.
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
from typing import Iterator

import torch

from megalite.checkpoint.files import (ARCHITECTURE_FIELDS, METADATA, TRACKER, CheckpointReader, prepare_temporary_dir,
                                       publish, temporary_dir, with_architecture_defaults, write_metadata)
from megalite.checkpoint.hf_config import (EXTRA_FIELDS, QKV_BIAS_MODEL_TYPES, SUPPORTED_MODEL_TYPES,
                                           build_hf_config, check_convertible, check_representable, config_token_ids,
                                           default_model_type, dtype_name, extra_defaults, model_fields,
                                           quiet_transformers, read_hf_config, token_ids_from_tokenizer, warn)
from megalite.checkpoint.hf_deepseek import (DEEPSEEK_MODEL_TYPES, GLM4_MOE, MTP_COPIES, deepseek_moe_to_megalite,
                                             deepseek_source, megalite_to_deepseek_moe, megalite_to_mla,
                                             megalite_to_mtp, mla_to_megalite, mtp_copies, mtp_depth,
                                             mtp_to_megalite)
from megalite.checkpoint.hf_fp8 import block_size, quantization_config, quantize_checkpoint
from megalite.checkpoint.hf_gpt_oss import GPT_OSS, gpt_oss_moe_to_megalite, megalite_to_gpt_oss_moe
from megalite.checkpoint.hf_tokenizer import (TOKENIZER_FILES, copy_tokenizer, export_tokenizer,
                                              names_tokenizer_class, tokenizer_files)
from megalite.checkpoint.hf_moe import is_sparse, megalite_to_moe, moe_to_megalite, moe_training_settings
from megalite.checkpoint.hf_weights import HFWeights
from megalite.checkpoint.hf_shards import write_hf_parts, write_megalite_parts
from megalite.errors import UserError

TOKENIZER_SUBDIR = "tokenizer"                  # inside the iteration directory
# HF weight files a previous export may have left; removed by --overwrite so no stale shard is loaded.
HF_WEIGHT_PATTERNS = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
                      "pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ==================================================================================================
# Tensor layouts shared by the families
# ==================================================================================================
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nq: int, nkv: int, d: int) -> torch.Tensor:
    """Separate q [nq*d, ...], k, v [nkv*d, ...] (weights or biases) -> megalite's grouped linear_qkv:
    for each KV group g, the nq/nkv query heads of g, then k_g, then v_g, so that a
    tensor-parallel shard is one contiguous block of rows."""
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
# Tensors: Hugging Face -> megalite
# ==================================================================================================
# The converters yield the model in parts, the embedding first, each part a dict of tensors built only
# when the writer asks for it and referenced by no local variable once yielded (hf_shards.py).
def llama_like_to_megalite(w: HFWeights, m: dict, model_type: str = "llama") -> Iterator[dict[str, torch.Tensor]]:
    yield {"embedding.word_embeddings.weight": w.take("model.embed_tokens.weight")}
    for i in range(m["num_layers"]):
        yield _layer_to_megalite(w, f"model.layers.{i}.", f"decoder.layers.{i}.", m, model_type, is_sparse(m, i))
    yield _take_output_layer(w, m, {"decoder.final_layernorm.weight": w.take("model.norm.weight")})
    yield from mtp_to_megalite(w, m, lambda hf, mg, sparse: _layer_to_megalite(w, hf, mg, m, model_type, sparse))


def _layer_to_megalite(w: HFWeights, hf: str, mg: str, m: dict, model_type: str, sparse: bool) -> dict:
    """One transformer layer, HF ``hf`` = "model.layers.{i}." -> megalite ``mg``."""
    nq, nkv, d = m["num_attention_heads"], m["num_query_groups"], m["kv_channels"]
    attn, out = hf + "self_attn.", {}
    out[mg + "input_layernorm.weight"] = w.take(hf + "input_layernorm.weight")
    out[mg + "pre_mlp_layernorm.weight"] = w.take(hf + "post_attention_layernorm.weight")
    if model_type == "phi3":       # qkv_proj rows [q; k; v], gate_up_proj rows [gate; up] (megalite's fc1)
        q, k, v = w.take(attn + "qkv_proj.weight").split([nq * d, nkv * d, nkv * d])
        out[mg + "self_attention.linear_qkv.weight"] = fuse_qkv(q, k, v, nq, nkv, d)
        out[mg + "self_attention.linear_proj.weight"] = w.take(attn + "o_proj.weight")
        out[mg + "mlp.linear_fc1.weight"] = w.take(hf + "mlp.gate_up_proj.weight")
        out[mg + "mlp.linear_fc2.weight"] = w.take(hf + "mlp.down_proj.weight")
        return out
    if m["multi_latent_attention"]:
        out.update(mla_to_megalite(w, attn, mg + "self_attention.", m))
    else:
        out[mg + "self_attention.linear_qkv.weight"] = fuse_qkv(
            *(w.take(attn + f"{p}_proj.weight") for p in "qkv"), nq, nkv, d)
        out[mg + "self_attention.linear_proj.weight"] = w.take(attn + "o_proj.weight")
    if m["add_qkv_bias"] or m["add_bias_linear"]:
        out[mg + "self_attention.linear_qkv.bias"] = fuse_qkv(
            *(w.take(attn + f"{p}_proj.bias") for p in "qkv"), nq, nkv, d)
    if m["qk_layernorm"] and not m["multi_latent_attention"]:
        out[mg + "self_attention.q_layernorm.weight"] = w.take(attn + "q_norm.weight")
        out[mg + "self_attention.k_layernorm.weight"] = w.take(attn + "k_norm.weight")
    if m["add_bias_linear"]:
        out[mg + "self_attention.linear_proj.bias"] = w.take(attn + "o_proj.bias")
    if m["softmax_type"] == "learnable":
        out[mg + "self_attention.softmax_offset"] = w.take(attn + "sinks")
    if sparse:
        out.update(gpt_oss_moe_to_megalite(w, hf, mg, m) if model_type == GPT_OSS else
                   deepseek_moe_to_megalite(w, hf, mg, m) if model_type in DEEPSEEK_MODEL_TYPES else
                   moe_to_megalite(w, hf, mg, m, model_type))
        return out
    out[mg + "mlp.linear_fc1.weight"] = fuse_swiglu(w.take(hf + "mlp.gate_proj.weight"),
                                                    w.take(hf + "mlp.up_proj.weight"))
    out[mg + "mlp.linear_fc2.weight"] = w.take(hf + "mlp.down_proj.weight")
    return out


def gpt2_to_megalite(w: HFWeights, m: dict) -> Iterator[dict[str, torch.Tensor]]:
    yield {"embedding.word_embeddings.weight": w.take("transformer.wte.weight"),
           "embedding.position_embeddings.weight": w.take("transformer.wpe.weight")}
    for i in range(m["num_layers"]):
        yield _gpt2_layer_to_megalite(w, f"transformer.h.{i}.", f"decoder.layers.{i}.", m)
    yield _take_output_layer(w, m, {"decoder.final_layernorm.weight": w.take("transformer.ln_f.weight"),
                                    "decoder.final_layernorm.bias": w.take("transformer.ln_f.bias")})


def _gpt2_layer_to_megalite(w: HFWeights, hf: str, mg: str, m: dict) -> dict[str, torch.Tensor]:
    heads, d, out = m["num_attention_heads"], m["kv_channels"], {}
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
    return out


def _take_output_layer(w: HFWeights, m: dict, out: dict) -> dict:
    """``out`` (the final norm) with the output head added, when it is not tied to the embedding."""
    if m["untie_embeddings_and_output_weights"]:
        out["output_layer.weight"] = w.take("lm_head.weight")
    elif w.has("lm_head.weight"):
        w.take("lm_head.weight")        # a tied model saved with its lm_head copy: the same tensor, stored once
    return out


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


def megalite_to_llama_like(t: _MegaliteTensors, m: dict, model_type: str,
                           mtp_copies=()) -> Iterator[dict[str, torch.Tensor]]:
    """The HF model in parts, as the import's converters yield them. ``mtp_copies``: the copies of the
    embedding and output head each MTP layer carries (hf_deepseek)."""
    yield {"model.embed_tokens.weight": t.get("embedding.word_embeddings.weight")}
    for i in range(m["num_layers"]):
        yield _layer_to_hf(t, f"model.layers.{i}.", f"decoder.layers.{i}.", m, model_type, is_sparse(m, i))
    yield _output_layer_to_hf(t, m, {"model.norm.weight": t.norm("decoder.final_layernorm.weight",
                                                                 m["apply_layernorm_1p"])})
    yield from megalite_to_mtp(t, m, lambda hf, mg, sparse: _layer_to_hf(t, hf, mg, m, model_type, sparse),
                               mtp_copies)


def _output_layer_to_hf(t: _MegaliteTensors, m: dict, out: dict) -> dict:
    """``out`` (the final norm) with the output head added, when it is not tied to the embedding."""
    if m["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = t.get("output_layer.weight")
    return out


def _layer_to_hf(t: _MegaliteTensors, hf: str, mg: str, m: dict, model_type: str, sparse: bool) -> dict:
    """Inverse of _layer_to_megalite."""
    nq, nkv, d = m["num_attention_heads"], m["num_query_groups"], m["kv_channels"]
    one_p = m["apply_layernorm_1p"]
    attn, out = hf + "self_attn.", {}
    out[hf + "input_layernorm.weight"] = t.norm(mg + "input_layernorm.weight", one_p)
    out[hf + "post_attention_layernorm.weight"] = t.norm(mg + "pre_mlp_layernorm.weight", one_p)
    if m["multi_latent_attention"]:
        out.update(megalite_to_mla(t, attn, mg + "self_attention.", m))
    else:
        q, k, v = split_qkv(t.get(mg + "self_attention.linear_qkv.weight"), nq, nkv, d)
        out[attn + "o_proj.weight"] = t.get(mg + "self_attention.linear_proj.weight")
    if model_type == "phi3":
        out[attn + "qkv_proj.weight"] = torch.cat([q, k, v])
        out[hf + "mlp.gate_up_proj.weight"] = t.get(mg + "mlp.linear_fc1.weight")
        out[hf + "mlp.down_proj.weight"] = t.get(mg + "mlp.linear_fc2.weight")
        return out
    if not m["multi_latent_attention"]:
        out.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v})
    if m["qk_layernorm"] and not m["multi_latent_attention"]:
        out[attn + "q_norm.weight"] = t.norm(mg + "self_attention.q_layernorm.weight", one_p)
        out[attn + "k_norm.weight"] = t.norm(mg + "self_attention.k_layernorm.weight", one_p)
    if model_type in QKV_BIAS_MODEL_TYPES + (GPT_OSS,) or (model_type == GLM4_MOE and m["add_qkv_bias"]):
        bias = t.bias(mg + "self_attention.linear_qkv.bias", (nq + 2 * nkv) * d)
        q, k, v = split_qkv(bias, nq, nkv, d)
        out.update({attn + "q_proj.bias": q, attn + "k_proj.bias": k, attn + "v_proj.bias": v})
    if model_type == GPT_OSS:
        out[attn + "o_proj.bias"] = t.get(mg + "self_attention.linear_proj.bias")
        out[attn + "sinks"] = t.get(mg + "self_attention.softmax_offset")
        out.update(megalite_to_gpt_oss_moe(t, hf, mg, m))
        return out
    if sparse:
        out.update(megalite_to_deepseek_moe(t, hf, mg, m) if model_type in DEEPSEEK_MODEL_TYPES else
                   megalite_to_moe(t, hf, mg, m, model_type))
        return out
    gate, up = split_swiglu(t.get(mg + "mlp.linear_fc1.weight"))
    out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = gate, up
    out[hf + "mlp.down_proj.weight"] = t.get(mg + "mlp.linear_fc2.weight")
    return out


def megalite_to_gpt2(t: _MegaliteTensors, m: dict) -> Iterator[dict[str, torch.Tensor]]:
    yield {"transformer.wte.weight": t.get("embedding.word_embeddings.weight"),
           "transformer.wpe.weight": t.get("embedding.position_embeddings.weight")}
    for i in range(m["num_layers"]):
        yield _gpt2_layer_to_hf(t, f"transformer.h.{i}.", f"decoder.layers.{i}.", m)
    yield _output_layer_to_hf(t, m, {
        "transformer.ln_f.weight": t.norm("decoder.final_layernorm.weight", m["apply_layernorm_1p"]),
        "transformer.ln_f.bias": t.get("decoder.final_layernorm.bias")})


def _gpt2_layer_to_hf(t: _MegaliteTensors, hf: str, mg: str, m: dict) -> dict[str, torch.Tensor]:
    h, heads, d, ffn = m["hidden_size"], m["num_attention_heads"], m["kv_channels"], m["ffn_hidden_size"]
    out = {}
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
    return out


# ==================================================================================================
# Public API
# ==================================================================================================
def hf_to_megalite(hf_dir: str, output_dir: str, overwrite: bool = False, log=warn) -> str:
    """Convert a Hugging Face model directory into a megalite checkpoint at iteration 0 under
    ``output_dir``; returns the published iteration directory. Tokenizer files, when present, are
    copied into ``<iter dir>/tokenizer`` and recorded (relative to the iteration directory) so that
    ``--use-checkpoint-args`` and generation find them."""
    config = read_hf_config(hf_dir)
    model_type = config.model_type
    check_convertible(config, log)
    m = {**extra_defaults(), **model_fields(config), **deepseek_source(config)}
    _check_output_free(output_dir, overwrite, kind="megalite")

    fp8_block = None if model_type == GPT_OSS else block_size(config)       # GPT-OSS refuses quantisation itself
    weights = HFWeights(hf_dir, "transformer." if model_type == "gpt2" else "model.", fp8_block,
                        getattr(torch, dtype_name(config) or "bfloat16"))
    family = {}                     # what an export needs to write the checkpoint back as it was
    if model_type in DEEPSEEK_MODEL_TYPES:
        m["mtp_num_layers"] = mtp_depth(weights, m, log)
        family = {**deepseek_source(config), "mtp_copies": mtp_copies(weights, m)}
    parts = gpt2_to_megalite(weights, m) if model_type == "gpt2" else llama_like_to_megalite(weights, m, model_type)
    stored = _StoredDtypes(hf_dir, m, dtype_name(config))
    # written part by part into iter_0000000.tmp (tokenizer included) and published by one rename, as
    # training saves; what a refused model leaves half-written is removed
    with _removed_on_error(output_dir, temporary_dir(output_dir, 0)):
        _make_output_dir(output_dir)
        tmp = prepare_temporary_dir(output_dir, 0)
        index = write_megalite_parts(tmp, parts, stored)
        weights.check_all_used()
    model = {**{k: m[k] for k in ARCHITECTURE_FIELDS + EXTRA_FIELDS}, "params_dtype": stored.params_dtype}
    tokenizer = None
    if tokenizer_files(hf_dir):
        copy_tokenizer(hf_dir, os.path.join(tmp, TOKENIZER_SUBDIR))
        if not names_tokenizer_class(hf_dir):
            # AutoTokenizer then picks the class from config.json's model_type; keep it next to the files
            shutil.copyfile(os.path.join(hf_dir, "config.json"), os.path.join(tmp, TOKENIZER_SUBDIR, "config.json"))
        tokenizer = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": TOKENIZER_SUBDIR,
                     "vocab_file": None, "merge_file": None, "vocab_size": None}
    metadata = {"iteration": 0, "model": model, "tokenizer": tokenizer, "tensors": index,
                "source": {"format": "huggingface", "model_type": model_type,
                           "architectures": list(getattr(config, "architectures", None) or []),
                           "path": os.path.abspath(hf_dir), **config_token_ids(config),
                           **moe_training_settings(config), **family}}
    write_metadata(tmp, metadata)
    return publish(output_dir, 0)


def megalite_to_hf(checkpoint_dir: str, output_dir: str, model_type: str | None = None, overwrite: bool = False,
                   log=warn, fp8_blocks: bool = False) -> str:
    """Export a megalite checkpoint (a save directory or an iter_N directory) as a Hugging Face model
    directory: config.json, model.safetensors and the checkpoint's tokenizer files. Training-state
    tensors (optimizer.*) are not exported. ``fp8_blocks``: the layers' projections as 128x128
    block-scaled FP8 (hf_fp8.py). Returns ``output_dir``."""
    if not os.path.isdir(checkpoint_dir):
        raise UserError(f"--input {checkpoint_dir}: no such directory; give a megalite checkpoint directory")
    if not any(os.path.isfile(os.path.join(checkpoint_dir, f)) for f in (TRACKER, METADATA)):
        raise UserError(f"--input {checkpoint_dir} has no {TRACKER} and no {METADATA}; is it a megalite checkpoint "
                        "directory? (convert a Hugging Face model with --from hf --to megalite)")
    reader = CheckpointReader(checkpoint_dir)
    meta = reader.metadata
    m = meta.get("model")
    m = {**extra_defaults(), **with_architecture_defaults(m)} if isinstance(m, dict) else m
    if not isinstance(m, dict) or any(k not in m for k in ARCHITECTURE_FIELDS):
        raise UserError(f"checkpoint {reader.directory}: metadata.json has no complete model description")
    if not m["num_experts"] and reader.names("decoder.layers.") and any(
            n.endswith(".mlp.router.weight") for n in reader.names("decoder.layers.")):
        raise UserError(f"checkpoint {reader.directory} holds MoE layers (mlp.router) but its metadata.json "
                        "describes a dense model (no num_experts); it was saved without its MoE fields")
    model_type = model_type or default_model_type(meta)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"--model-type {model_type} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    check_representable(m, model_type)
    _check_output_free(output_dir, overwrite, kind="hf")

    # zero biases (see _MegaliteTensors) take the stored weights' dtype, so the file has one dtype
    tensors = _MegaliteTensors(reader, reader.dtype("embedding.word_embeddings.weight"))
    source = meta.get("source") or {}
    m["rope_interleave"] = source.get("rope_interleave", True)      # DeepSeek's RoPE rows (hf_deepseek.py)
    parts = megalite_to_gpt2(tensors, m) if model_type == "gpt2" else megalite_to_llama_like(
        tensors, m, model_type, source.get("mtp_copies", MTP_COPIES))

    with _removed_on_error(output_dir):
        _make_output_dir(output_dir)
        if overwrite:
            _remove_previous_export(output_dir)
        has_tokenizer = export_tokenizer(meta.get("tokenizer"), reader.directory, output_dir, log)
        token_ids = {k: source[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in source}
        if not token_ids and has_tokenizer:
            token_ids = {k: v for k, v in token_ids_from_tokenizer(output_dir).items() if v is not None}
        config = build_hf_config(m, model_type, token_ids, source)
        if fp8_blocks:
            config.quantization_config = quantization_config()
        # each file is written under a temporary name and renamed (hf_shards.py); config.json last, so an
        # interrupted export never leaves a directory that loads with the wrong weights
        write_hf_parts(output_dir, parts, quantize_checkpoint if fp8_blocks else _unchanged)
        with quiet_transformers():
            config_tmp = os.path.join(output_dir, "config.json.tmp")
            config.to_json_file(config_tmp)
        os.replace(config_tmp, os.path.join(output_dir, "config.json"))
    return output_dir


class _StoredDtypes:
    """Each converted part as megalite stores it: float32/bfloat16/float16, a float64 tensor cast to the
    params dtype: config.json's, else the embedding's. The embedding comes in the first part, whose
    rows are checked against the vocabulary first."""

    def __init__(self, hf_dir: str, m: dict, params_dtype: str | None):
        self.hf_dir, self.vocab_size, self.params_dtype = hf_dir, m["vocab_size"], params_dtype

    def __call__(self, part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        embeddings = part.get("embedding.word_embeddings.weight")
        if embeddings is not None:
            if embeddings.shape[0] != self.vocab_size:
                raise UserError(f"--input {self.hf_dir}: config.json says vocab_size={self.vocab_size} but the "
                                f"embeddings have {embeddings.shape[0]} rows")
            self.params_dtype = self.params_dtype or DTYPE_NAMES.get(embeddings.dtype, "float32")
        dtype = getattr(torch, self.params_dtype)
        return {n: t if t.dtype in DTYPE_NAMES else t.to(dtype) for n, t in part.items()}


def _unchanged(part: dict) -> dict:
    return part


@contextlib.contextmanager
def _removed_on_error(output_dir: str, *written: str):
    """On an error, remove the ``written`` directories and ``output_dir`` itself where it did not exist before."""
    existed = os.path.exists(output_dir)
    try:
        yield
    except BaseException:
        for path in written:
            shutil.rmtree(path, ignore_errors=True)
        if not existed:
            shutil.rmtree(output_dir, ignore_errors=True)
        raise


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
