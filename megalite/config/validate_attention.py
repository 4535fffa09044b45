"""The rules of attention's flags: the layer's window and sinks, document masks, and how context
parallelism splits attention (--cp-comm-type); each failure is one line naming the flags and the fix."""
from __future__ import annotations

from megalite.config.schema import ModelConfig, ParallelConfig
from megalite.errors import UserError


def check_masked_attention(m: ModelConfig, reset_attention_mask: bool) -> None:
    """A window, attention sinks (--softmax-type) and document masks (--reset-attention-mask) run the
    masked attention kernels, which draw no attention dropout."""
    given = [flag for flag, on in (("--window-size", m.window_size is not None),
                                   (f"--softmax-type {m.softmax_type}", m.softmax_type != "vanilla"),
                                   ("--reset-attention-mask", reset_attention_mask)) if on]
    if given and m.attention_dropout > 0:
        raise UserError(f"{given[0]} runs the masked attention kernel, which has no attention dropout, but "
                        f"--attention-dropout is {m.attention_dropout:g}: add --attention-dropout 0")


def check_window(m: ModelConfig) -> None:
    """--window-size and --window-attn-skip-freq (ModelConfig.attention_window)."""
    check_masked_attention(m, reset_attention_mask=False)
    skip = m.window_attn_skip_freq
    if m.window_size is None:
        if skip is not None:
            raise UserError("--window-attn-skip-freq picks the layers without a window; add --window-size LEFT,0")
        return
    left, right = m.window_size
    if right > 0:
        raise UserError(f"--window-size {left},{right}: a causal model sees no key to the right of the query; "
                        f"give {left},0")
    if left >= m.seq_length:
        raise UserError(f"--window-size {left},{right}: the window is longer than --seq-length {m.seq_length} and "
                        f"would be full attention; give LEFT < {m.seq_length}, or drop --window-size")
    if isinstance(skip, list) and len(skip) != m.num_layers:
        raise UserError(f"--window-attn-skip-freq lists {len(skip)} layers but --num-layers is {m.num_layers}; "
                        "give one 1 (window) or 0 (full) per layer")


def check_context_parallel(m: ModelConfig, p: ParallelConfig) -> None:
    cp, tp = p.context_parallel_size, p.tensor_model_parallel_size
    if cp == 1:
        return
    split = 2 * cp * (tp if p.sequence_parallel and tp > 1 else 1)
    if m.seq_length % split:
        raise UserError(f"--context-parallel-size {cp} needs --seq-length {m.seq_length} divisible by {split} "
                        f"(2 x cp chunks{' x --tensor-model-parallel-size with --sequence-parallel' if split > 2 * cp else ''})")
    if m.attention_dropout > 0:
        raise UserError(f"--context-parallel-size {cp} needs --attention-dropout 0 (no --cp-comm-type has "
                        f"attention dropout; got {m.attention_dropout})")
    check_cp_comm_type(m, p)


def check_cp_comm_type(m: ModelConfig, p: ParallelConfig) -> None:
    """One --cp-comm-type or one per layer (p2p and allgather need nothing more than CP itself); a2a splits
    every TP rank's query heads and KV groups over the ranks of its all-to-all (CP, or the first
    --hierarchical-context-parallel-sizes), whose product is CP."""
    cp, tp, kinds = p.context_parallel_size, p.tensor_model_parallel_size, p.cp_comm_type
    if len(kinds) not in (1, m.num_layers):
        raise UserError(f"--cp-comm-type takes one value or one per layer ({m.num_layers}); got {len(kinds)}")
    sizes = p.hierarchical_context_parallel_sizes
    if "a2a+p2p" in kinds and (sizes is None or len(sizes) != 2 or sizes[0] * sizes[1] != cp):
        raise UserError(f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A B (all-to-all "
                        f"size, ring size) with A x B = --context-parallel-size {cp}; got {sizes}")
    heads, groups = m.num_attention_heads // tp, max(m.num_query_groups // tp, 1)
    for kind, size in (("a2a", cp), ("a2a+p2p", sizes[0] if sizes else cp)):
        if kind in kinds and (heads % size or groups % size):
            raise UserError(f"--cp-comm-type {kind} splits heads over {size} ranks: --num-attention-heads "
                            f"{m.num_attention_heads} and --num-query-groups {m.num_query_groups} per "
                            f"--tensor-model-parallel-size {tp} rank ({heads}, {groups}) must divide by {size}")


def check_multi_latent_attention(m: ModelConfig) -> None:
    """--multi-latent-attention (model/attention/mla.py): its heads' keys and values come from one latent
    (no query groups), its position information is RoPE on a part of every head of --qk-pos-emb-head-dim
    (whole, even), and its projections have no biases."""
    if not m.multi_latent_attention:
        if m.q_lora_rank is not None:
            raise UserError("--q-lora-rank applies to multi-latent attention: add --multi-latent-attention")
        return
    refused = [(flag, fix) for flag, on, fix in (
        ("--group-query-attention", m.num_query_groups != m.num_attention_heads,
         "every head's K/V come from the shared latent; drop --group-query-attention / --num-query-groups"),
        (f"--position-embedding-type {m.position_embedding_type}", not m.use_rope,
         "its decoupled position part is RoPE; use --position-embedding-type rope"),
        ("linear biases", m.add_bias_linear or m.add_qkv_bias, "add --disable-bias-linear (and drop --add-qkv-bias)"),
        (f"--rotary-percent {m.rotary_percent:g}", m.rotary_percent != 1.0,
         "RoPE rotates the whole --qk-pos-emb-head-dim part; drop --rotary-percent")) if on]
    if refused:
        flag, fix = refused[0]
        raise UserError(f"--multi-latent-attention does not support {flag}: {fix}")
    if m.qk_pos_emb_head_dim % 2:
        raise UserError(f"--qk-pos-emb-head-dim {m.qk_pos_emb_head_dim}: RoPE rotates pairs of dimensions; "
                        "give an even number")
