"""Mixture-of-Experts families of the Hugging Face conversion (Mixtral, Qwen2-MoE, Qwen3-MoE): their
configs' MoE part and their sparse layers' tensors (hf_config.py maps the rest of the config, hf.py
the rest of the tensors).

A sparse layer's tensors, HF -> megalite (experts stacked, expert e at its offset; model/moe.py):

    mlp.gate.weight [E, h]  (Mixtral: block_sparse_moe.gate)         -> mlp.router.weight
    experts.{e}.gate_proj / up_proj [f, h]  (Mixtral: w1 / w3)        -> mlp.experts.linear_fc1.weight [E*2f, h],
                                                                         rows e*2f.. = [gate_e; up_e]
    experts.{e}.down_proj [h, f]  (Mixtral: w2)                       -> mlp.experts.linear_fc2.weight [E*h, f]
    Qwen2-MoE: shared_expert.gate_proj / up_proj / down_proj          -> mlp.shared_experts.linear_fc1 / fc2
               shared_expert_gate.weight [1, h]                       -> mlp.shared_experts.gate_weight

transformers 5 holds the experts fused in memory, ``experts.gate_up_proj`` [E, 2f, h] (each expert's
[gate; up], megalite's rows) and ``experts.down_proj`` [E, h, f]; its save_pretrained writes the per-expert
tensors above, which every transformers version loads. Both are read; the per-expert form is written.

torch is imported where tensors are built: hf_config (which the torch-free planner imports) uses the
config part.
"""
from __future__ import annotations

from megalite.errors import UserError

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# HF training settings a conversion records in metadata["source"], so that an export writes them back
MOE_TRAINING_KEYS = ("router_aux_loss_coef", "output_router_logits")
# (gate, up, down) projection names of one expert
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
                "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


# ==================================================================================================
# Configs
# ==================================================================================================
def check_moe_convertible(config, log) -> None:
    """What megalite's MoE layer cannot reproduce of an HF MoE config."""
    if config.model_type == "qwen2_moe" and _num_experts(config) and not config.shared_expert_intermediate_size:
        raise UserError("qwen2_moe shared_expert_intermediate_size=0 is not supported: megalite's shared expert "
                        "has a positive hidden size (convert it as qwen3_moe, which has none)")
    if config.model_type == "mixtral" and config.router_jitter_noise:
        log(f"mixtral router_jitter_noise={config.router_jitter_noise}: HF multiplies the router input by uniform "
            "noise in training; megalite's router has no jitter (inference is identical)")


def _num_experts(config) -> int:
    """Experts per MoE layer (0: none); Mixtral calls it num_local_experts."""
    if config.model_type == "mixtral":
        return config.num_local_experts
    return config.num_experts or 0


def moe_fields(config) -> dict:
    """The MoE fields of ModelConfig for an HF config (hf_config's docstring); empty for a dense model."""
    if config.model_type not in MOE_MODEL_TYPES:
        return {}
    experts, layers = _num_experts(config), config.num_hidden_layers
    if not experts:
        return {}
    fields = {"num_experts": experts, "moe_router_topk": config.num_experts_per_tok, "moe_layer_freq": 1,
              "moe_aux_loss_coeff": float(config.router_aux_loss_coef if config.output_router_logits else 0.0)}
    if config.model_type == "mixtral":          # every layer sparse, experts of intermediate_size
        return fields
    dense, step = set(config.mlp_only_layers or []), config.decoder_sparse_step or 1
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    if not any(pattern):
        return {}                               # no sparse layer: a dense model
    fields["moe_layer_freq"] = 1 if all(pattern) else pattern
    if config.moe_intermediate_size != config.intermediate_size:
        fields["moe_ffn_hidden_size"] = config.moe_intermediate_size
    fields["moe_router_pre_softmax"] = not config.norm_topk_prob
    if config.model_type == "qwen2_moe":
        fields.update(moe_shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                      moe_shared_expert_gate=True)
    return fields


