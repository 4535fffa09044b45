"""ModelConfig's fields for the variants of two common parts: RoPE extended by YaRN (Peng et al. 2023:
GPT-OSS, DeepSeek-V3, Qwen long-context), and the gated activation of the experts and MLP as GPT-OSS runs
it (quick GEGLU with an offset on the linear half and clamped inputs). Flag names are Megatron's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalite.config.cli import number, positive_float, positive_int
from megalite.config.fields import flag


@dataclass(kw_only=True)
class ModelVariantFields:
    # ---- YaRN (--position-embedding-type yarn; model/attention/rotary.py has the formulas)
    rotary_scaling_factor: float = flag("--rotary-scaling-factor", positive_float, default=1.0, help=(
        "YaRN: how many times longer the context is than --yarn-original-max-position-embeddings"))
    yarn_original_max_position_embeddings: Optional[int] = flag(
        "--yarn-original-max-position-embeddings", positive_int, default=None,
        help="YaRN: the context length the model was pretrained with (default --max-position-embeddings)")
    yarn_beta_fast: float = flag("--yarn-beta-fast", number, default=32.0, help=(
        "YaRN: dimensions turning more than this many times over the original context keep their frequency"))
    yarn_beta_slow: float = flag("--yarn-beta-slow", number, default=1.0, help=(
        "YaRN: dimensions turning fewer than this many times are fully interpolated (frequency / factor)"))
    mscale: float = flag("--mscale", number, default=1.0, help=(
        "YaRN: cos/sin scale (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) + 1)"))
    mscale_all_dim: float = flag("--mscale-all-dim", number, default=0.0, help="YaRN: see --mscale")
    yarn_correction_range_round_to_int: bool = flag("--no-yarn-correction-range-round-to-int", default=True, help=(
        "YaRN: keep the ends of the interpolation ramp fractional instead of rounding them outwards"))
    # ---- the gated activation (--swiglu or --quick-geglu)
    quick_geglu: bool = flag("--quick-geglu", default=False, help=(
        "gated activation x1 sigmoid(1.702 x1) (x2 + --glu-linear-offset) in place of SwiGLU (GPT-OSS)"))
    glu_linear_offset: float = flag("--glu-linear-offset", number, default=0.0, help=(
        "with --quick-geglu: added to the linear half of the gated activation (GPT-OSS: 1)"))
    activation_func_clamp_value: Optional[float] = flag("--activation-func-clamp-value", positive_float,
                                                        default=None, help=(
        "with --quick-geglu: clamp the gate half to <= v and the linear half to [-v, v] (GPT-OSS: 7)"))

    @property
    def gated_linear_unit(self) -> bool:
        """fc1 has a gate and a linear half (--swiglu or --quick-geglu)."""
        return self.swiglu or self.quick_geglu
