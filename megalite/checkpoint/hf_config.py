"""Hugging Face configs <-> megalite's model description (metadata["model"]), one mapping for every user.

Conversion (hf.py) and the parallelism planner (megalite/planning) read a config.json through
``load_hf_config`` and map it with ``model_fields``; conversion first refuses, with ``check_convertible``,
what megalite cannot represent exactly, while the planner only needs the shapes (scaled RoPE, say, has
the memory and time of plain RoPE). The reverse direction, ``build_hf_config``, writes the config of an
exported checkpoint.

Families: Llama 1/2/3, Mistral, Qwen2 (q/k/v biases), Qwen3 (QK-norm), Phi-3 (fused projections, partial
rotary) and the Mixture-of-Experts Mixtral, Qwen2-MoE (gated shared expert) and Qwen3-MoE share one mapping
(RoPE, RMSNorm, SwiGLU, GQA); GPT-OSS, GLM-4.5 and DeepSeek-V3 share it with their own differences
(hf_gpt_oss.py, hf_deepseek.py); GPT-2 (learned positions, LayerNorm, GELU, biases) has its own.

MoE (``moe_fields``): HF layer i (0-based) is sparse when i is not in ``mlp_only_layers`` and (i + 1) is a
multiple of ``decoder_sparse_step``; megalite's --moe-layer-freq is that 0/1 list (1 when every layer is).
Routers: Mixtral and ``norm_topk_prob=True`` renormalise the top-k softmax weights (= softmax over the
top-k logits, megalite's default); ``norm_topk_prob=False`` keeps the softmax over all experts
(--moe-router-pre-softmax). HF adds ``router_aux_loss_coef`` x its load-balancing loss only with
``output_router_logits``; that is when it maps to --moe-aux-loss-coeff (HF pools the statistics of all
layers into one loss, Megatron adds one loss per layer: same coefficient, different normalisation).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

from megalite.checkpoint.files import ATTENTION_DEFAULTS, DEEPSEEK_DEFAULTS, VARIANT_DEFAULTS
from megalite.checkpoint.hf_deepseek import (DEEPSEEK_MODEL_TYPES, DEEPSEEK_V3, GLM4_MOE, build_deepseek_config,
                                             check_deepseek_convertible, check_deepseek_representable,
                                             deepseek_fields)
from megalite.checkpoint.hf_gpt_oss import (GPT_OSS, build_gpt_oss_config, check_gpt_oss_convertible,
                                            check_gpt_oss_representable, gpt_oss_fields)
from megalite.checkpoint.hf_moe import (MOE_MODEL_TYPES, MOE_TRAINING_KEYS, build_moe_config, check_moe_convertible,
                                        check_moe_representable, moe_fields)
from megalite.checkpoint.hf_window import (check_window_convertible, check_window_representable, window_config,
                                           window_fields)
from megalite.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe",
                         GPT_OSS, GLM4_MOE, DEEPSEEK_V3)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gpt2": "GPT2LMHeadModel",
                 "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", GPT_OSS: "GptOssForCausalLM",
                 GLM4_MOE: "Glm4MoeForCausalLM", DEEPSEEK_V3: "DeepseekV3ForCausalLM"}
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")            # RMSNorm of each q and k head (q_norm, k_norm)
QKV_BIAS_MODEL_TYPES = ("qwen2", "qwen2_moe")
# metadata["model"] fields a conversion records beyond files.ARCHITECTURE_FIELDS (the MoE layer, QK-norm);
# ModelConfig's defaults stand for a checkpoint that lacks them
EXTRA_FIELDS = ("qk_layernorm", "num_experts", "moe_layer_freq", "moe_ffn_hidden_size",
                "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_topk",
                "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
                "moe_router_enable_expert_bias")
DTYPE_NAMES = ("float32", "bfloat16", "float16")      # the parameter dtypes megalite stores
# GPT-2 activation names -> openai_gelu. gelu_new is the tanh approximation written out by hand
# (NewGELUActivation); it equals F.gelu(approximate="tanh") to float rounding.
GPT2_ACTIVATIONS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def quiet_transformers():
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


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# ---- reading config.json -------------------------------------------------------------------------------
def read_hf_config(hf_dir: str):
    """The transformers config of a Hugging Face model directory (conversion's --input)."""
    if not os.path.isdir(hf_dir):
        raise UserError(f"--input {hf_dir}: no such directory; give a Hugging Face model directory "
                        "(with config.json and model.safetensors)")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"--input {hf_dir} is not a Hugging Face model directory (no config.json there)")
    return load_hf_config(path, hf_dir, "--input")