def check_moe_representable(m: dict, model_type: str, need) -> None:
    """The MoE part of check_representable: MoE families need an MoE checkpoint their router and experts
    express, dense families a dense one."""
    if model_type not in MOE_MODEL_TYPES:
        need(not m["num_experts"], f"{model_type} is a dense model, the checkpoint has {m['num_experts']} experts "
             "per MoE layer; use --model-type mixtral, qwen2_moe or qwen3_moe")
        return
    need(m["num_experts"], f"{model_type} is a Mixture-of-Experts model, the checkpoint a dense one (no "
         "--num-experts)")
    need(m["moe_router_score_function"] == "softmax", f"{model_type} routes by softmax, the checkpoint by "
         f"{m['moe_router_score_function']}")
    need(not m["moe_router_enable_expert_bias"], f"{model_type} has no router expert bias "
         "(--moe-router-enable-expert-bias)")
    need(not m["moe_router_topk_scaling_factor"], f"{model_type} does not scale the routing weights "
         "(--moe-router-topk-scaling-factor)")
    shared, gated = m["moe_shared_expert_intermediate_size"], m["moe_shared_expert_gate"]
    if model_type == "qwen2_moe":
        need(shared and gated, "qwen2_moe has a shared expert with a sigmoid gate, the checkpoint "
             + ("an ungated one" if shared else "none; use --model-type qwen3_moe"))
    else:
        need(not shared, f"{model_type} has no shared expert, the checkpoint has one; use --model-type qwen2_moe")
    if model_type == "mixtral":
        need(not m["moe_router_pre_softmax"], "mixtral renormalises the top-k routing weights, the checkpoint has "
             "--moe-router-pre-softmax; use --model-type qwen2_moe or qwen3_moe")
        need(m["moe_layer_freq"] == 1 or all(m["moe_layer_freq"]), "mixtral has an MoE in every layer, the "
             f"checkpoint --moe-layer-freq {m['moe_layer_freq']}; use --model-type qwen3_moe")


def sparse_layers(m: dict) -> tuple[int, list[int]]:
    """(decoder_sparse_step, mlp_only_layers) for megalite's --moe-layer-freq: a step when the pattern is
    HF's every-step-th layer, else step 1 and the dense layers listed."""
    layers, freq = m["num_layers"], m["moe_layer_freq"]
    pattern = [int(i % freq == 0) for i in range(layers)] if isinstance(freq, int) else [int(v) for v in freq]
    for step in range(1, layers + 1):
        if pattern == [int((i + 1) % step == 0) for i in range(layers)]:
            return step, []
    return 1, [i for i, sparse in enumerate(pattern) if not sparse]


def build_moe_config(m: dict, model_type: str, fields: dict, moe_training: dict):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    training = {k: v for k, v in moe_training.items() if k in MOE_TRAINING_KEYS and v is not None}
    experts, topk = m["num_experts"], m["moe_router_topk"]
    expert_ffn = m["moe_ffn_hidden_size"] or m["ffn_hidden_size"]
    if model_type == "mixtral":
        # every layer is sparse (checked): intermediate_size is the experts' hidden size
        return MixtralConfig(num_local_experts=experts, num_experts_per_tok=topk, router_jitter_noise=0.0, **training, **{**fields, "intermediate_size": expert_ffn})
    step, dense = sparse_layers(m)
    moe = dict(num_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=expert_ffn,
               norm_topk_prob=not m["moe_router_pre_softmax"], decoder_sparse_step=step, mlp_only_layers=dense,
               **training)
    if model_type == "qwen2_moe":
        # q/k/v biases always (zeros when megalite has none), as transformers 4 builds Qwen2-MoE
        return Qwen2MoeConfig(shared_expert_intermediate_size=m["moe_shared_expert_intermediate_size"], qkv_bias=True,
                              **moe, **fields)
    return Qwen3MoeConfig(attention_bias=False, **moe, **fields)


def moe_training_settings(config) -> dict:
    """HF's load-balancing settings of an MoE config (MOE_TRAINING_KEYS), empty for a dense one."""
    if config.model_type not in MOE_MODEL_TYPES + ("gpt_oss",):
        return {}
    return {"router_aux_loss_coef": config.router_aux_loss_coef, "output_router_logits": config.output_router_logits}


# ==================================================================================================
# Tensors
# ==================================================================================================
def is_sparse(m: dict, layer: int) -> bool:
    """Whether 0-based ``layer`` of metadata["model"] ``m`` is an MoE layer (ModelConfig.is_moe_layer)."""
    if not m.get("num_experts"):
        return False
    freq = m["moe_layer_freq"]
    return layer % freq == 0 if isinstance(freq, int) else bool(freq[layer])


