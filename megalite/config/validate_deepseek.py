"""Rules on the DeepSeek family's flags (config/deepseek_fields.py): group-limited routing."""
from __future__ import annotations

from megalite.config.schema import ModelConfig
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
