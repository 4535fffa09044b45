"""The Mixture-of-Experts layer: a router picks top-k experts per token, the experts run as grouped GEMMs,
an optional shared expert sees every token. It replaces the MLP in the layers --moe-layer-freq selects.

Router (``Router``), in fp32 (--moe-router-dtype): logits = x W^T [T, E], then
- softmax (Mixtral, Qwen3-MoE): softmax over the top-k logits, or with --moe-router-pre-softmax softmax
  over all experts and the top-k of those, not renormalised (Qwen2-MoE);
- sigmoid (DeepSeek-V3): sigmoid scores, top-k on scores + expert bias, weights = the top-k scores
  normalised to sum 1 (k > 1);
then x --moe-router-topk-scaling-factor. Group-limited routing (--moe-router-num-groups and
--moe-router-group-topk) keeps each top-k within the token's best groups of experts (``Router.limit_to_groups``).
Without --disable-bias-linear the logits have a bias, and each expert's two GEMMs theirs (GPT-OSS, as Megatron's --add-bias-linear); the second bias is added before the
routing weight multiplies the expert's output.

Load balancing, added to the loss through the gradient of the layer's output (``_AttachLoss``) with the
loss's own scale (loss scale / micro-batches, set per step on ``MoEContext``):
- aux_loss (Switch/GShard): coeff x E / (k T^2) x sum_e P_e N_e, P_e the summed scores of expert e over
  the micro-batch's T tokens, N_e the tokens routed to it;
- seq_aux_loss: the same per sequence (s tokens), averaged over the micro-batch's sequences;
- z-loss (ST-MoE): coeff x mean over tokens of logsumexp(logits)^2;
- expert bias (auxiliary-loss-free, DeepSeek-V3): a per-expert bias, not a parameter, moved once per step
  by rate x sign(mean load - load of e) over the whole step's tokens (``update_expert_bias``).
Under sequence/context parallelism a rank holds part of each sequence: the counts N are summed over the
TP x CP ranks, P over the rank's own tokens, so the ranks' partial losses add up to the serial one.

Capacity (--moe-expert-capacity-factor f): an expert keeps at most ceil(f x T k / E) of a rank's T
tokens, chosen by weight (--moe-token-drop-policy probs) or by position; T is the rank's own tokens, so
with a capacity which tokens drop depends on the layout (sequence, context and data parallel splits).
Dropless (no factor) is layout-independent.

Experts are stacked: a rank holds [E/EP, 2f/ETP (f/ETP without SwiGLU), h] and [E/EP, h, f/ETP], its EP
rank's experts and its ETP rank's part of f (parallel/expert/dispatch.py). Checkpoints and conversions
see one 2-D tensor per layer, each expert's rows at its offset: ``mlp.experts.linear_fc1.weight``
[E x 2f, h] (expert e's [gate; up] at rows e x 2f) and ``mlp.experts.linear_fc2.weight`` [E x h, f]
(expert e's fc2 weight at rows e x h), so they reshard like any other tensor; their biases
``linear_fc1.bias`` [E x 2f] and ``linear_fc2.bias`` [E x h] likewise.
"""
from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from megalite.config.schema import ModelConfig
from megalite.model.mlp import MLP, quick_geglu_of
from megalite.parallel.expert.dispatch import ExpertParallel, MoEContext, Routed, dispatch
from megalite.parallel.param_meta import mark
from megalite.parallel.pipeline.split_backward import input_grads_to_compute
from megalite.precision.fp8_layout import TOKENS, GemmLayout
from megalite.precision.fp8_quant import KERNEL_ALIGNMENT
from megalite.precision.gemm import DEFAULT_RECIPE, GemmPrecision, build_gemm_precision


class _AttachLoss(torch.autograd.Function):
    """Identity on ``out``; backward also sends ``scale`` into ``loss`` (an auxiliary loss)."""

    @staticmethod
    def forward(ctx, out, loss, scale: float):
        ctx.scale = scale
        ctx.shape, ctx.dtype = loss.shape, loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.shape, ctx.scale, dtype=ctx.dtype, device=grad.device), None


