"""GPT-OSS (transformers' ``gpt_oss``) in the Hugging Face conversion: the parts of its config and tensors
that differ from the Llama-like families (hf_config.py and hf.py map the rest).

Config -> megalite:
    attention_bias, the router's and the experts' biases        -> biases on every linear (add_bias_linear);
                                                                   attention_bias=False is refused
    sinks (one learned logit per head)                          -> --softmax-type learnable
    sliding_window W on the "sliding_attention" layer_types     -> --window-size W-1,0 and
                                                                   --window-attn-skip-freq (hf_window.py)
    rope_parameters rope_type "yarn"                            -> --position-embedding-type yarn, factor ->
                                                                   --rotary-scaling-factor, beta_fast/slow,
                                                                   mscale/mscale_all_dim, truncate, original
                                                                   max positions (model/attention/rotary.py)
    experts: clamp(gate, max=L) sigmoid(1.702 ...) (clamp(up, -L, L) + 1)
                                                                -> --quick-geglu --glu-linear-offset 1
                                                                   --activation-func-clamp-value L
    router: top-k of the biased logits, softmax over the k      -> megalite's default softmax router
Refused in one line: swiglu_alpha other than 1.702, a quantised checkpoint (MXFP4 as published: dequantise
to bf16 first), partial rotary, an explicit YaRN attention_factor other than the one implied.

Tensors of a layer, HF -> megalite (E experts of hidden size f; model/moe.py's stacked layout):
    self_attn.sinks [heads]                      -> self_attention.softmax_offset
    self_attn.o_proj.bias [h]                    -> self_attention.linear_proj.bias
    mlp.router.weight / bias                     -> mlp.router.weight / bias
    mlp.experts.gate_up_proj [E, h, 2f], columns interleaved gate 0, up 0, gate 1, ...
                                                 -> mlp.experts.linear_fc1.weight [E*2f, h], rows [gate_e; up_e]
    mlp.experts.gate_up_proj_bias [E, 2f]        -> mlp.experts.linear_fc1.bias [E*2f] (same de-interleave)
    mlp.experts.down_proj [E, f, h]              -> mlp.experts.linear_fc2.weight [E*h, f]
    mlp.experts.down_proj_bias [E, h]            -> mlp.experts.linear_fc2.bias [E*h]
"""
from __future__ import annotations

import math

from megalite.errors import UserError

