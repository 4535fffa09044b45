"""Mixture of Experts in the planner: what an MoE layer (model/moe.py) keeps for backward, holds at its
backward's fullest moment, sends through its dispatcher and computes, on one rank.

Notation (per micro-batch, per rank): T the rank's own tokens (its sequence-parallel share: each rank
routes its own tokens), k experts per token, E experts of f hidden each (--moe-ffn-hidden-size), h the
hidden size, e bytes per element of the compute dtype; a rank holds E/EP experts, f/ETP of each.

The rows an EP rank receives: every rank sends T x k (token, expert) rows; spread evenly over the EP ranks
a rank receives T x k, and gathering them over its ETP group (parallel/expert/dispatch.py) makes
R = ETP x T x k rows per rank, each with f/ETP hidden units (the allgather dispatcher keeps the same rows:
the g = EP x ETP ranks' tokens, of which 1/EP are routed to its experts). Dropless routing is not even: the
busiest rank receives more, so R and everything sized by it is planned at ``Workload.dispatch_margin``
times the mean (inputs.MOE_IMBALANCE_MARGIN explains the default).
"""
from __future__ import annotations

from megalite.planning.inputs import Layout, Workload, token_counts


def dispatched_rows(workload: Workload, layout: Layout, tokens: int) -> float:
    """R: rows the busiest rank's experts process for ``tokens`` own tokens (module docstring)."""
    k = workload.model.moe_router_topk
    return layout.expert_tp * tokens * k * workload.dispatch_margin


def shared_expert_bytes(workload: Workload, layout: Layout, tokens: int) -> float:
    """What the shared expert (a tensor-parallel MLP over the sequence gathered again, SharedExpert) keeps:
    as the dense MLP, fc1's output and fc2's input (SwiGLU, silu recomputed; GELU: 2 f_s/t), plus, when
    gated, its output [s/t, b, h] for the sigmoid gate's product."""
    model, e = workload.model, workload.dtype_bytes
    fs = (model.moe_shared_expert_intermediate_size or 0) // layout.tp
    if not fs:
        return 0.0
    _, sp_tokens = token_counts(workload, layout)
    gate = sp_tokens * model.hidden_size * e if model.moe_shared_expert_gate else 0
    return (3 if model.gated_linear_unit else 2) * tokens * fs * e + gate


def moe_activation_bytes(workload: Workload, layout: Layout) -> float:
    """Bytes an MoE layer's MLP keeps for backward for one micro-batch (what replaces the dense MLP's
    fc1/fc2 terms in memory.layer_activation_bytes; its input, the pre-MLP norm's output, is counted there):

    - router, in fp32: its fp32 copy of the input [T, h] (unless the model is fp32), the softmax (or
      sigmoid) scores [T, E] the balancing loss and top-k read, the top-k weights [T, k], and with a
      z-loss the logits [T, E] logsumexp keeps;
    - the experts: their input rows [R, h] (fc1's grouped GEMM keeps them), fc1's output [R, 2f/ETP] with
      silu(gate) and the fc2 input, f/ETP each (SwiGLU, F.silu(gate) * up: 4f/ETP per row; GELU keeps fc1's
      output and the activation, 2f/ETP), the int64 sort orders of the rows;
    - combine: the experts' output rows before the routing weights multiply them, [T k, h] (alltoall: back
      on the token's rank) or [R, h] (allgather: the weighted sum runs on the expert's rank);
    - the shared expert (``shared_expert_bytes``)."""
    model, e = workload.model, workload.dtype_bytes
    tokens, sp_tokens = token_counts(workload, layout)
    h, E, k = model.hidden_size, model.num_experts, model.moe_router_topk
    f = model.expert_ffn_hidden_size // layout.expert_tp
    rows = dispatched_rows(workload, layout, sp_tokens)
    router = sp_tokens * (E * 4 + k * 4 + (E * 4 if model.moe_z_loss_coeff else 0) + (h * 4 if e != 4 else 0))
    experts = rows * (h + (4 if model.gated_linear_unit else 2) * f) * e + rows * 8 * 2
    combine_rows = rows if model.moe_token_dispatcher_type == "allgather" else sp_tokens * k
    combine = combine_rows * h * e + sp_tokens * k * 8
    return router + experts + combine + shared_expert_bytes(workload, layout, tokens)


def moe_backward_bytes(workload: Workload, layout: Layout) -> float:
    """The most bytes backward through an MoE layer's MLP holds beyond the kept activations (the gradient
    arriving at the layer's output is counted by the caller), the largest of its moments, R rows of f/ETP:

    - fc2's grouped GEMM: the gradient of its output rows [R, h] (the ETP all-gather's), of its input
      [R, f] and of the rank's fc2 weights [E/EP, h, f];
    - the activation: SwiGLU's autograd holds the product's gradient and those of silu, up and gate, f
      each, and their concatenation 2f; GELU two f gradients;
    - fc1's grouped GEMM: the gradient of its output [R, 2f], of its input rows [R, h] and of the rank's
      fc1 weights [E/EP, 2f, h].
    The shared expert's backward, a dense MLP's, is another moment (memory.layer_backward_bytes)."""
    model, e = workload.model, workload.dtype_bytes
    _, sp_tokens = token_counts(workload, layout)
    h, local = model.hidden_size, model.num_experts // layout.ep
    f = model.expert_ffn_hidden_size // layout.expert_tp
    rows = dispatched_rows(workload, layout, sp_tokens)
    fc1_out = 2 * f if model.gated_linear_unit else f
    fc2 = rows * (h + f) * e + local * h * f * e
    activation = rows * f * (6 if model.gated_linear_unit else 2) * e
    fc1 = rows * (fc1_out + h) * e + local * fc1_out * h * e
    return max(fc2, activation, fc1)


def dispatch_bytes(workload: Workload, layout: Layout) -> float:
    """Bytes one rank sends per MoE layer and micro-batch, forward and backward (parallel/expert/dispatch.py).

    alltoall: forward, T k rows of h out to their experts and back (2 T k h e), (EP-1)/EP of them to
    other ranks; with ETP > 1 the received rows are all-gathered over ETP and the partial outputs
    reduce-scattered back, (ETP-1) T k h e each; backward sends the gradients the same ways: 4 x all of it.
    allgather: the g = EP x ETP group gathers every rank's tokens, (g-1) T h e, with their k expert ids
    (int64) and weights (fp32), and reduce-scatters the outputs, (g-1) T h e; backward the same again.
    The busiest rank's imbalance (``Workload.dispatch_margin``) is left to its compute: a ring's volume
    per rank is the mean."""
    model, e = workload.model, workload.dtype_bytes
    _, sp_tokens = token_counts(workload, layout)
    h, k, ep, etp = model.hidden_size, model.moe_router_topk, layout.ep, layout.expert_tp
    if model.moe_token_dispatcher_type == "allgather":
        g = ep * etp
        forward = (g - 1) * sp_tokens * (2 * h * e + k * 12)
        return 2 * forward
    rows = sp_tokens * k * h * e
    forward = 2 * rows * (ep - 1) / ep + 2 * (etp - 1) * rows
    return 2 * forward
