"""The DeepSeek-V3 family in the planner: multi-latent attention's parameters and kept activations, and
the multi-token prediction layers on the last pipeline stage.

Multi-latent attention (MLA) on one TP rank, n = heads / TP, qk = qk_head_dim + qk_pos_emb_head_dim
(a head's query/key: its no-RoPE part and the RoPE part), v = v_head_dim, r_q / r_kv the latent ranks:

- parameters: without --q-lora-rank one query projection [n qk, h]; with it linear_q_down_proj [r_q, h]
  (replicated over TP), q_layernorm [r_q] and linear_q_up_proj [n qk, r_q]; then linear_kv_down_proj
  [r_kv + pos, h] (replicated: the keys' and values' latent and the RoPE key shared by all heads),
  kv_layernorm [r_kv], linear_kv_up_proj [n (qk_head_dim + v), r_kv] and linear_proj [h, n v]. The
  latent norms exist with --qk-layernorm (DeepSeek always sets it);
- kept for backward, per token (every TP rank computes the latents of the whole sequence, the down
  projections being replicated; their input is the layer norm's output the caller counts): each latent
  norm's input and the up projection's input, r each; then what the attention kernel keeps, q and k
  expanded to every head [n qk] each, v [n v] and the output [n v] (plus the caller's fp32 log-sum-exp
  per head).

Forward FLOPs per token of MLA (``mla_flops_correction``): the projections 2 x their weights (the down
projections' and the up projections' separately), the scores 2 s n qk and the weighted values 2 s n v (no
causal discount, as model FLOPs count attention; times the attended fraction), linear_proj 2 n v h.

Multi-token prediction (MTP, --mtp-num-layers D), after the main model on the last stage: per depth the
norms enorm, hnorm and final_layernorm [h], eh_proj [h, 2h] (column-parallel: h/TP rows per rank, as
Megatron splits it) and one transformer layer of the last main layer's kind; with pipeline parallelism
the last stage also holds a copy of the word embedding to embed the shifted tokens, unless the output
layer is the tied embedding's copy already. Each depth keeps for backward its layer's activations, the
two norms' inputs, eh_proj's input [2h] and its own output head's (final norm, output layer input, fp32
softmax over the vocabulary shard): one more loss per depth. Each depth computes a layer, eh_proj
(4 h^2 per token forward) and the output layer with its loss again.
"""
from __future__ import annotations

from megalite.config.schema import ModelConfig


def mla_tensors(model: ModelConfig, tp: int) -> list[int]:
    """Sizes of MLA's parameters on one TP rank, in the module's order (module docstring), linear_proj's
    bias (replicated) included with biases."""
    h, n = model.hidden_size, model.num_attention_heads // tp
    qk = model.qk_head_dim + model.qk_pos_emb_head_dim
    norm = 2 if model.normalization == "LayerNorm" else 1
    latent_norms = model.qk_layernorm
    if model.q_lora_rank:
        r_q = model.q_lora_rank
        query = [r_q * h, *([norm * r_q] if latent_norms else []), n * qk * r_q]
    else:
        query = [n * qk * h]
    r_kv = model.kv_lora_rank
    kv = [(r_kv + model.qk_pos_emb_head_dim) * h, *([norm * r_kv] if latent_norms else []),
          n * (model.qk_head_dim + model.v_head_dim) * r_kv]
    return query + kv + [h * n * model.v_head_dim, *([h] if model.add_bias_linear else [])]


def mla_saved_elements(model: ModelConfig, tp: int, tokens: int) -> float:
    """Elements MLA keeps for backward for ``tokens`` tokens on one TP rank (module docstring)."""
    n = model.num_attention_heads // tp
    qk = model.qk_head_dim + model.qk_pos_emb_head_dim
    latents = 2 * (model.q_lora_rank or 0) + 2 * model.kv_lora_rank
    return tokens * (latents + 2 * n * qk + 2 * n * model.v_head_dim)


def mtp_depths(model: ModelConfig) -> int:
    return model.mtp_num_layers or 0


def mtp_glue_tensors(model: ModelConfig, tp: int) -> list[int]:
    """One MTP depth's parameters beside its transformer layer on one TP rank: enorm, hnorm, eh_proj,
    final_layernorm."""
    h = model.hidden_size
    norm = [h] * (2 if model.normalization == "LayerNorm" else 1)
    return [*norm, *norm, h // tp * 2 * h, *norm]


def needs_embedding_copy(model: ModelConfig, pp: int) -> bool:
    """Whether the last stage holds a copy of the word embedding for MTP: under pipeline parallelism, when
    the output layer is not already the tied embedding's copy."""
    return bool(mtp_depths(model)) and pp > 1 and model.untie_embeddings_and_output_weights


def mtp_depth_bytes(model: ModelConfig, layer: float, head_kept: float, sp_tokens: int, dtype_bytes: int) -> float:
    """What one MTP depth keeps for backward for one micro-batch: its transformer layer's ``layer``
    bytes, enorm's and hnorm's inputs, eh_proj's input (the two normed halves, [2h] per token on the
    sequence gathered again under SP, which the column-parallel projection keeps as its shard), and its
    output head's ``head_kept`` (memory.output_layer_bytes)."""
    h = model.hidden_size
    return layer + 2 * sp_tokens * h * dtype_bytes + 2 * sp_tokens * h * dtype_bytes + head_kept


def mla_flops_correction(model: ModelConfig, attended_fraction: float = 1.0) -> float:
    """Forward FLOPs per token and layer that MLA runs beyond what performance.flops_per_iteration counts
    for a layer's attention (QKV, scores and values, output projection of kv_channels-wide heads);
    0 without MLA."""
    if not model.multi_latent_attention:
        return 0.0
    h, s, nq, d = model.hidden_size, model.seq_length, model.num_attention_heads, model.kv_channels
    counted = 2 * h * (nq + 2 * model.num_query_groups) * d + 4 * s * nq * d * attended_fraction + 2 * nq * d * h
    qk, r_q, r_kv = model.qk_head_dim + model.qk_pos_emb_head_dim, model.q_lora_rank, model.kv_lora_rank
    query = (r_q * h + nq * qk * r_q) if r_q else nq * qk * h
    kv = (r_kv + model.qk_pos_emb_head_dim) * h + nq * (model.qk_head_dim + model.v_head_dim) * r_kv
    projections = 2 * (query + kv + h * nq * model.v_head_dim)
    attention = 2 * s * nq * (qk + model.v_head_dim) * attended_fraction
    return projections + attention - counted


def eh_proj_flops_per_token(model: ModelConfig) -> float:
    """Forward FLOPs per token of one MTP depth's eh_proj [h, 2h]."""
    return 4.0 * model.hidden_size ** 2
