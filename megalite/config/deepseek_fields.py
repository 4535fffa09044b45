"""ModelConfig's fields for the DeepSeek-V2/V3 family (also Kimi K2 and GLM-4.5): multi-latent attention,
multi-token prediction and group-limited routing. Flag names and defaults are Megatron's.

Multi-latent attention (DeepSeek-V2): queries through a low-rank latent (--q-lora-rank; absent: one full
projection), keys and values from one shared latent of --kv-lora-rank with a norm each; each head's
query/key is a no-RoPE part of --qk-head-dim beside a RoPE part of --qk-pos-emb-head-dim whose key is
shared by all heads, and its value has --v-head-dim. Megatron's MLA takes YaRN RoPE unless --rope-type
rope says otherwise.

Multi-token prediction (DeepSeek-V3): --mtp-num-layers extra layers after the main model; depth k predicts
the token k + 1 ahead of the next one, and --mtp-loss-scaling-factor times the mean of their losses joins
the language-model loss.

Group-limited routing (DeepSeek-V2/V3): the experts are split into --moe-router-num-groups equal groups;
a token first keeps the --moe-router-group-topk groups whose top-(topk / group-topk) scores sum highest,
then takes its top-k experts inside them (node-limited routing when a group is a node's experts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalite.config.cli import number, positive_int
from megalite.config.fields import flag


@dataclass(kw_only=True)
class DeepSeekFields:
    # ---- multi-latent attention (model/attention/mla.py)
    multi_latent_attention: bool = flag("--multi-latent-attention", default=False, help=(
        "DeepSeek's multi-latent attention in place of grouped-query attention"))
    q_lora_rank: Optional[int] = flag("--q-lora-rank", positive_int, default=None, help=(
        "MLA: rank of the queries' low-rank latent (absent: one full query projection, as DeepSeek-V2-Lite)"))
    kv_lora_rank: int = flag("--kv-lora-rank", positive_int, default=32,
                             help="MLA: rank of the latent that keys and values share")
    qk_head_dim: int = flag("--qk-head-dim", positive_int, default=128,
                            help="MLA: the part of each query/key head without RoPE")
    qk_pos_emb_head_dim: int = flag("--qk-pos-emb-head-dim", positive_int, default=64, help=(
        "MLA: the RoPE part of each query/key head (its key is shared by all heads)"))
    v_head_dim: int = flag("--v-head-dim", positive_int, default=128, help="MLA: each value head's dimension")
    rope_type: Optional[str] = flag("--rope-type", default=None, choices=("rope", "yarn"), help=(
        "RoPE variant; MLA takes yarn by default, other attention rope"))
    # ---- multi-token prediction (model/mtp.py)
    mtp_num_layers: Optional[int] = flag("--mtp-num-layers", positive_int, default=None, help=(
        "multi-token prediction depth: extra layers predicting 2, 3, ... tokens ahead (absent: none)"))
    mtp_loss_scaling_factor: float = flag("--mtp-loss-scaling-factor", number, default=0.1, help=(
        "weight of the mean multi-token-prediction loss in the training loss"))
    # ---- group-limited routing (model/moe.py's Router)
    moe_router_num_groups: Optional[int] = flag("--moe-router-num-groups", positive_int, default=None, help=(
        "split the experts into this many equal groups for group-limited routing (absent: no groups)"))
    moe_router_group_topk: Optional[int] = flag("--moe-router-group-topk", positive_int, default=None, help=(
        "group-limited routing: the groups a token may use, chosen by their top-(topk / this) scores"))

    @property
    def uses_yarn(self) -> bool:
        """RoPE scaled by YaRN: --position-embedding-type yarn, --rope-type yarn, or MLA without --rope-type."""
        if self.rope_type is not None:
            return self.rope_type == "yarn"
        return self.position_embedding_type == "yarn" or (
            self.multi_latent_attention and self.position_embedding_type == "rope")

    @property
    def rotary_head_dim(self) -> int:
        """The head dimension RoPE's tables are built for: MLA's RoPE part, else the whole head."""
        return self.qk_pos_emb_head_dim if self.multi_latent_attention else self.kv_channels