GPT_OSS = "gpt_oss"
QUICK_GELU_ALPHA = 1.702        # the sigmoid gain of Megatron's quick GELU, GPT-OSS's swiglu_alpha
YARN_KEYS = {"rope_type", "rope_theta", "factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "truncate", "original_max_position_embeddings", "attention_factor"}


# ---- config ------------------------------------------------------------------------------------------
def check_gpt_oss_convertible(config, rope: dict) -> None:
    """What megalite cannot represent of a GPT-OSS config (``rope``: its RoPE parameters)."""
    quantization = getattr(config, "quantization_config", None)      # probe: set only on a quantised model
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise UserError(f"gpt_oss quantization_config ({method}) is not supported: megalite converts unquantised "
                        "weights; dequantise the checkpoint to bf16 first")
    if config.swiglu_alpha != QUICK_GELU_ALPHA:
        raise UserError(f"gpt_oss swiglu_alpha={config.swiglu_alpha} is not supported: megalite's quick GEGLU has "
                        f"the gain {QUICK_GELU_ALPHA}")
    if not config.attention_bias:
        raise UserError("gpt_oss attention_bias=False is not supported: megalite's biases (the router's and the "
                        "experts' too) come on every linear layer together")
    check_yarn(config, rope)


def check_yarn(config, rope: dict) -> None:
    """RoPE parameters megalite's RoPE or YaRN reproduces (GPT-OSS, DeepSeek-V3), else one line."""
    model_type, rope_type = config.model_type, rope.get("rope_type", "default")
    if rope_type not in ("default", "yarn"):
        raise UserError(f"{model_type} rope_type={rope_type!r} is not supported (supported: 'default', 'yarn')")
    unknown = sorted(set(rope) - YARN_KEYS)
    if unknown:
        raise UserError(f"{model_type} rope_parameters {', '.join(unknown)} are not supported by megalite's RoPE")
    if rope_type == "yarn" and rope.get("attention_factor") is not None:
        implied = _attention_factor(yarn_fields(config, rope))
        if not math.isclose(rope["attention_factor"], implied, rel_tol=1e-12):
            raise UserError(f"{model_type} YaRN attention_factor={rope['attention_factor']} differs from the "
                            f"{implied} its factor and mscale imply; megalite derives it from them")


def yarn_fields(config, rope: dict) -> dict:
    """ModelConfig's YaRN fields for transformers' ``rope`` (its defaults where a key is absent)."""
    original = rope.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = rope.get("factor") or config.max_position_embeddings / original
    both = bool(rope.get("mscale") and rope.get("mscale_all_dim"))  # transformers uses the pair only together
    return {"rotary_scaling_factor": float(factor), "yarn_original_max_position_embeddings": int(original),
            "yarn_beta_fast": float(rope.get("beta_fast") or 32.0), "yarn_beta_slow": float(rope.get("beta_slow") or 1.0),
            "mscale": float(rope["mscale"]) if both else 1.0,
            "mscale_all_dim": float(rope["mscale_all_dim"]) if both else 0.0,
            "yarn_correction_range_round_to_int": bool(rope.get("truncate", True))}


def _attention_factor(m: dict) -> float:
    from megalite.model.attention.rotary import Yarn
    return Yarn(m["rotary_scaling_factor"], m["yarn_original_max_position_embeddings"], mscale=m["mscale"],
                mscale_all_dim=m["mscale_all_dim"]).attention_factor()


def gpt_oss_fields(config, rope: dict) -> dict:
    """The fields of metadata["model"] where GPT-OSS differs from the Llama-like mapping."""
    yarn = rope.get("rope_type") == "yarn"
    return {"swiglu": False, "quick_geglu": True, "glu_linear_offset": 1.0,
            "activation_func_clamp_value": float(config.swiglu_limit), "add_bias_linear": True,
            "softmax_type": "learnable", "position_embedding_type": "yarn" if yarn else "rope",
            **(yarn_fields(config, rope) if yarn else {}),
            "num_experts": config.num_local_experts, "moe_router_topk": config.num_experts_per_tok,
            "moe_aux_loss_coeff": float(config.router_aux_loss_coef if config.output_router_logits else 0.0)}


def check_gpt_oss_representable(m: dict, need) -> None:
    """What of a megalite checkpoint GPT-OSS cannot express (``need(ok, what)`` refuses)."""
    need(m["normalization"] == "RMSNorm", f"gpt_oss uses RMSNorm, the checkpoint {m['normalization']}")
    need(m["position_embedding_type"] in ("rope", "yarn") and m["rotary_percent"] == 1.0,
         "gpt_oss rotates whole heads by RoPE or YaRN, the checkpoint "
         f"{m['position_embedding_type']} at --rotary-percent {m['rotary_percent']:g}")
    need(m["softmax_type"] == "learnable", f"gpt_oss has learned attention sinks, the checkpoint --softmax-type "
         f"{m['softmax_type']}")
    need(m["add_bias_linear"], "gpt_oss has biases on every linear layer, the checkpoint --disable-bias-linear")
    need(m["quick_geglu"] and m["glu_linear_offset"] == 1.0 and m["activation_func_clamp_value"] is not None,
         "gpt_oss experts run the clamped quick GEGLU (--quick-geglu --glu-linear-offset 1 "
         "--activation-func-clamp-value L)")
    need(m["num_experts"] and (m["moe_layer_freq"] == 1 or all(m["moe_layer_freq"])),
         "gpt_oss has an MoE in every layer, the checkpoint "
         + (f"--moe-layer-freq {m['moe_layer_freq']}" if m["num_experts"] else "is dense"))
    need(m["moe_router_score_function"] == "softmax" and not m["moe_router_pre_softmax"]
         and not m["moe_router_topk_scaling_factor"] and not m["moe_router_enable_expert_bias"]
         and not m["moe_shared_expert_intermediate_size"],
         "gpt_oss routes by a softmax over the top-k logits, without scaling, expert bias or shared expert")
    need(not m["qk_layernorm"] and not m["add_qkv_bias"] and not m["apply_layernorm_1p"],
         "gpt_oss has no q/k norms, no separate q/k/v biases and plain norm weights")


def gpt_oss_rope(m: dict) -> dict:
    """transformers' rope_parameters for metadata["model"] ``m``."""
    rope = {"rope_type": "default", "rope_theta": float(m["rotary_base"])}
    if m["position_embedding_type"] != "yarn":
        return rope
    rope.update(rope_type="yarn", factor=m["rotary_scaling_factor"], beta_fast=m["yarn_beta_fast"],
                beta_slow=m["yarn_beta_slow"], truncate=m["yarn_correction_range_round_to_int"],
                original_max_position_embeddings=m["yarn_original_max_position_embeddings"]
                or m["max_position_embeddings"])
    if m["mscale"] and m["mscale_all_dim"]:
        rope.update(mscale=m["mscale"], mscale_all_dim=m["mscale_all_dim"])
    elif (m["mscale"], m["mscale_all_dim"]) != (1.0, 0.0):     # a pair transformers would not use: the factor
        rope["attention_factor"] = _attention_factor(m)
    return rope


def build_gpt_oss_config(m: dict, fields: dict, moe_training: dict):
    """The GptOssConfig of ``m`` from the Llama-like ``fields`` (hf_config.build_hf_config)."""
    from transformers import GptOssConfig
    training = {k: v for k, v in moe_training.items() if v is not None}
    return GptOssConfig(**{**fields, "intermediate_size": m["moe_ffn_hidden_size"] or m["ffn_hidden_size"],
                           "rope_parameters": gpt_oss_rope(m)},
                        num_local_experts=m["num_experts"], num_experts_per_tok=m["moe_router_topk"],
                        swiglu_limit=m["activation_func_clamp_value"], attention_bias=True, **training)


# ---- tensors -----------------------------------------------------------------------------------------
def gpt_oss_moe_to_megalite(w, hf: str, mg: str, m: dict) -> dict:
    """One layer's router and experts, HF -> megalite (module docstring)."""
    import torch
    block, E, h = hf + "mlp.", m["num_experts"], m["hidden_size"]
    f = m["moe_ffn_hidden_size"] or m["ffn_hidden_size"]
    gate_up, gate_up_bias = w.take(block + "experts.gate_up_proj"), w.take(block + "experts.gate_up_proj_bias")
    down = w.take(block + "experts.down_proj")
    for name, t, shape in (("gate_up_proj", gate_up, (E, h, 2 * f)), ("down_proj", down, (E, f, h))):
        if tuple(t.shape) != shape:
            raise UserError(f"--input {w.hf_dir}: {block}experts.{name} has shape {list(t.shape)}, config.json "
                            f"implies {list(shape)}")
    fc1 = gate_up.transpose(1, 2)                                               # [E, 2f, h] interleaved rows
    return {mg + "mlp.router.weight": w.take(block + "router.weight"),
            mg + "mlp.router.bias": w.take(block + "router.bias"),
            mg + "mlp.experts.linear_fc1.weight": torch.cat([fc1[:, 0::2], fc1[:, 1::2]], 1).reshape(E * 2 * f, h),
            mg + "mlp.experts.linear_fc1.bias": torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], 1).reshape(-1),
            mg + "mlp.experts.linear_fc2.weight": down.transpose(1, 2).reshape(E * h, f),
            mg + "mlp.experts.linear_fc2.bias": w.take(block + "experts.down_proj_bias").reshape(-1)}


