"""Muon (--optimizer muon) in the planner: which of a rank's parameters it steps, the logical matrices
Newton-Schulz orthogonalises, their FLOPs, and the gathers of --muon-tp-mode duplicated.

As optim/muon_matrices.py decides: the weight matrices of the transformer layers (QKV and the output
projection, MLA's down and up projections, fc1 and fc2, the shared expert's and its gate, every expert, an
MTP depth's eh_proj) are Muon's, with one fp32 momentum each; the embedding, the output layer, the routers,
norms and biases are AdamW's, with two moments. Each parameter's full weight splits into logical matrices:
Q, K and V (one fused matrix with --muon-no-split-qkv), gate and up (one with --muon-fused-gate-up), each
expert on its own.

Newton-Schulz of a logical matrix of shape (m, n), m <= n, costs 4 m^2 n + 2 m^3 FLOPs per iteration
(optim/muon_cost.newton_schulz_flops, which derives it), --muon-num-ns-steps iterations once per optimizer
step, in bf16 (--muon-fp32-matmul-prec medium) or fp32.
Who runs it: every rank that updates the matrix. Under --muon-tp-mode duplicated each TP rank first
all-gathers the fp32 update input of a TP-sharded matrix over TP and runs Newton-Schulz on the whole matrix
(the work is not divided by TP); a TP-replicated matrix (MLA's down projections, the shared expert's gate)
is whole on each rank already. Under ZeRO (the whole-parameter layout Muon runs on) each data-parallel rank
updates only the parameters it owns, balanced by these FLOPs (each rank within the largest matrix's cost
of the mean): the planner counts the mean share, 1/d.
"""
from __future__ import annotations

from dataclasses import dataclass

from megalite.config.schema import ModelConfig
from megalite.config.muon_fields import MuonFields
from megalite.optim.muon_cost import newton_schulz_flops
from megalite.planning.deepseek import mtp_depths
from megalite.planning.inputs import (Layout, Workload, holds_head, layer_experts, local_attention_heads,
                                      rank_layer_numbers)


@dataclass(frozen=True)
class MatrixParam:
    """One parameter Muon steps, on one rank."""
    local: int                              # its elements on the rank
    blocks: tuple[tuple[int, int], ...]     # the logical matrices (rows, cols) of its full weight
    sharded: bool = False                   # TP-sharded: duplicated mode gathers it whole
    expert: bool = False                    # an MoE expert weight (sharded by ZeRO over EDP)

    @property
    def full(self) -> int:
        """Elements of the full weight."""
        return sum(rows * cols for rows, cols in self.blocks)


