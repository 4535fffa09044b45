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

DeepSeek's multi-latent attention config: q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
v_head_dim -> --q-lora-rank, --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim, with
--qk-layernorm (the latents' norms); rope_parameters yarn (factor, original max positions, beta_fast/slow,
mscale with mscale_all_dim) -> --rope-type yarn and the YaRN flags, plain RoPE -> --rope-type rope.
transformers builds the latents' norms with eps 1e-6 whatever rms_norm_eps says; megalite's norms share
one --norm-epsilon, so another rms_norm_eps is refused both ways. Its tensors, HF ``self_attn.`` ->
megalite ``self_attention.``:
    q_a_proj, q_a_layernorm, q_b_proj (q_proj without q-LoRA)   -> linear_q_down_proj, q_layernorm, linear_q_up_proj
                                                                   (linear_q_proj)
    kv_a_proj_with_mqa [latent; shared RoPE key], kv_a_layernorm -> linear_kv_down_proj, kv_layernorm
    kv_b_proj [per head: k no-RoPE; v], o_proj                   -> linear_kv_up_proj, linear_proj
With ``rope_interleave`` HF's RoPE rows are interleaved pairs (x0, x1), (x2, x3), ...; megalite rotates
halves, so the RoPE rows of each q head and of the shared key are reordered even indices first, then odd
(q.k is unchanged); export undoes it.

Multi-token prediction: DeepSeek-V3 and GLM-4.5 ship depth k as ``model.layers.{L + k}`` (transformers
ignores it; num_nextn_predict_layers -> --mtp-num-layers):
enorm, hnorm, eh_proj, shared_head.norm -> mtp.layers.{k}.enorm, hnorm, eh_proj, final_layernorm, and the
layer's attention and MLP -> mtp.layers.{k}.transformer_layer.*; its embed_tokens and shared_head.head
copies of the main model's are checked equal (megalite shares the main ones) and written back on export.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from megalite.checkpoint.hf_gpt_oss import check_yarn, gpt_oss_rope, yarn_fields
from megalite.checkpoint.hf_moe import is_sparse, megalite_to_moe, moe_to_megalite
from megalite.config.deepseek_fields import DeepSeekFields
from megalite.errors import UserError

DEEPSEEK_V3, GLM4_MOE = "deepseek_v3", "glm4_moe"
DEEPSEEK_MODEL_TYPES = (DEEPSEEK_V3, GLM4_MOE)
GROUP_SCORE_TOPK = 2            # HF scores an expert group by the sum of its top-2 scores
EXPERTS_AS = "qwen3_moe"        # the same per-expert gate_proj / up_proj / down_proj names, no shared gate
LATENT_NORM_EPS = 1e-6          # transformers' eps of q_a_layernorm / kv_a_layernorm, whatever rms_norm_eps says


# ---- config ------------------------------------------------------------------------------------------
def check_deepseek_convertible(config, rope: dict) -> None:
    """What megalite cannot represent of a DeepSeek-V3 / GLM-4.5 config (``rope``: its RoPE parameters),
    in one line."""
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
    if config.model_type == DEEPSEEK_V3:
        check_mla_convertible(config, rope)