def read_hf_config_file(path: str, flag: str = "--hf-config"):
    """The transformers config of a config.json, or of a model directory holding one (the planner's input)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise UserError(f"{flag} {path}: no such file (give a config.json or a model directory holding one)")
    return load_hf_config(file, path, flag)


def load_hf_config(file: str, location: str, flag: str):
    """``file`` (config.json) read by transformers from ``location`` (local only, never remote code), for a
    supported family; one-line errors naming ``flag`` for bad input."""
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{flag} {file} is not valid JSON ({first_line(e)})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"{flag} {location}: model_type {model_type!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    with quiet_transformers():
        from transformers import AutoConfig
        try:
            return AutoConfig.from_pretrained(location, local_files_only=True, trust_remote_code=False)
        except Exception as e:      # transformers raises many types for a bad config; report the first line
            raise UserError(f"{flag} {file}: transformers cannot read it ({first_line(e)})") from None


def dtype_name(config) -> str | None:
    """HF config dtype (``dtype`` in transformers 5, ``torch_dtype`` before) as megalite's name."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if value is None:
        return None
    name = str(value).replace("torch.", "")
    return name if name in DTYPE_NAMES else None


def extra_defaults() -> dict:
    """EXTRA_FIELDS at ModelConfig's defaults (a dense model without QK-norm)."""
    import dataclasses
    from megalite.config.schema import ModelConfig
    return {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in EXTRA_FIELDS}


def config_token_ids(config) -> dict:
    """bos/eos/pad ids, recorded so an export writes the model's own (LlamaConfig defaults to 1/2)."""
    return {key: getattr(config, key, None) for key in TOKEN_ID_KEYS}


# ---- Hugging Face -> megalite --------------------------------------------------------------------------
def rope_parameters(config) -> dict:
    """The RoPE parameters from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``
    (4.x); per-layer-type parameters (a dict of dicts) give their first entry."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = next(iter(params.values()))
    if not params:
        params = {"rope_type": "default", "rope_theta": getattr(config, "rope_theta", 10000.0)}
        scaling = getattr(config, "rope_scaling", None)
        if scaling:
            params.update(scaling)
    return params


def check_one_rope(config) -> None:
    """RoPE parameters that differ per layer type are refused: megalite has one RoPE for all layers."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
        if len(distinct) > 1:
            raise UserError(f"model has different RoPE parameters per layer type ({', '.join(params)}); "
                            "megalite has one RoPE for all layers")


def check_rope(config, partial_rotary: bool = False) -> None:
    """Scaled RoPE (llama3, yarn, linear, dynamic, ...) has no megalite equivalent and is refused, and so
    are RoPE parameters that differ per layer type and ``partial_rotary_factor`` unless the family applies
    it (``partial_rotary``: see rotary_factor)."""
    check_one_rope(config)
    params = rope_parameters(config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise UserError(f"rope scaling rope_type={rope_type!r} is not supported: megalite implements plain RoPE "
                        "only (rope_type 'default')")
    if params.get("partial_rotary_factor", 1.0) != 1.0 and not partial_rotary:
        raise UserError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported for "
                        f"{config.model_type}: its RoPE ignores the factor (Phi-3 applies it)")


