"""The DeepSeek-V3 family in the Hugging Face conversion: ``deepseek_v3`` (DeepSeek-V3/V3.1, Kimi K2, and
DeepSeek-V2-Lite's form with q_lora_rank None) and ``glm4_moe`` (GLM-4.5), both ways.

Their MoE layers (both families), HF -> megalite:
    n_routed_experts (GLM: n_routed_experts), num_experts_per_tok  -> --num-experts, --moe-router-topk
    moe_intermediate_size, n_shared_experts x it                 -> --moe-ffn-hidden-size, shared expert size
    first_k_dense_replace K: layers 0..K-1 dense                 -> --moe-layer-freq [0]*K + [1]*(L-K)
    scoring sigmoid, e_score_correction_bias                      -> --moe-router-score-function sigmoid,
                                                                     --moe-router-enable-expert-bias (expert_bias)
    routed_scaling_factor                                        -> --moe-router-topk-scaling-factor
    n_group G, topk_group g (when G > 1; groups scored by their top-2 = topk / g)
                                                                 -> --moe-router-num-groups, --moe-router-group-topk
    mlp.gate.weight / e_score_correction_bias                    -> mlp.router.weight / expert_bias
    mlp.shared_experts.gate_proj, up_proj / down_proj            -> mlp.shared_experts.linear_fc1 / fc2
megalite renormalises the sigmoid top-k weights (norm_topk_prob True); False is refused.

GLM-4.5's attention is Llama-like (hf.py): GQA, q/k/v biases (attention_bias), optional per-head QK-norm
(use_qk_norm), RoPE on the first partial_rotary_factor of each head in the rotate-half layout
(--rotary-percent).

DeepSeek's multi-latent attention, HF ``self_attn.`` -> megalite ``self_attention.``:
    q_a_proj, q_a_layernorm, q_b_proj (q_proj without q-LoRA)   -> linear_q_down_proj, q_layernorm, linear_q_up_proj
                                                                   (linear_q_proj)
    kv_a_proj_with_mqa [latent; shared RoPE key], kv_a_layernorm -> linear_kv_down_proj, kv_layernorm
    kv_b_proj [per head: k no-RoPE; v], o_proj                   -> linear_kv_up_proj, linear_proj
With ``rope_interleave`` HF's RoPE rows are interleaved pairs (x0, x1), (x2, x3), ...; megalite rotates
halves, so the RoPE rows of each q head and of the shared key are reordered even indices first, then odd
(q.k is unchanged); export undoes it.

Multi-token prediction: DeepSeek-V3 ships depth k as ``model.layers.{L + k}`` (transformers ignores it):
enorm, hnorm, eh_proj, shared_head.norm -> mtp.layers.{k}.enorm, hnorm, eh_proj, final_layernorm, and the
layer's attention and MLP -> mtp.layers.{k}.transformer_layer.*; its embed_tokens and shared_head.head
copies of the main model's are checked equal and written back on export.
"""
from __future__ import annotations

import torch

from megalite.checkpoint.hf_moe import megalite_to_moe, moe_to_megalite
from megalite.errors import UserError

DEEPSEEK_V3, GLM4_MOE = "deepseek_v3", "glm4_moe"
DEEPSEEK_MODEL_TYPES = (DEEPSEEK_V3, GLM4_MOE)
GROUP_SCORE_TOPK = 2            # HF scores an expert group by the sum of its top-2 scores
EXPERTS_AS = "qwen3_moe"        # the same per-expert gate_proj / up_proj / down_proj names, no shared gate


# ---- config ------------------------------------------------------------------------------------------
def check_deepseek_convertible(config) -> None:
    """What megalite cannot represent of a DeepSeek-V3 / GLM-4.5 config (one line)."""
    if config.hidden_act != "silu":
        raise UserError(f"hidden_act={config.hidden_act!r} is not supported: megalite's SwiGLU uses silu")
    if not config.norm_topk_prob:
        raise UserError(f"{config.model_type} norm_topk_prob=False is not supported: megalite renormalises the "
                        "sigmoid top-k routing weights")
    groups = config.n_group or 1
    if groups > 1 and config.num_experts_per_tok != GROUP_SCORE_TOPK * config.topk_group:
        raise UserError(f"{config.model_type} scores expert groups by their top-{GROUP_SCORE_TOPK}, megalite by "
                        f"their top-(topk / group topk) = {config.num_experts_per_tok}/{config.topk_group}; they "
                        "must agree (num_experts_per_tok = 2 x topk_group)")
    if config.model_type == DEEPSEEK_V3 and config.attention_bias:
        raise UserError("deepseek_v3 attention_bias=True is not supported: megalite's MLA has no biases")