def megalite_to_gpt_oss_moe(t, hf: str, mg: str, m: dict) -> dict:
    """Inverse of gpt_oss_moe_to_megalite."""
    import torch
    block, E, h = hf + "mlp.", m["num_experts"], m["hidden_size"]
    f = m["moe_ffn_hidden_size"] or m["ffn_hidden_size"]
    fc1 = t.get(mg + "mlp.experts.linear_fc1.weight").view(E, 2, f, h)
    fc1_bias = t.get(mg + "mlp.experts.linear_fc1.bias").view(E, 2, f)
    return {block + "router.weight": t.get(mg + "mlp.router.weight"),
            block + "router.bias": t.get(mg + "mlp.router.bias"),
            block + "experts.gate_up_proj": torch.stack([fc1[:, 0], fc1[:, 1]], 2).reshape(E, 2 * f, h).transpose(1, 2),
            block + "experts.gate_up_proj_bias": torch.stack([fc1_bias[:, 0], fc1_bias[:, 1]], 2).reshape(E, 2 * f),
            block + "experts.down_proj": t.get(mg + "mlp.experts.linear_fc2.weight").view(E, h, f).transpose(1, 2),
            block + "experts.down_proj_bias": t.get(mg + "mlp.experts.linear_fc2.bias").view(E, h)}
