"""ModelConfig's fields for FP8 GEMMs. Flag names and defaults are Megatron's (Transformer Engine's recipes).

--fp8-format turns FP8 on: ``e4m3`` quantises every GEMM operand to E4M3, ``hybrid`` the forward operands
(activations, weights) to E4M3 and the gradients to E5M2. --fp8-recipe picks how each operand is scaled
into the format's range: ``tensorwise`` one scale per tensor from its amax now (current scaling);
``delayed`` one scale per tensor from the amaxes of its earlier uses (--fp8-amax-history-len,
--fp8-amax-compute-algo); ``rowwise`` one scale per row along the GEMM's contraction dimension (torchao's),
``rowwise_with_gw_hp`` the same with the weight-gradient GEMM kept in the operands' precision; ``blockwise``
DeepSeek-V3's 1x128 tiles for activations and gradients and 128x128 blocks for weights; ``mxfp8`` 1x32
blocks with power-of-two (E8M0) scales. The output head, the router, the norms and core attention stay in
the model's precision whatever the recipe, and so do the first --num-layers-at-start-in-bf16 and the last
--num-layers-at-end-in-bf16 transformer layers with --first-last-layers-bf16.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalite.config.cli import non_negative_int, positive_int
from megalite.config.fields import flag

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8")
# the scaling block along a GEMM's contraction dimension of the recipes whose kernels need whole blocks
FP8_BLOCKS = {"blockwise": 128, "mxfp8": 32}
# --fp8-param-gather: the recipes whose weight scales are the same for W and W^T (one per tensor, square
# blocks), so the one gathered FP8 copy serves both the forward and the input-gradient GEMM
PARAM_GATHER_RECIPES = ("tensorwise", "delayed", "blockwise")
# why the others gather in the weights' own dtype: W's scaling blocks run along in-features in forward and
# along out-features (W^T's rows) in the input-gradient GEMM, and serial quantises each from the weight in
# high precision, so the gather would carry two FP8 copies: 2 bytes an element plus scales, bf16's or more
HIGH_PRECISION_GATHER_REASON = (
    "its forward GEMM scales W in blocks along in-features and its input-gradient GEMM scales W^T along "
    "out-features, so one FP8 copy cannot serve both, and both copies with their scales move at least bf16's bytes")
AMAX_COMPUTE_ALGOS = ("most_recent", "max")
EMULATE_FLAG = "--fp8-emulate"


@dataclass(kw_only=True)
class Fp8Fields:
    fp8_format: Optional[str] = flag("--fp8-format", default=None, choices=FP8_FORMATS, help=(
        "run the transformer layers' GEMMs in FP8: e4m3 for every operand, or hybrid (E4M3 activations and "
        "weights, E5M2 gradients)"))
    fp8_recipe: str = flag("--fp8-recipe", default="delayed", choices=FP8_RECIPES, help=(
        "FP8 scaling: tensorwise (one scale per tensor, current amax), delayed (from an amax history), rowwise "
        "(per row), rowwise_with_gw_hp (rowwise, weight gradient in high precision), blockwise (1x128 tiles, "
        "128x128 weight blocks), mxfp8 (1x32 blocks, power-of-two scales)"))
    fp8_amax_history_len: int = flag("--fp8-amax-history-len", positive_int, default=1, help=(
        "delayed scaling: how many past amaxes each FP8 tensor keeps"))
    fp8_amax_compute_algo: str = flag("--fp8-amax-compute-algo", default="most_recent", choices=AMAX_COMPUTE_ALGOS,
                                      help="delayed scaling: scale from the newest amax or the history's max")
    fp8_emulate: bool = flag(EMULATE_FLAG, default=False, help=(
        "FP8 without FP8 kernels: quantise, dequantise and multiply in fp32 (same quantised values and scales)"))
    first_last_layers_bf16: bool = flag("--first-last-layers-bf16", default=False, help=(
        "FP8: keep the first and last transformer layers' GEMMs in the model's precision"))
    num_layers_at_start_in_bf16: int = flag("--num-layers-at-start-in-bf16", non_negative_int, default=1, help=(
        "with --first-last-layers-bf16: how many layers at the start stay out of FP8"))
    moe_router_padding_for_fp8: bool = flag("--moe-router-padding-for-fp8", default=False, help=(
        "FP8 MoE: pad each expert's rows to a multiple of 16 (zeros, dropped after) so that its FP8 GEMMs run "
        "on the kernel, which needs whole multiples of 16"))
    num_layers_at_end_in_bf16: int = flag("--num-layers-at-end-in-bf16", non_negative_int, default=1, help=(
        "with --first-last-layers-bf16: how many layers at the end stay out of FP8"))

    def fp8_layer(self, layer_number: int) -> bool:
        """Whether 1-based transformer layer ``layer_number`` runs its GEMMs in FP8 (--fp8-format given and
        the layer not among those --first-last-layers-bf16 keeps out)."""
        if self.fp8_format is None:
            return False
        if not self.first_last_layers_bf16:
            return True
        return self.num_layers_at_start_in_bf16 < layer_number <= self.num_layers - self.num_layers_at_end_in_bf16


@dataclass(kw_only=True)
class Fp8GatherFields:
    """ParallelConfig's FP8 field: how ZeRO gathers the FP8 layers' weights."""
    fp8_param_gather: bool = flag("--fp8-param-gather", default=False, help=(
        "ZeRO: gather the weights of FP8 layers in FP8 with their scales (half bf16's bytes); needs a sharding "
        "strategy, and --fp8-recipe tensorwise, delayed or blockwise to take effect"))
