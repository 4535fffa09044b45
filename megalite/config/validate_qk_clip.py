"""The rules of --qk-clip and --log-max-attention-logit, one line each (Megatron's ranges, and the models
whose attention logits the rescaled weights cannot reach)."""
from __future__ import annotations

from megalite.config.schema import MegaliteConfig
from megalite.errors import UserError


def check_qk_clip(config: MegaliteConfig) -> None:
    m = config.model
    if not m.qk_clip:
        return
    if not 0.0 < m.qk_clip_alpha < 1.0:
        raise UserError(f"--qk-clip-alpha {m.qk_clip_alpha:g} must lie strictly between 0 and 1 (the query's share "
                        "of the rescale; 0.5 splits it evenly)")
    if m.qk_clip_threshold <= 0:
        raise UserError(f"--qk-clip-threshold {m.qk_clip_threshold:g} must be greater than 0 (the largest attention "
                        "logit a head may keep; Megatron's default is 100)")
    if m.attention_type == "self" and m.qk_layernorm:
        raise UserError("--qk-clip rescales the query and key projections, but --qk-layernorm normalises each "
                        "head's q and k after them, so no attention logit would change: drop --qk-clip (keep "
                        "--log-max-attention-logit to watch the logits) or --qk-layernorm")
