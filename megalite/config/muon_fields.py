"""OptimizerConfig's fields for --optimizer muon, and ModelConfig's for QK-clip. Flag names and defaults are
Megatron's.

Muon keeps one momentum per weight matrix and steps each matrix by its momentum orthogonalised with a
few Newton-Schulz iterations, scaled by the matrix's shape (--muon-scale-mode) and by
--muon-extra-scale-factor: ``spectral`` x 0.2 is torch.optim.Muon's ``match_rms_adamw`` (0.2 x
sqrt(max(rows, cols))), which lets Muon reuse AdamW's learning rate and weight decay. The matrices of the
transformer layers go to Muon; the embedding, output layer, norms, biases and routers go to the scalar
optimizer (--muon-scalar-optimizer), whose embedding and output layer take --decoupled-lr when given.

QKClipFields are ModelConfig's fields for QK-clip (MuonClip, Kimi K2), which runs with any optimizer, and
for logging the max attention logit. After each optimizer step, every attention head whose largest
pre-softmax logit q.k x scale of the step exceeded --qk-clip-threshold t has its query and key weights
rescaled so that that logit would be t:
eta = min(t / max logit, 1), queries x eta^alpha and keys x eta^(1 - alpha) (--qk-clip-alpha). Under
grouped-query attention a key serves several query heads, so a group takes the largest logit of its heads.
Under multi-latent attention the no-RoPE query part takes eta^alpha, its key part eta^(1 - alpha), and the
RoPE query part the whole eta (its key is shared by every head and stays as it is).
"""
from __future__ import annotations

from dataclasses import dataclass

from megalite.config.cli import number, positive_int
from megalite.config.fields import flag

# the Newton-Schulz coefficient sets (a, b, c) each --muon-coefficient-type cycles through, one per iteration
NS_COEFFICIENTS = {
    "simple": ((3.4445, -4.7750, 2.0315),),                  # Keller Jordan's, torch.optim.Muon's default
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),     # modded-nanogpt's, Megatron's default
}
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_TP_MODES = ("duplicated", "distributed", "blockwise")
MUON_MATMUL_PRECS = ("low", "medium", "high")          # Megatron's; only medium is bf16 (the flag's help)


@dataclass(kw_only=True)
class MuonFields:
    muon_momentum: float = flag("--muon-momentum", number, default=0.9, help=(
        "Muon: the momentum's decay (buffer = momentum x buffer + (1 - momentum) x gradient)"))
    muon_nesterov: bool = flag("--muon-nesterov", default=False, help=(
        "Muon: orthogonalise (1 - momentum) x gradient + momentum x buffer instead of the buffer"))
    muon_num_ns_steps: int = flag("--muon-num-ns-steps", positive_int, default=5, help="Muon: Newton-Schulz iterations")
    muon_coefficient_type: str = flag("--muon-coefficient-type", default="quintic", choices=tuple(NS_COEFFICIENTS),
                                      help=("Muon: Newton-Schulz coefficients; quintic cycles five sets, simple is "
                                            "(3.4445, -4.775, 2.0315) as torch.optim.Muon"))
    muon_scale_mode: str = flag("--muon-scale-mode", default="spectral", choices=MUON_SCALE_MODES, help=(
        "Muon: update scale by the logical matrix's shape: spectral sqrt(max(rows, cols)), unit_rms_norm "
        "sqrt(rows / cols), shape_scaling sqrt(max(1, rows / cols))"))
    muon_extra_scale_factor: float = flag("--muon-extra-scale-factor", number, default=1.0, help=(
        "Muon: further update scale (0.2 with spectral = torch.optim.Muon's match_rms_adamw)"))
    muon_fp32_matmul_prec: str = flag("--muon-fp32-matmul-prec", default="medium", choices=MUON_MATMUL_PRECS, help=(
        "Muon: medium runs Newton-Schulz in bf16 as torch.optim.Muon (cast, then normalise); high in fp32, at "
        "the run's fp32 matmul precision (TF32 on GPUs unless --no-tf32); low is Megatron's value that torch's "
        "set_float32_matmul_precision ignores, leaving the run's precision: the same as high"))
    muon_scalar_optimizer: str = flag("--muon-scalar-optimizer", default="adam", choices=("adam",), help=(
        "Muon: the optimizer of the embedding, output layer, norms, biases and routers (AdamW)"))
    muon_split_qkv: bool = flag("--muon-no-split-qkv", default=True, help=(
        "Muon: orthogonalise the fused QKV weight as one matrix instead of Q, K and V separately"))
    muon_fused_gate_up: bool = flag("--muon-fused-gate-up", default=False, help=(
        "Muon: orthogonalise a gated MLP's fused [gate; up] weight as one matrix (Megatron) instead of gate "
        "and up separately (as the imported models hold them)"))
    muon_tp_mode: str = flag("--muon-tp-mode", default="duplicated", choices=MUON_TP_MODES, help=(
        "Muon under tensor parallelism: duplicated gathers each sharded matrix's momentum over TP and runs "
        "Newton-Schulz on the whole matrix on every TP rank; distributed runs it on each rank's part with "
        "all-reduces of the small Gram matrix over TP (equal to duplicated up to rounding); blockwise "
        "orthogonalises each rank's part as a matrix of its own, scaled by its shape, with no communication: "
        "the result then depends on the TP size"))


@dataclass(kw_only=True)
class QKClipFields:
    qk_clip: bool = flag("--qk-clip", default=False, help=(
        "after each optimizer step, rescale the query and key weights of every head whose max attention logit "
        "exceeded --qk-clip-threshold (MuonClip); also logs the max logit"))
    qk_clip_alpha: float = flag("--qk-clip-alpha", number, default=0.5, help=(
        "QK-clip: queries take eta^alpha and keys eta^(1 - alpha) of the rescale eta = threshold / max logit"))
    qk_clip_threshold: float = flag("--qk-clip-threshold", number, default=100.0, help=(
        "QK-clip: the largest attention logit q.k x scale a head may keep"))
    log_max_attention_logit: bool = flag("--log-max-attention-logit", default=False, help=(
        "log the largest attention logit of the model over each step (implied by --qk-clip)"))

    @property
    def records_max_logit(self) -> bool:
        """Whether attention records its per-head max logit on the training forward (an extra q k^T pass)."""
        return self.qk_clip or self.log_max_attention_logit