def _hf_block(w, layer_prefix: str, model_type: str) -> str:
    """The sparse block's prefix: Mixtral's files say block_sparse_moe, transformers 5's modules mlp."""
    legacy = layer_prefix + "block_sparse_moe."
    return legacy if model_type == "mixtral" and w.has(legacy + "gate.weight") else layer_prefix + "mlp."


def moe_to_megalite(w, hf: str, mg: str, m: dict, model_type: str) -> dict:
    """One sparse layer's MLP tensors; ``hf`` = "model.layers.{i}.", ``mg`` = "decoder.layers.{i}."."""
    import torch
    block, E, h = _hf_block(w, hf, model_type), m["num_experts"], m["hidden_size"]
    f = m["moe_ffn_hidden_size"] or m["ffn_hidden_size"]
    out = {mg + "mlp.router.weight": w.take(block + "gate.weight")}
    if w.has(block + "experts.gate_up_proj"):
        fc1, fc2 = w.take(block + "experts.gate_up_proj"), w.take(block + "experts.down_proj")
        for name, t, shape in (("gate_up_proj", fc1, (E, 2 * f, h)), ("down_proj", fc2, (E, h, f))):
            if tuple(t.shape) != shape:
                raise UserError(f"--input {w.hf_dir}: {block}experts.{name} has shape {list(t.shape)}, config.json "
                                f"implies {list(shape)}")
        fc1, fc2 = fc1.reshape(E * 2 * f, h), fc2.reshape(E * h, f)
    else:
        gate, up, down = (f"{block}experts.{{}}.{p}.weight" for p in EXPERT_NAMES[model_type])
        fc1 = torch.cat([torch.cat([w.take(gate.format(e)), w.take(up.format(e))]) for e in range(E)])
        fc2 = torch.cat([w.take(down.format(e)) for e in range(E)])
    out[mg + "mlp.experts.linear_fc1.weight"], out[mg + "mlp.experts.linear_fc2.weight"] = fc1, fc2
    if model_type == "qwen2_moe":
        shared = block + "shared_expert."
        out[mg + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([w.take(shared + "gate_proj.weight"),
                                                                      w.take(shared + "up_proj.weight")])
        out[mg + "mlp.shared_experts.linear_fc2.weight"] = w.take(shared + "down_proj.weight")
        out[mg + "mlp.shared_experts.gate_weight"] = w.take(block + "shared_expert_gate.weight")
    return out


def megalite_to_moe(t, hf: str, mg: str, m: dict, model_type: str) -> dict:
    """Inverse of moe_to_megalite, in the per-expert form (each tensor its own copy: safetensors refuses
    tensors that share memory)."""
    block = hf + ("block_sparse_moe." if model_type == "mixtral" else "mlp.")
    E, h = m["num_experts"], m["hidden_size"]
    f = m["moe_ffn_hidden_size"] or m["ffn_hidden_size"]
    out = {block + "gate.weight": t.get(mg + "mlp.router.weight")}
    fc1 = t.get(mg + "mlp.experts.linear_fc1.weight").view(E, 2, f, h)
    fc2 = t.get(mg + "mlp.experts.linear_fc2.weight").view(E, h, f)
    gate, up, down = EXPERT_NAMES[model_type]
    for e in range(E):
        out[f"{block}experts.{e}.{gate}.weight"] = fc1[e, 0].clone()
        out[f"{block}experts.{e}.{up}.weight"] = fc1[e, 1].clone()
        out[f"{block}experts.{e}.{down}.weight"] = fc2[e].clone()
    if model_type == "qwen2_moe":
        shared = block + "shared_expert."
        gate_w, up_w = t.get(mg + "mlp.shared_experts.linear_fc1.weight").chunk(2)
        out[shared + "gate_proj.weight"], out[shared + "up_proj.weight"] = gate_w.clone(), up_w.clone()
        out[shared + "down_proj.weight"] = t.get(mg + "mlp.shared_experts.linear_fc2.weight")
        out[block + "shared_expert_gate.weight"] = t.get(mg + "mlp.shared_experts.gate_weight")
    return out