def rotary_factor(config) -> float:
    """Phi-3's ``partial_rotary_factor`` (in ``rope_parameters`` in transformers 5, or top level)."""
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        params = next(iter(params.values()))
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return float(factor) if factor is not None else 1.0


def check_convertible(config, log=warn) -> None:
    """Refuse (one line) what megalite cannot represent exactly."""
    model_type = config.model_type
    if model_type == "gpt2":
        act = config.activation_function
        if act not in GPT2_ACTIVATIONS:
            raise UserError(f"gpt2 activation_function={act!r} is not supported (supported: "
                            f"{', '.join(GPT2_ACTIVATIONS)})")
        if not getattr(config, "scale_attn_weights", True) or getattr(config, "scale_attn_by_inverse_layer_idx", False):
            raise UserError("gpt2 attention scaling other than 1/sqrt(head_dim) (scale_attn_weights=False or "
                            "scale_attn_by_inverse_layer_idx=True) is not supported")
        if getattr(config, "add_cross_attention", False):
            raise UserError("gpt2 add_cross_attention=True (an encoder-decoder variant) is not supported")
        return
    if model_type == GPT_OSS:          # hf_gpt_oss.py: its biases, YaRN, experts
        check_one_rope(config)
        check_gpt_oss_convertible(config, rope_parameters(config))
        check_window_convertible(config)
        return
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UserError(f"hidden_act={config.hidden_act!r} is not supported: megalite's SwiGLU uses silu")
    if getattr(config, "attention_bias", False) and model_type != GLM4_MOE:      # GLM: q/k/v biases only
        raise UserError(f"{model_type} attention_bias=True is not supported: megalite has q/k/v biases "
                        "(add_qkv_bias) but no o_proj bias without MLP biases")
    if getattr(config, "mlp_bias", False):
        raise UserError(f"{model_type} mlp_bias=True is not supported: megalite's MLP biases come only with "
                        "biases on every linear layer")
    if model_type in DEEPSEEK_MODEL_TYPES:
        check_one_rope(config)
        check_deepseek_convertible(config, rope_parameters(config))
    if model_type != DEEPSEEK_V3:            # DeepSeek-V3's YaRN: check_deepseek_convertible
        check_rope(config, partial_rotary=model_type in ("phi3", GLM4_MOE))
    head_dim, factor = _head_dim(config), _rotary_percent(config)
    if factor != 1.0 and (int(head_dim * factor) % 2 or int(head_dim * factor) < 2):
        raise UserError(f"partial_rotary_factor={factor} rotates {int(head_dim * factor)} of {head_dim} head dimensions; "
                        "megalite needs an even number >= 2")
    if model_type in MOE_MODEL_TYPES:
        check_moe_convertible(config, log)
    check_window_convertible(config)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rotary_percent(config) -> float:
    return rotary_factor(config) if config.model_type in ("phi3", GLM4_MOE) else 1.0


def model_fields(config) -> dict:
    """metadata["model"] (megalite's architecture fields) for a supported transformers config; the
    sequence length is the model's ``max_position_embeddings``."""
    if config.model_type == "gpt2":
        return {**ATTENTION_DEFAULTS, **VARIANT_DEFAULTS, **DEEPSEEK_DEFAULTS, **gpt2_fields(config)}
    fields = {**ATTENTION_DEFAULTS, **VARIANT_DEFAULTS, **DEEPSEEK_DEFAULTS, **llama_like_fields(config),
              **window_fields(config)}
    if config.model_type == GPT_OSS:
        fields.update(gpt_oss_fields(config, rope_parameters(config)))
    if config.model_type in DEEPSEEK_MODEL_TYPES:
        fields.update(deepseek_fields(config, rope_parameters(config)))
    return fields