def check_mla_convertible(config, rope: dict) -> None:
    """What megalite's multi-latent attention cannot reproduce of a deepseek_v3 config."""
    if config.attention_bias:
        raise UserError("deepseek_v3 attention_bias=True is not supported: megalite's MLA has no biases")
    if config.num_key_value_heads != config.num_attention_heads:
        raise UserError(f"deepseek_v3 num_key_value_heads={config.num_key_value_heads} differs from "
                        f"num_attention_heads={config.num_attention_heads}: every MLA head has its own keys and values")
    if config.rms_norm_eps != LATENT_NORM_EPS:
        raise UserError(f"deepseek_v3 rms_norm_eps={config.rms_norm_eps} is not supported: transformers normalises "
                        f"the q/kv latents with eps {LATENT_NORM_EPS} whatever rms_norm_eps says, megalite every norm "
                        "with one --norm-epsilon")
    check_yarn(config, rope)
    if rope.get("rope_type") == "yarn" and bool(rope.get("mscale")) != bool(rope.get("mscale_all_dim")):
        raise UserError(f"deepseek_v3 YaRN with mscale={rope.get('mscale')} and mscale_all_dim="
                        f"{rope.get('mscale_all_dim')} is not supported: transformers scales cos/sin by mscale only "
                        "together with mscale_all_dim but the softmax by mscale_all_dim alone; give both or neither")


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
    RoPE parameters). --mtp-num-layers is the config's num_nextn_predict_layers (conversion then counts the
    MTP layers the weights hold: mtp_depth)."""
    mtp = getattr(config, "num_nextn_predict_layers", 0)      # probe: DeepSeek's config.json has it, not the class
    fields = {**deepseek_moe_fields(config), "mtp_num_layers": mtp or None}
    if config.model_type == GLM4_MOE:
        return {**fields, "add_qkv_bias": bool(config.attention_bias), "qk_layernorm": bool(config.use_qk_norm),
                "rotary_percent": float(rope.get("partial_rotary_factor", 1.0))}
    yarn = rope.get("rope_type") == "yarn"
    return {**fields, "multi_latent_attention": True, "q_lora_rank": config.q_lora_rank,
            "kv_lora_rank": config.kv_lora_rank, "qk_head_dim": config.qk_nope_head_dim,
            "qk_pos_emb_head_dim": config.qk_rope_head_dim, "v_head_dim": config.v_head_dim, "qk_layernorm": True,
            "num_query_groups": config.num_attention_heads, "rope_type": "yarn" if yarn else "rope",
            **(yarn_fields(config, rope) if yarn else {})}


def deepseek_source(config) -> dict:
    """metadata["source"] entries an export needs to write the checkpoint back as it was: DeepSeek's RoPE
    row layout."""
    return {"rope_interleave": bool(config.rope_interleave)} if config.model_type == DEEPSEEK_V3 else {}


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
    if model_type == DEEPSEEK_V3:
        need(m["qk_layernorm"] and m["norm_epsilon"] == LATENT_NORM_EPS, "deepseek_v3 normalises the q/kv latents "
             f"(--qk-layernorm) with eps {LATENT_NORM_EPS}, and megalite's norms share one --norm-epsilon")
        need(not m["add_qkv_bias"] and m["rotary_percent"] == 1.0, "deepseek_v3 has no q/k/v biases and rotates "
             "the whole --qk-pos-emb-head-dim")
        need((m["mscale"], m["mscale_all_dim"]) == (1.0, 0.0) or (m["mscale"] and m["mscale_all_dim"]),
             "transformers' DeepSeek YaRN takes --mscale and --mscale-all-dim together (both non-zero) or neither")


def build_deepseek_config(m: dict, model_type: str, fields: dict, rope: dict, source: dict):
    """The transformers config of ``m`` from the Llama-like ``fields`` (hf_config.build_hf_config);
    ``source``: the converted model's metadata["source"] (DeepSeek's RoPE row layout, interleaved unless
    it says otherwise)."""
    from transformers import DeepseekV3Config, Glm4MoeConfig
    freq = m["moe_layer_freq"]
    groups = m.get("moe_router_num_groups") or 1
    moe = dict(n_routed_experts=m["num_experts"], num_experts_per_tok=m["moe_router_topk"],
               moe_intermediate_size=m["moe_ffn_hidden_size"],
               n_shared_experts=(m["moe_shared_expert_intermediate_size"] or 0) // m["moe_ffn_hidden_size"],
               first_k_dense_replace=0 if freq == 1 else list(freq).index(1), norm_topk_prob=True,
               routed_scaling_factor=m["moe_router_topk_scaling_factor"] or 1.0, n_group=groups,
               topk_group=m.get("moe_router_group_topk") or 1)
    mtp = m.get("mtp_num_layers") or 0
    if model_type == GLM4_MOE:
        rope["partial_rotary_factor"] = float(m["rotary_percent"])
        return Glm4MoeConfig(**{**fields, "rope_parameters": rope}, attention_bias=m["add_qkv_bias"],
                             use_qk_norm=m["qk_layernorm"], num_nextn_predict_layers=mtp, **moe)
    yarn = DeepSeekFields.uses_yarn.fget(SimpleNamespace(**m))
    rope = gpt_oss_rope({**m, "position_embedding_type": "yarn" if yarn else "rope"})
    return DeepseekV3Config(**{**fields, "rope_parameters": rope}, q_lora_rank=m["q_lora_rank"],
                            kv_lora_rank=m["kv_lora_rank"], qk_nope_head_dim=m["qk_head_dim"],
                            qk_rope_head_dim=m["qk_pos_emb_head_dim"], v_head_dim=m["v_head_dim"],
                            rope_interleave=source.get("rope_interleave", True), attention_bias=False,
                            num_nextn_predict_layers=mtp, **moe)


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


# ---- multi-latent attention --------------------------------------------------------------------------
# (HF self_attn name, megalite self_attention name, its RoPE rows: "q" in each head's block, "kv" at the
# end of the whole, None); q_proj without q-LoRA, q_a_proj / q_a_layernorm / q_b_proj with it
MLA_TENSORS = (("q_proj", "linear_q_proj", "q"), ("q_a_proj", "linear_q_down_proj", None),
               ("q_a_layernorm", "q_layernorm", None), ("q_b_proj", "linear_q_up_proj", "q"),
               ("kv_a_proj_with_mqa", "linear_kv_down_proj", "kv"), ("kv_a_layernorm", "kv_layernorm", None),
               ("kv_b_proj", "linear_kv_up_proj", None), ("o_proj", "linear_proj", None))


def _mla_tensors(m: dict):
    full_q = m["q_lora_rank"] is None
    return [t for t in MLA_TENSORS if (t[0] == "q_proj") == full_q or not t[0].startswith("q_")]


def _rope_rows(weight: torch.Tensor, rows: str | None, m: dict, to_megalite: bool) -> torch.Tensor:
    """``weight`` with the RoPE rows of each block (a q head's, or the kv down projection's whole) reordered
    from HF's interleaved pairs to even indices first, then odd (``to_megalite``), or back."""
    if rows is None or not m["rope_interleave"]:
        return weight
    rope = m["qk_pos_emb_head_dim"]
    block = m["qk_head_dim"] + rope if rows == "q" else weight.shape[0]
    order = torch.arange(block)
    order[block - rope:] = block - rope + torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    order = order if to_megalite else torch.argsort(order)
    return weight[torch.cat([b * block + order for b in range(weight.shape[0] // block)])]


def mla_to_megalite(w, attn: str, mg: str, m: dict) -> dict:
    """One layer's attention, HF ``attn`` = "model.layers.{i}.self_attn." -> megalite ``mg`` =
    "<layer>.self_attention." (module docstring)."""
    return {f"{mg}{ours}.weight": _rope_rows(w.take(f"{attn}{theirs}.weight"), rows, m, True)
            for theirs, ours, rows in _mla_tensors(m)}


def megalite_to_mla(t, attn: str, mg: str, m: dict) -> dict:
    """Inverse of mla_to_megalite."""
    return {f"{attn}{theirs}.weight": _rope_rows(t.get(f"{mg}{ours}.weight"), rows, m, False)
            for theirs, ours, rows in _mla_tensors(m)}


# ---- multi-token prediction --------------------------------------------------------------------------
# HF model.layers.{L + k}. name -> megalite mtp.layers.{k}. name
MTP_TENSORS = (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("shared_head.norm", "final_layernorm"))
MTP_COPIES = ("embed_tokens", "shared_head.head")      # each depth's copies of the main embedding and head


def _main_of(copy: str, m: dict, hf: bool) -> str:
    """The main model's tensor an MTP copy equals, by its HF (``hf``) or megalite name."""
    if copy == "embed_tokens" or not m["untie_embeddings_and_output_weights"]:
        return "model.embed_tokens.weight" if hf else "embedding.word_embeddings.weight"
    return "lm_head.weight" if hf else "output_layer.weight"


def mtp_depth(w, m: dict, log) -> int | None:
    """How many MTP layers the weights hold after the main model's (None: none); the config's
    num_nextn_predict_layers must agree, except that transformers' save_pretrained drops them all."""
    declared, layers, held = m["mtp_num_layers"] or 0, m["num_layers"], 0
    while w.has(f"model.layers.{layers + held}.eh_proj.weight"):
        held += 1
    if held and held != declared:
        raise UserError(f"--input {w.hf_dir} holds {held} multi-token-prediction layers (model.layers.{layers}.eh_proj "
                        f"on) but config.json says num_nextn_predict_layers={declared}; they must agree")
    if declared and not held:
        log(f"config.json declares num_nextn_predict_layers={declared} but the weights hold no MTP layer "
            "(transformers' save_pretrained drops them): converted without --mtp-num-layers")
    return held or None


def mtp_copies(w, m: dict) -> list[str]:
    """Which of MTP_COPIES the checkpoint's MTP layers carry (an export writes the same)."""
    return [c for c in MTP_COPIES if m["mtp_num_layers"] and w.has(f"model.layers.{m['num_layers']}.{c}.weight")]


def mtp_to_megalite(w, m: dict, layer):
    """The MTP layers, HF -> megalite, one dict of tensors per depth (converted as the writer asks);
    ``layer(hf, mg, sparse)``: one transformer layer's tensors, built as the main model's last layer. Their
    copies of the embedding and output head must equal the main model's, which megalite's depths share."""
    for k in range(m["mtp_num_layers"] or 0):
        yield _mtp_layer_to_megalite(w, m, k, layer)


def _mtp_layer_to_megalite(w, m: dict, k: int, layer) -> dict:
    layers = m["num_layers"]
    hf, mg = f"model.layers.{layers + k}.", f"mtp.layers.{k}."
    out = {f"{mg}{ours}.weight": w.take(f"{hf}{theirs}.weight") for theirs, ours in MTP_TENSORS}
    for copy in MTP_COPIES:
        name, main = f"{hf}{copy}.weight", _main_of(copy, m, hf=True)
        if w.has(name) and not torch.equal(w.take(name), w.take(main)):
            raise UserError(f"--input {w.hf_dir}: {name} differs from {main}; megalite's multi-token prediction "
                            "shares the main model's embedding and output head, so it cannot hold another")
    out.update(layer(hf, mg + "transformer_layer.", is_sparse(m, layers - 1)))
    return out


def megalite_to_mtp(t, m: dict, layer, copies):
    """Inverse of mtp_to_megalite, one dict per depth, writing ``copies`` (of MTP_COPIES) from the main
    model's tensors."""
    for k in range(m["mtp_num_layers"] or 0):
        yield _mtp_layer_to_hf(t, m, k, layer, copies)


def _mtp_layer_to_hf(t, m: dict, k: int, layer, copies) -> dict:
    layers = m["num_layers"]
    hf, mg = f"model.layers.{layers + k}.", f"mtp.layers.{k}."
    out = {f"{hf}{theirs}.weight": t.get(f"{mg}{ours}.weight") for theirs, ours in MTP_TENSORS}
    out.update({f"{hf}{copy}.weight": t.get(_main_of(copy, m, hf=False)).clone() for copy in copies})
    out.update(layer(hf, mg + "transformer_layer.", is_sparse(m, layers - 1)))
    return out