def deepseek_moe_fields(config) -> dict:
    layers, dense = config.num_hidden_layers, config.first_k_dense_replace or 0
    groups = config.n_group or 1
    return {"num_experts": config.n_routed_experts, "moe_router_topk": config.num_experts_per_tok,
            "moe_layer_freq": 1 if dense == 0 else [int(i >= dense) for i in range(layers)],
            "moe_ffn_hidden_size": config.moe_intermediate_size,
            "moe_shared_expert_intermediate_size": config.moe_intermediate_size * config.n_shared_experts or None,
            "moe_shared_expert_gate": False, "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True, "moe_router_pre_softmax": False,
            "moe_router_topk_scaling_factor": float(config.routed_scaling_factor),
            "moe_router_num_groups": groups if groups > 1 else None,
            "moe_router_group_topk": config.topk_group if groups > 1 else None, "moe_aux_loss_coeff": 0.0}


def deepseek_fields(config, rope: dict) -> dict:
    """The fields of metadata["model"] where the family differs from the Llama-like mapping (``rope``: its
    RoPE parameters)."""
    fields = deepseek_moe_fields(config)
    if config.model_type == GLM4_MOE:
        return {**fields, "add_qkv_bias": bool(config.attention_bias), "qk_layernorm": bool(config.use_qk_norm),
                "rotary_percent": float(rope.get("partial_rotary_factor", 1.0))}
    raise UserError(f"{config.model_type}: multi-latent attention is not converted yet (supported: {GLM4_MOE})")


def check_deepseek_representable(m: dict, model_type: str, need) -> None:
    need(m["num_experts"] and m["moe_router_score_function"] == "sigmoid" and m["moe_router_enable_expert_bias"]
         and not m["moe_router_pre_softmax"] and not m["moe_shared_expert_gate"],
         f"{model_type} routes by sigmoid scores with an expert bias and ungated shared experts")
    freq = m["moe_layer_freq"]
    pattern = [1] * m["num_layers"] if freq == 1 else list(freq) if isinstance(freq, list) else None
    need(pattern is not None and pattern == sorted(pattern), f"{model_type} has dense layers first, then MoE layers")
    need(m.get("multi_latent_attention", False) == (model_type == DEEPSEEK_V3),
         f"{model_type} uses {'multi-latent' if model_type == DEEPSEEK_V3 else 'grouped-query'} attention")
    need(not m["add_bias_linear"] and m["swiglu"] and m["normalization"] == "RMSNorm",
         f"{model_type} has a SwiGLU MLP, RMSNorm and no linear biases")


def build_deepseek_config(m: dict, model_type: str, fields: dict, rope: dict):
    """The transformers config of ``m`` from the Llama-like ``fields`` (hf_config.build_hf_config)."""
    from transformers import Glm4MoeConfig
    freq = m["moe_layer_freq"]
    groups = m.get("moe_router_num_groups") or 1
    moe = dict(n_routed_experts=m["num_experts"], num_experts_per_tok=m["moe_router_topk"],
               moe_intermediate_size=m["moe_ffn_hidden_size"],
               n_shared_experts=(m["moe_shared_expert_intermediate_size"] or 0) // m["moe_ffn_hidden_size"],
               first_k_dense_replace=0 if freq == 1 else list(freq).index(1), norm_topk_prob=True,
               routed_scaling_factor=m["moe_router_topk_scaling_factor"] or 1.0, n_group=groups,
               topk_group=m.get("moe_router_group_topk") or 1)
    if model_type == GLM4_MOE:
        rope["partial_rotary_factor"] = float(m["rotary_percent"])
        return Glm4MoeConfig(**{**fields, "rope_parameters": rope}, attention_bias=m["add_qkv_bias"],
                             use_qk_norm=m["qk_layernorm"], num_nextn_predict_layers=m.get("mtp_num_layers") or 0,
                             **moe)
    raise UserError(f"--model-type {model_type}: multi-latent attention is not exported yet")


# ---- tensors -----------------------------------------------------------------------------------------
def deepseek_moe_to_megalite(w, hf: str, mg: str, m: dict) -> dict:
    """One sparse layer's router, expert bias, experts and shared experts."""
    out = moe_to_megalite(w, hf, mg, m, EXPERTS_AS)
    out[mg + "mlp.router.expert_bias"] = w.take(hf + "mlp.gate.e_score_correction_bias").float()
    if m["moe_shared_expert_intermediate_size"]:
        shared = hf + "mlp.shared_experts."
        out[mg + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([w.take(shared + "gate_proj.weight"),
                                                                      w.take(shared + "up_proj.weight")])
        out[mg + "mlp.shared_experts.linear_fc2.weight"] = w.take(shared + "down_proj.weight")
    return out


def megalite_to_deepseek_moe(t, hf: str, mg: str, m: dict) -> dict:
    """Inverse of deepseek_moe_to_megalite."""
    out = megalite_to_moe(t, hf, mg, m, EXPERTS_AS)
    out[hf + "mlp.gate.e_score_correction_bias"] = t.get(mg + "mlp.router.expert_bias").float()
    if m["moe_shared_expert_intermediate_size"]:
        shared = hf + "mlp.shared_experts."
        gate, up = t.get(mg + "mlp.shared_experts.linear_fc1.weight").chunk(2)
        out[shared + "gate_proj.weight"], out[shared + "up_proj.weight"] = gate.clone(), up.clone()
        out[shared + "down_proj.weight"] = t.get(mg + "mlp.shared_experts.linear_fc2.weight")
    return out