def llama_like_fields(config) -> dict:
    """Llama 1/2/3, Mistral, Qwen2 and Phi-3: RoPE, RMSNorm, SwiGLU, GQA; Qwen2 adds q/k/v biases, Phi-3
    partial rotary."""
    nq = config.num_attention_heads
    return {
        "num_layers": config.num_hidden_layers, "hidden_size": config.hidden_size, "num_attention_heads": nq,
        "ffn_hidden_size": config.intermediate_size, "kv_channels": _head_dim(config),
        "num_query_groups": getattr(config, "num_key_value_heads", None) or nq,
        "seq_length": config.max_position_embeddings, "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size, "position_embedding_type": "rope",
        "rotary_base": float(rope_parameters(config).get("rope_theta", 10000.0)),
        "normalization": "RMSNorm", "norm_epsilon": float(config.rms_norm_eps), "swiglu": True, "openai_gelu": False,
        "add_bias_linear": False, "add_qkv_bias": _has_qkv_bias(config),
        "untie_embeddings_and_output_weights": not getattr(config, "tie_word_embeddings", False),
        "rotary_percent": _rotary_percent(config), "apply_layernorm_1p": False,
        "qk_layernorm": config.model_type in QK_NORM_MODEL_TYPES, **moe_fields(config),
    }


def _has_qkv_bias(config) -> bool:
    """Qwen2 always has q/k/v biases, Qwen2-MoE unless ``qkv_bias=False`` (transformers 5)."""
    return config.model_type == "qwen2" or (config.model_type == "qwen2_moe" and getattr(config, "qkv_bias", True))


def gpt2_fields(config) -> dict:
    """GPT-2: learned positions, LayerNorm with biases, GELU, biases on every linear layer, MHA."""
    h, heads = config.n_embd, config.n_head
    return {
        "num_layers": config.n_layer, "hidden_size": h, "num_attention_heads": heads,
        "ffn_hidden_size": config.n_inner or 4 * h, "kv_channels": h // heads, "num_query_groups": heads,
        "seq_length": config.n_positions, "max_position_embeddings": config.n_positions,
        "vocab_size": config.vocab_size, "position_embedding_type": "learned_absolute", "rotary_base": 10000.0,
        "normalization": "LayerNorm", "norm_epsilon": float(config.layer_norm_epsilon), "swiglu": False,
        "openai_gelu": GPT2_ACTIVATIONS.get(config.activation_function, True), "add_bias_linear": True,
        "add_qkv_bias": False, "untie_embeddings_and_output_weights": not getattr(config, "tie_word_embeddings", True),
        "rotary_percent": 1.0, "apply_layernorm_1p": False,
    }


def dropout_fields(config) -> dict:
    """The model's training dropout as megalite's hidden_dropout / attention_dropout (the planner's
    activation estimate depends on it): GPT-2's resid_pdrop / attn_pdrop, Phi-3's resid_pdrop, none in
    the residual stream of Llama, Mistral and Qwen2."""
    if config.model_type == "gpt2":
        return {"hidden_dropout": float(config.resid_pdrop), "attention_dropout": float(config.attn_pdrop)}
    hidden = float(config.resid_pdrop) if config.model_type == "phi3" else 0.0
    return {"hidden_dropout": hidden, "attention_dropout": float(getattr(config, "attention_dropout", 0.0))}


