"""Rules on the DeepSeek family's flags (config/deepseek_fields.py): group-limited routing and multi-token
prediction."""
from __future__ import annotations

from megalite.config.schema import MegaliteConfig, ModelConfig
from megalite.errors import UserError


def check_group_routing(m: ModelConfig) -> None:
    """--moe-router-num-groups G and --moe-router-group-topk g: both or neither, on an MoE model; G divides the
    experts, g <= G, g divides --moe-router-topk k (a group scores its top k/g experts), and the kept groups
    hold at least k experts."""
    groups, keep = m.moe_router_num_groups, m.moe_router_group_topk
    if groups is None and keep is None:
        return
    if groups is None or keep is None:
        given, missing = (("--moe-router-num-groups", "--moe-router-group-topk") if keep is None
                          else ("--moe-router-group-topk", "--moe-router-num-groups"))
        raise UserError(f"group-limited routing needs both {given} and {missing}; give {missing} too")
    if not m.num_experts:
        raise UserError("--moe-router-num-groups applies to MoE layers; add --num-experts N")
    experts, topk = m.num_experts, m.moe_router_topk
    if experts % groups:
        raise UserError(f"--moe-router-num-groups {groups} does not divide --num-experts {experts}; "
                        "choose a divisor of the expert count")
    if keep > groups:
        raise UserError(f"--moe-router-group-topk {keep} exceeds --moe-router-num-groups {groups}; "
                        "keep at most every group")
    if topk % keep:
        raise UserError(f"--moe-router-group-topk {keep} does not divide --moe-router-topk {topk}: each kept group "
                        "is scored by its top (topk / group-topk) experts; choose a divisor of the top-k")
    if topk > keep * (experts // groups):
        raise UserError(f"--moe-router-topk {topk} exceeds the {keep * (experts // groups)} experts of "
                        f"{keep} kept groups; raise --moe-router-group-topk")


def check_mtp(config: MegaliteConfig) -> None:
    """--mtp-num-layers D: depth k reads the token k+1 ahead and predicts the one after it, so a sample needs
    more than D tokens and the data must hold tokens besides the end-of-document one; the depths embed
    tokens without position embeddings (RoPE only); zbv's local sum of the embedding's two copies needs
    them unsharded."""
    m, d, p = config.model, config.data, config.parallel
    depth = m.mtp_num_layers
    if depth is None:
        return
    flag = f"--mtp-num-layers {depth}"
    if m.seq_length <= depth:
        raise UserError(f"{flag} predicts up to {depth + 1} tokens ahead, which --seq-length {m.seq_length} leaves "
                        f"without a target; use --seq-length > {depth} or fewer MTP layers")
    if d.mock_data and d.tokenizer_type == "NullTokenizer" and (d.vocab_size or 0) < 2:
        raise UserError(f"{flag} on --mock-data with --vocab-size {d.vocab_size}: the mock documents hold only the "
                        "end-of-document token, so there are no next tokens to predict; use --vocab-size 2 or more")
    if not m.use_rope:
        raise UserError(f"{flag} embeds the tokens ahead without position embeddings, which --position-embedding-type "
                        f"{m.position_embedding_type} needs; use --position-embedding-type rope")
    sharded = p.data_parallel_size > 1 and p.data_parallel_sharding_strategy != "no_shard"
    if p.pipeline_schedule == "zbv" and sharded:
        raise UserError(f"{flag} with --pipeline-schedule zbv keeps both copies of the word embedding on rank 0 and "
                        "sums their gradients there, which gradients sharded over data-parallel ranks do not allow; "
                        "use --data-parallel-sharding-strategy no_shard or another schedule")