class Router(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, moe: MoEContext, sequence_parallel: bool):
        super().__init__()
        self.config, self.moe = config, moe
        self.num_experts, self.topk = config.num_experts, config.moe_router_topk
        self.dtype = torch.float64 if config.moe_router_dtype == "fp64" else torch.float32
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=dtype))
        mark(self.weight, sequence_parallel=sequence_parallel)    # each TP rank routes its own tokens
        self.bias = None
        if config.add_bias_linear:
            self.bias = mark(nn.Parameter(torch.empty(config.num_experts, dtype=dtype)),
                             sequence_parallel=sequence_parallel)
        # buffers have storage even when the model is built on the meta device (the trainer moves them)
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, device="cpu"))
        else:
            self.expert_bias = None
        # this step's tokens per expert (bias update, load statistics), summed over micro-batches; this rank's
        # auxiliary-loss shares and forwards since the log last read them (train/metrics.py's MoEStats)
        self.register_buffer("step_counts", torch.zeros(config.num_experts, device="cpu"), persistent=False)
        self.register_buffer("loss_sums", torch.zeros(3, device="cpu"), persistent=False)   # aux, z, forwards
        self.last_load = None                                                    # of the last finished step

    def forward(self, x: torch.Tensor, seq_shape: tuple) -> tuple[Routed, torch.Tensor]:
        """x [T, h] (T = s x b, sequence-major) -> (the routing, the scalar auxiliary loss to attach)."""
        bias = None if self.bias is None else self.bias.to(self.dtype)
        logits = F.linear(x.to(self.dtype), self.weight.to(self.dtype), bias)
        scores, experts, weights = self.top_k(logits)
        routing = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, experts, True)
        if self.training:
            self.step_counts += routing.sum(0)          # this rank's own tokens; summed per step in finalize
        counts = self.global_counts(routing.to(logits.dtype), seq_shape)
        loss = self.balancing_loss(logits, scores, counts, seq_shape)
        keep = self.capacity_mask(routing, scores, experts) if self.config.moe_expert_capacity_factor else None
        return Routed(x, experts, weights, keep), loss

    def top_k(self, logits: torch.Tensor):
        """(scores [T, E] for the balancing loss, expert ids [T, k], routing weights [T, k])."""
        c, k = self.config, self.topk
        if c.moe_router_score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            biased = scores if self.expert_bias is None else scores + self.expert_bias
            experts = self.select(biased)
            weights = scores.gather(1, experts)
            if k > 1:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        else:
            scores = torch.softmax(logits, dim=-1)
            if c.moe_router_pre_softmax:
                experts = self.select(scores)
                weights = scores.gather(1, experts)
            else:
                experts = self.select(logits)
                weights = torch.softmax(logits.gather(1, experts), dim=-1)
        if c.moe_router_topk_scaling_factor:
            weights = weights * c.moe_router_topk_scaling_factor
        return scores, experts, weights

    def select(self, values: torch.Tensor) -> torch.Tensor:
        """Expert ids [T, k]: the top-k of ``values`` [T, E] (inside the kept groups with group-limited routing)."""
        if self.config.moe_router_force_load_balancing:     # benchmarks: token t -> experts (t k + j) mod E
            t = values.shape[0]
            return torch.arange(t * self.topk, device=values.device).view(t, self.topk) % self.num_experts
        if self.config.moe_router_num_groups:
            values = self.limit_to_groups(values)
        return torch.topk(values, self.topk, dim=-1).indices

    def limit_to_groups(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` [T, E] with the experts outside each token's kept groups set to -inf (group-limited
        routing, DeepSeek-V2/V3): E splits into --moe-router-num-groups G groups of consecutive experts, a
        group scores the sum of its top-(k / g) values, and each token keeps its best g = --moe-router-group-topk
        groups. With G = the nodes of the expert-parallel group, a token's experts span at most g nodes."""
        t, groups, keep = values.shape[0], self.config.moe_router_num_groups, self.config.moe_router_group_topk
        grouped = values.view(t, groups, -1)
        group_scores = grouped.topk(self.topk // keep, dim=-1).values.sum(-1)            # [T, G]
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(keep, dim=-1).indices, True)
        return grouped.masked_fill(~kept[..., None], float("-inf")).view(t, -1)

    def global_counts(self, routing: torch.Tensor, seq_shape: tuple) -> torch.Tensor:
        """Tokens per expert [E] over the micro-batch (seq_aux_loss: per sequence [b, E]), summed over the
        ranks that hold parts of the same sequences."""
        if self.config.moe_router_load_balancing_type == "seq_aux_loss":
            counts = routing.view(seq_shape[0], seq_shape[1], -1).sum(0)
        else:
            counts = routing.sum(0)
        counts = counts.detach()
        if self.moe.sequence_group is not None:
            dist.all_reduce(counts, group=self.moe.sequence_group)
        return counts

    def balancing_loss(self, logits, scores, counts, seq_shape) -> torch.Tensor:
        """This rank's share of the auxiliary losses (module docstring), also added to ``loss_sums``."""
        c, E, k = self.config, self.num_experts, self.topk
        total = logits.shape[0] * self.moe.sequence_split          # the micro-batch's tokens
        aux = logits.new_zeros(())
        if c.moe_router_load_balancing_type == "aux_loss" and c.moe_aux_loss_coeff:
            aux = (scores.sum(0) * counts).sum() * (c.moe_aux_loss_coeff * E / (k * total * total))
        elif c.moe_router_load_balancing_type == "seq_aux_loss" and c.moe_aux_loss_coeff:
            s, b = seq_shape[0] * self.moe.sequence_split, seq_shape[1]
            per_seq = scores.view(seq_shape[0], b, E).sum(0) / s           # [b, E] mean score (local share)
            aux = (per_seq * counts * (E / (k * s))).sum() * (c.moe_aux_loss_coeff / b)
        z = logits.new_zeros(())
        if c.moe_z_loss_coeff:
            z = torch.logsumexp(logits, dim=-1).square().sum() * (c.moe_z_loss_coeff / total)
        if self.training:
            with torch.no_grad():
                self.loss_sums += torch.stack([aux.detach(), z.detach(), torch.ones_like(aux)]).float()
        return aux + z

    def capacity(self, num_tokens: int) -> int:
        """Assignments an expert keeps of one rank's ``num_tokens`` tokens (--moe-expert-capacity-factor)."""
        return math.ceil(self.config.moe_expert_capacity_factor * num_tokens * self.topk / self.num_experts)

    def capacity_mask(self, routing, scores, experts) -> torch.Tensor:
        """[T, k] False for the assignments beyond an expert's capacity (module docstring)."""
        t = routing.shape[0]
        capacity = self.capacity(t)
        if self.config.moe_token_drop_policy == "position":
            kept = routing & (routing.long().cumsum(0) <= capacity)
        else:
            weight = torch.where(routing, scores.detach(), torch.full_like(scores, -1.0))
            top = torch.topk(weight, min(capacity, t), dim=0).indices           # [capacity, E]
            kept = torch.zeros_like(routing).scatter_(0, top, True) & routing
        return kept.gather(1, experts)

    @torch.no_grad()
    def finish_step(self, load: torch.Tensor) -> None:
        """Once per step, outside autograd, with ``load`` the step's tokens per expert over every rank of the
        pipeline stage: bias_e += rate x sign(mean load - load_e); keep the load for the log (``last_load``)
        and start the next step's counts."""
        if self.expert_bias is not None:
            self.expert_bias += self.config.moe_router_bias_update_rate * torch.sign(load.mean() - load)
        self.last_load = load.clone()
        self.step_counts.zero_()


def _stacked_weight(shape: tuple, full: tuple, dtype: torch.dtype, take_rows, take_cols=None) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype))
    return mark(param, full_shape=full, take_shard=take_rows, take_cols=take_cols, expert=True)


class GroupedExperts(nn.Module):
    """This rank's experts: two GEMMs per expert over rows grouped by expert, as one autograd node, run by
    the layer's ``precision`` (the GemmPrecision of the recipe ``gemm_recipe`` names)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, ep: ExpertParallel, gemm_recipe: str = DEFAULT_RECIPE):
        super().__init__()
        E, h, f = config.num_experts, config.hidden_size, config.expert_ffn_hidden_size
        self.activation = "swiglu" if config.swiglu else quick_geglu_of(config) if config.quick_geglu else \
            "tanh" if config.openai_gelu else "none"
        mine, etp, r = ep.local_experts(E), ep.etp_size, ep.etp_rank
        local_f, halves = f // etp, 2 if config.gated_linear_unit else 1

        def fc1_rows(rows: torch.Tensor) -> torch.Tensor:        # [E * halves * f] -> this rank's
            block = rows.view(E, halves, f)[mine.start:mine.stop]
            return block[:, :, r * local_f:(r + 1) * local_f].reshape(-1)

        def fc2_rows(rows: torch.Tensor) -> torch.Tensor:        # [E * h] -> this rank's experts' rows
            return rows.view(E, h)[mine.start:mine.stop].reshape(-1)

        def fc2_cols(cols: torch.Tensor) -> torch.Tensor:
            return cols.reshape(-1)[r * local_f:(r + 1) * local_f]

        self.linear_fc1 = nn.Module()
        self.linear_fc1.weight = _stacked_weight((len(mine), halves * local_f, h), (E * halves * f, h), dtype,
                                                 fc1_rows)
        self.linear_fc2 = nn.Module()
        self.linear_fc2.weight = _stacked_weight((len(mine), h, local_f), (E * h, f), dtype, fc2_rows, fc2_cols)
        self.linear_fc1.bias = self.linear_fc2.bias = None
        if config.add_bias_linear:      # whole experts only (ETP 1: config/validate.py), so fc2's bias added once
            self.linear_fc1.bias = _stacked_weight((len(mine), halves * local_f), (E * halves * f,), dtype, fc1_rows)
            self.linear_fc2.bias = _stacked_weight((len(mine), h), (E * h,), dtype, fc2_rows)
        # FP8: ETP cuts each expert's hidden dimension, so a scaling block along it spans the ETP ranks
        layout = GemmLayout(ep.etp_group, etp, EXPERT_FFN) if etp > 1 else None
        self.precision = build_gemm_precision(gemm_recipe, layout)

    def forward(self, rows: torch.Tensor, counts: list, segments: list | None = None) -> torch.Tensor:
        """rows [N, h] grouped by local expert, ``counts`` rows per expert -> partial outputs [N, h].
        ``segments``: per expert, its rows' sizes per micro-batch (FP8 GEMMs scale each apart); None: one."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        return _ExpertMLP.apply(rows, fc1.weight, fc2.weight, fc1.bias, fc2.bias, counts, self.activation,
                                self.precision, segments)


# the axes of the experts' GEMM operands (precision/fp8_layout.py): fc1 maps HIDDEN to EXPERT_FFN, fc2 back;
# ETP cuts EXPERT_FFN. Per GEMM (forward, grad_input, grad_weight) the two operands' (M, K) axes.
EXPERT_FFN, HIDDEN = "expert_ffn", "hidden"
FC1_AXES = (((TOKENS, HIDDEN), (EXPERT_FFN, HIDDEN)), ((TOKENS, EXPERT_FFN), (HIDDEN, EXPERT_FFN)),
            ((EXPERT_FFN, TOKENS), (HIDDEN, TOKENS)))
FC2_AXES = (((TOKENS, EXPERT_FFN), (HIDDEN, EXPERT_FFN)), ((TOKENS, HIDDEN), (EXPERT_FFN, HIDDEN)),
            ((HIDDEN, TOKENS), (EXPERT_FFN, TOKENS)))


def _per_row(bias: torch.Tensor, counts: list, num_rows: int) -> torch.Tensor:
    """[E, n] one bias per expert -> [N, n] the bias of each row's expert (rows grouped by expert)."""
    repeats = torch.tensor(counts, device=bias.device)
    return torch.repeat_interleave(bias, repeats, dim=0, output_size=num_rows)


def _per_expert(grad: torch.Tensor, counts: list) -> torch.Tensor:
    """[N, n] rows grouped by expert -> [E, n] each expert's sum (a per-expert bias's gradient)."""
    return torch.stack([part.sum(0) for part in grad.split(counts)])


def _activate(hidden: torch.Tensor, activation) -> torch.Tensor:
    if activation == "swiglu":
        gate, up = hidden.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
    if callable(activation):
        return activation(hidden)
    return F.gelu(hidden, approximate=activation)


class _ExpertMLP(torch.autograd.Function):
    """fc2(act(fc1(rows))) per expert over rows grouped by expert; act is SwiGLU, GELU ("none"/"tanh") or a
    function of fc1's output (the quick GEGLU, whose gradient backward takes by autograd). With biases
    (``fc1_bias`` [E, 2f], ``fc2_bias`` [E, h], both or neither) each GEMM adds its expert's.

    One node instead of autograd's chain of grouped GEMMs, split, activation and product: it saves the
    rows, fc1's output and the activation (less than the chain keeps), and its backward writes each
    gradient once into its place (the gate and up halves of fc1's gradient side by side, every expert's
    weight gradient into one stacked tensor) instead of concatenating pieces. Its six grouped GEMMs are
    those of ``precision``; in the zero-bubble split B runs the input GEMMs, W the weight GEMMs (and again
    fc2's input GEMM, whose result fc1's weight gradient needs). Each GEMM also takes ``segments``
    (GroupedExperts.forward) and its operands' axes, which only an FP8 recipe uses."""

    @staticmethod
    def forward(ctx, rows, fc1, fc2, fc1_bias, fc2_bias, counts: list, activation, precision: GemmPrecision,
                segments: list | None):
        fp8_fc1, fp8_fc2 = ([dict(segments=segments, axes=gemm) for gemm in axes]
                            for axes in (FC1_AXES, FC2_AXES))
        hidden = precision.grouped_forward(rows, fc1, counts, **fp8_fc1[0])       # [N, 2f] or [N, f]
        if fc1_bias is not None:
            hidden = hidden + _per_row(fc1_bias, counts, hidden.shape[0])
        act = _activate(hidden, activation)
        ctx.save_for_backward(rows, fc1, fc2, hidden, act)
        ctx.counts, ctx.activation, ctx.precision, ctx.fp8 = counts, activation, precision, (fp8_fc1, fp8_fc2)
        out = precision.grouped_forward(act, fc2, counts, **fp8_fc2[0])
        if fc2_bias is not None:
            out = out + _per_row(fc2_bias, counts, out.shape[0])
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, fc1, fc2, hidden, act = ctx.saved_tensors
        counts, precision, (fp8_fc1, fp8_fc2) = ctx.counts, ctx.precision, ctx.fp8
        need_rows, need_fc1, need_fc2, need_b1, need_b2 = input_grads_to_compute(ctx)[:5]
        grad = grad.contiguous()
        d_fc2 = precision.grouped_grad_weight(grad, act, counts, **fp8_fc2[2]) if need_fc2 else None
        d_b2 = _per_expert(grad, counts) if need_b2 else None
        if not (need_rows or need_fc1 or need_b1):
            return None, None, d_fc2, None, d_b2, None, None, None, None
        d_act = precision.grouped_grad_input(grad, fc2, counts, **fp8_fc2[1])    # [N, f]
        if callable(ctx.activation):
            with torch.enable_grad():
                h = hidden.detach().requires_grad_()
                d_hidden, = torch.autograd.grad(ctx.activation(h), h, d_act)
        elif ctx.activation == "swiglu":
            gate, up = hidden.chunk(2, dim=-1)
            d_hidden = torch.empty_like(hidden)
            d_gate, d_up = d_hidden.chunk(2, dim=-1)
            torch.mul(F.silu(gate), d_act, out=d_up)
            torch.ops.aten.silu_backward.grad_input(d_act.mul_(up), gate, grad_input=d_gate)
        else:
            d_hidden = torch.ops.aten.gelu_backward(d_act, hidden, approximate=ctx.activation)
        d_rows = precision.grouped_grad_input(d_hidden, fc1, counts, **fp8_fc1[1]) if need_rows else None
        d_fc1 = precision.grouped_grad_weight(d_hidden, rows, counts, **fp8_fc1[2]) if need_fc1 else None
        d_b1 = _per_expert(d_hidden, counts) if need_b1 else None
        return d_rows, d_fc1, d_fc2, d_b1, d_b2, None, None, None, None


class SharedExpert(MLP):
    """An MLP every token goes through (tensor-parallel like the dense MLP), optionally gated per token by
    sigmoid(x . gate_weight) (Qwen2-MoE)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp):
        super().__init__(replace(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size), dtype, tp)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            self.gate_weight = nn.Parameter(torch.empty(1, config.hidden_size, dtype=dtype))
            mark(self.gate_weight, sequence_parallel=tp.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(x, self.gate_weight))
        return out


class MoELayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp, moe: MoEContext):
        super().__init__()
        self.config, self.moe = config, moe
        self.router = Router(config, dtype, moe, tp.sequence_parallel)
        self.experts = GroupedExperts(config, dtype, moe.ep, tp.gemm_recipe)
        # --moe-router-padding-for-fp8: every expert's rows a whole number of the FP8 kernels' alignment
        self.fp8_alignment = KERNEL_ALIGNMENT if config.moe_router_padding_for_fp8 else 1
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size:
            self.shared_experts = SharedExpert(config, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s, b, h] (this rank's tokens) -> [s, b, h]."""
        tokens = x.reshape(-1, x.shape[-1])
        with record_function("moe/router"):
            routed, loss = self.router(tokens, x.shape[:2])
        run = self.experts
        if self.config.moe_pad_expert_input_to_capacity:
            # each of the ranks sending rows to an expert sends at most its capacity
            run = partial(self.run_padded, width=self.router.capacity(tokens.shape[0]) * self.moe.ep.ep_size
                          * self.moe.ep.etp_size, align=self.fp8_alignment)
        elif self.fp8_alignment > 1:
            run = partial(self.run_padded, width=None, align=self.fp8_alignment)
        # FP8 scales each micro-batch's rows of an expert as the single process does, apart from other DP ranks'
        by_source = self.experts.precision.scales_per_microbatch
        with record_function("moe/dispatch"):     # profiler range; dispatch() opens its exchange/experts ranges in it
            out = dispatch(routed, run, self.config.num_experts, self.moe.ep, by_source).view_as(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.training and loss.requires_grad:
            out = _AttachLoss.apply(out, loss, self.moe.grad_scale * self.moe.cp_size)
        return out

    def run_padded(self, rows: torch.Tensor, counts: list, segments: list | None, width: int | None,
                   align: int = 1) -> torch.Tensor:
        """--moe-pad-expert-input-to-capacity: every expert computes ``width`` rows (a fixed shape);
        --moe-router-padding-for-fp8 (``align``): each expert's rows (``width``, or its own count when None)
        rounded up to a multiple of ``align``. The padding rows are zeros (no amax, no product), dropped
        after; they join an expert's last segment."""
        widths = [-(-(c if width is None else width) // align) * align for c in counts]
        if segments is not None:
            segments = [sizes[:-1] + [sizes[-1] + w - c] for sizes, w, c in zip(segments, widths, counts)]
        starts = [sum(widths[:e]) for e in range(len(widths))]
        index = torch.cat([torch.arange(c, device=rows.device) + start for start, c in zip(starts, counts)])
        padded = rows.new_zeros(sum(widths), rows.shape[1]).index_copy(0, index, rows)
        return self.experts(padded, widths, segments)[index]