# ---- megalite -> Hugging Face --------------------------------------------------------------------------
def default_model_type(metadata: dict) -> str:
    """The family a checkpoint came from, else the one its architecture implies."""
    source = metadata.get("source") or {}
    if source.get("model_type") in SUPPORTED_MODEL_TYPES:
        return source["model_type"]
    m = metadata["model"]
    if m["position_embedding_type"] == "learned_absolute" and m["normalization"] == "LayerNorm":
        return "gpt2"
    if m.get("multi_latent_attention"):
        return DEEPSEEK_V3
    if m.get("moe_router_score_function") == "sigmoid" and m.get("moe_router_enable_expert_bias"):
        return GLM4_MOE
    if m.get("rotary_percent", 1.0) != 1.0:
        return "phi3"
    if m.get("softmax_type") == "learnable" or m.get("quick_geglu"):
        return GPT_OSS
    if m.get("num_experts"):
        return "qwen3_moe" if m.get("qk_layernorm") else "qwen2_moe" if m.get("moe_shared_expert_intermediate_size") \
            else "mixtral"
    if m.get("qk_layernorm"):
        return "qwen3"
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
    if model_type == GPT_OSS:
        check_gpt_oss_representable(m, need)
        check_window_representable(m, model_type, need)
        return
    if model_type in DEEPSEEK_MODEL_TYPES:
        check_deepseek_representable(m, model_type, need)
        check_window_representable(m, model_type, need)
        return
    need(m["position_embedding_type"] == "rope", f"{model_type} uses RoPE, the checkpoint "
         f"{m['position_embedding_type']} position embeddings")
    need(m["normalization"] == "RMSNorm", f"{model_type} uses RMSNorm, the checkpoint {m['normalization']}")
    need(m["swiglu"], f"{model_type} has a SwiGLU MLP, the checkpoint a GELU MLP")
    need(not m["add_bias_linear"], f"{model_type} has no biases on its linear layers (add_bias_linear=True)")
    if model_type not in QKV_BIAS_MODEL_TYPES:
        need(not m["add_qkv_bias"], f"{model_type} has no q/k/v biases (add_qkv_bias=True); use --model-type qwen2 "
             "or qwen2_moe")
    if model_type != "phi3":
        need(m["rotary_percent"] == 1.0, f"{model_type}'s RoPE rotates whole heads, the checkpoint has "
             f"--rotary-percent {m['rotary_percent']:g}; use --model-type phi3")
    if model_type in QK_NORM_MODEL_TYPES:
        need(m["qk_layernorm"], f"{model_type} normalises q and k per head, the checkpoint has no --qk-layernorm")
    else:
        need(not m["qk_layernorm"], f"{model_type} has no q/k norms (--qk-layernorm); use --model-type qwen3 or "
             "qwen3_moe")
    check_moe_representable(m, model_type, need)
    check_window_representable(m, model_type, need)


def build_hf_config(m: dict, model_type: str, token_ids: dict, source: dict | None = None):
    """The transformers config object for metadata["model"] ``m`` (already checked representable);
    ``source``: the converted model's metadata["source"], whose MOE_TRAINING_KEYS (else the family's
    defaults) and DeepSeek RoPE layout are written back."""
    source = source or {}
    moe_training = {k: source[k] for k in MOE_TRAINING_KEYS if k in source}
    with quiet_transformers():
        from transformers import GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config
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
                      hidden_act="silu", rope_parameters=rope, **window_config(m, model_type), **common)
        if model_type == "phi3":
            rope["partial_rotary_factor"] = float(m["rotary_percent"])
            # Phi3Config's own token ids (eos/pad 32000) belong to Phi-3's vocabulary, not this model's
            ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
            return Phi3Config(original_max_position_embeddings=m["max_position_embeddings"],
                              **{**ids, **fields})
        if model_type == GPT_OSS:
            return build_gpt_oss_config(m, fields, moe_training)
        if model_type in DEEPSEEK_MODEL_TYPES:
            return build_deepseek_config(m, model_type, fields, rope, source)
        if model_type in MOE_MODEL_TYPES:
            return build_moe_config(m, model_type, fields, moe_training)
        if model_type == "llama":
            return LlamaConfig(attention_bias=False, mlp_bias=False, **fields)
        if model_type == "mistral":
            return MistralConfig(**fields)
        if model_type == "qwen3":
            return Qwen3Config(attention_bias=False, **fields)
        return Qwen2Config(**fields)


def token_ids_from_tokenizer(directory: str) -> dict:
    """bos/eos/pad ids of the tokenizer in ``directory`` (empty when it cannot be loaded)."""
    try:
        with quiet_transformers():
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except Exception:       # a tokenizer transformers cannot load: keep the config class defaults
        return {}
    return {k: getattr(tok, k, None) for k in TOKEN_ID_KEYS}