def _gated(rows: int, cols: int, model: ModelConfig, muon: MuonFields) -> tuple[tuple[int, int], ...]:
    """The logical matrices of an fc1 of ``rows`` = f (2f gated) full rows: gate and up, or one."""
    if model.gated_linear_unit and not muon.muon_fused_gate_up:
        return ((rows // 2, cols),) * 2
    return ((rows, cols),)


def attention_matrices(model: ModelConfig, muon: MuonFields, tp: int) -> list[MatrixParam]:
    """The attention's matrices on one TP rank (SelfAttention, or MLA's projections)."""
    h, sharded, heads = model.hidden_size, tp > 1, model.num_attention_heads
    if model.multi_latent_attention:
        qk, n = model.qk_head_dim + model.qk_pos_emb_head_dim, heads // tp
        r_kv = model.kv_lora_rank
        if model.q_lora_rank:
            query = [MatrixParam(model.q_lora_rank * h, ((model.q_lora_rank, h),)),      # replicated
                     MatrixParam(n * qk * model.q_lora_rank, ((heads * qk, model.q_lora_rank),), sharded)]
        else:
            query = [MatrixParam(n * qk * h, ((heads * qk, h),), sharded)]
        up = heads * (model.qk_head_dim + model.v_head_dim)
        return query + [MatrixParam((r_kv + model.qk_pos_emb_head_dim) * h, ((r_kv + model.qk_pos_emb_head_dim, h),)),
                        MatrixParam(up // tp * r_kv, ((up, r_kv),), sharded),
                        MatrixParam(h * n * model.v_head_dim, ((h, heads * model.v_head_dim),), sharded)]
    d, groups = model.kv_channels, model.num_query_groups
    local_heads, local_groups = local_attention_heads(model, tp)
    qkv = ((heads * d, h), (groups * d, h), (groups * d, h)) if muon.muon_split_qkv else (((heads + 2 * groups) * d, h),)
    return [MatrixParam((local_heads + 2 * local_groups) * d * h, qkv, sharded),
            MatrixParam(local_heads * d * h, ((h, heads * d),), sharded)]


def mlp_matrices(model: ModelConfig, muon: MuonFields, tp: int, ffn: int) -> list[MatrixParam]:
    """fc1 and fc2 of a tensor-parallel MLP of hidden size ``ffn``."""
    h, rows = model.hidden_size, (2 if model.gated_linear_unit else 1) * ffn
    return [MatrixParam(rows // tp * h, _gated(rows, h, model, muon), tp > 1),
            MatrixParam(h * (ffn // tp), ((h, ffn),), tp > 1)]


def layer_matrices(model: ModelConfig, muon: MuonFields, tp: int,
                   experts: tuple[int, int] | None = None) -> list[MatrixParam]:
    """One transformer layer's Muon parameters on one rank (``experts``: (EP, ETP) of an MoE layer): the
    attention's, then the MLP's, or the rank's experts' stacked fc1 and fc2 and the shared expert's."""
    matrices = attention_matrices(model, muon, tp)
    if experts is None:
        return matrices + mlp_matrices(model, muon, tp, model.ffn_hidden_size)
    ep, etp = experts
    h, f, local = model.hidden_size, model.expert_ffn_hidden_size, model.num_experts // ep
    rows = (2 if model.gated_linear_unit else 1) * f
    matrices += [MatrixParam(local * rows // etp * h, _gated(rows, h, model, muon) * local, etp > 1, expert=True),
                 MatrixParam(local * h * (f // etp), ((h, f),) * local, etp > 1, expert=True)]
    shared = model.moe_shared_expert_intermediate_size or 0
    if shared:
        matrices += mlp_matrices(model, muon, tp, shared)
        matrices += [MatrixParam(h, ((1, h),))] if model.moe_shared_expert_gate else []
    return matrices


def rank_matrices(workload: Workload, layout: Layout, pp_rank: int) -> list[MatrixParam]:
    """Every Muon parameter of pipeline rank ``pp_rank`` (one TP rank): its layers', and on the last stage
    the MTP depths' (a layer of the last layer's kind and eh_proj [h, 2h] each); none under AdamW."""
    if workload.optimizer != "muon":
        return []
    model, muon = workload.model, workload.muon
    kinds = {}
    for chunk in rank_layer_numbers(workload, layout, pp_rank):
        for number in chunk:
            kind = layer_experts(model, layout, number)
            kinds[kind] = kinds.get(kind, 0) + 1
    if holds_head(layout, pp_rank) and mtp_depths(model):
        kind = layer_experts(model, layout, model.num_layers)
        kinds[kind] = kinds.get(kind, 0) + mtp_depths(model)
    matrices = [m for kind, count in kinds.items() for m in layer_matrices(model, muon, layout.tp, kind) * count]
    h = model.hidden_size
    if holds_head(layout, pp_rank):
        matrices += [MatrixParam(h // layout.tp * 2 * h, ((h, 2 * h),), layout.tp > 1)] * mtp_depths(model)
    return matrices


def matrix_elements(workload: Workload, layout: Layout, pp_rank: int) -> tuple[int, int]:
    """(dense, expert) elements of pipeline rank ``pp_rank`` that Muon steps (one TP rank)."""
    matrices = rank_matrices(workload, layout, pp_rank)
    return (sum(m.local for m in matrices if not m.expert), sum(m.local for m in matrices if m.expert))


def optimizer_step_work(workload: Workload, layout: Layout, pp_rank: int) -> tuple[float, float]:
    """(Newton-Schulz FLOPs, bytes of fp32 matrices gathered whole over TP) of one optimizer step on one
    rank of pipeline rank ``pp_rank``: every matrix it updates run whole (module docstring), the share of
    one data-parallel rank under ZeRO (1/d dense, 1/EDP experts)."""
    steps = workload.muon.muon_num_ns_steps
    flops = gathered = 0.0
    for m in rank_matrices(workload, layout, pp_rank):
        owners = 1 if layout.sharding == "no_shard" else (layout.expert_zero_shards if m.expert else layout.zero_shards)
        flops += sum(newton_schulz_flops(rows, cols, steps) for rows, cols in m.blocks) / owners
        gathered += 4 * m.full / owners if m.sharded else 0.0
    return flops, gathered
