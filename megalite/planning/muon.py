"""Muon (--optimizer muon) in the planner: which of a rank's parameters it steps, the logical matrices
Newton-Schulz orthogonalises, their FLOPs, and the TP collectives of --muon-tp-mode.

As optim/muon_matrices.py decides: the weight matrices of the transformer layers (QKV and the output
projection, MLA's down and up projections, fc1 and fc2, the shared expert's and its gate, every expert, an
MTP depth's eh_proj) are Muon's, with one fp32 momentum each; the embedding, the output layer, the routers,
norms and biases are AdamW's, with two moments. Each parameter's full weight splits into logical matrices:
Q, K and V (one fused matrix with --muon-no-split-qkv), gate and up (one with --muon-fused-gate-up), each
expert on its own.

Newton-Schulz of a logical matrix of shape (m, n), m <= n, costs 4 m^2 n + 2 m^3 FLOPs per iteration
(optim/muon_cost.newton_schulz_flops, which derives it), --muon-num-ns-steps iterations once per optimizer
step, in bf16 (--muon-fp32-matmul-prec medium) or fp32.
Who runs it: every rank that updates the matrix. A TP-replicated matrix (MLA's down projections, the shared
expert's gate) is whole on each rank already; a TP-sharded one (an expert weight: split over ETP) by mode:
- duplicated: each TP rank all-gathers the fp32 update input and runs Newton-Schulz on the whole matrix
  (the work is not divided by TP);
- distributed (optim/rules/muon.distributed_newton_schulz): a rank holding m_r of the split dimension, n
  the unsplit one, costs per iteration 2 n^2 m_r (its Gram), 2 n^3 (B, on every rank alike) and 2 n^2 m_r
  (its X), and all-reduces the fp32 n x n Gram once per iteration and the sum of squares once;
- blockwise: each rank runs Newton-Schulz on its own parts, no communication.
Under ZeRO (the whole-parameter layout Muon runs on) each data-parallel rank updates only the parameters it
owns, balanced by Newton-Schulz FLOPs (each rank within the largest matrix's cost of the mean): the planner
counts the mean share, 1/d.
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
    split: int = 0                          # the dimension TP splits: 0 rows (column-parallel), 1 columns
    parts: tuple[tuple[int, int], ...] = ()  # a sharded weight's logical matrices as one rank holds them

    @property
    def full(self) -> int:
        """Elements of the full weight."""
        return sum(rows * cols for rows, cols in self.blocks)


def sharded(local: int, blocks: tuple, tp: int, split: int = 0, expert: bool = False, parts: tuple = ()) -> MatrixParam:
    """A parameter whose logical matrices ``blocks`` TP (or ETP) of ``tp`` ranks splits along ``split``;
    ``parts``: a rank's parts of them, when not ``blocks`` cut evenly (replicated KV heads)."""
    if tp == 1:
        return MatrixParam(local, blocks, expert=expert)
    even = tuple((r // tp, c) if split == 0 else (r, c // tp) for r, c in blocks)
    return MatrixParam(local, blocks, True, expert, split, parts or even)


def distributed_newton_schulz_flops(block: tuple[int, int], part: tuple[int, int], split: int, steps: int) -> int:
    """FLOPs on one rank of ``steps`` distributed Newton-Schulz iterations on its ``part`` of a logical
    matrix ``block`` split along ``split`` (module docstring): the Gram is n x n, n the unsplit dimension."""
    n, m = (block[1], part[0]) if split == 0 else (block[0], part[1])
    return steps * (4 * n * n * m + 2 * n ** 3)


def matrix_work(m: MatrixParam, muon: MuonFields) -> tuple[int, int, int]:
    """(Newton-Schulz FLOPs, fp32 bytes all-gathered, fp32 bytes all-reduced) of one step of ``m`` on one
    rank under --muon-tp-mode (module docstring)."""
    steps, mode = muon.muon_num_ns_steps, muon.muon_tp_mode
    if not m.sharded or mode == "duplicated":
        return sum(newton_schulz_flops(r, c, steps) for r, c in m.blocks), 4 * m.full if m.sharded else 0, 0
    if mode == "blockwise":
        return sum(newton_schulz_flops(r, c, steps) for r, c in m.parts), 0, 0
    flops = sum(distributed_newton_schulz_flops(b, p, m.split, steps) for b, p in zip(m.blocks, m.parts))
    grams = sum((b[1] if m.split == 0 else b[0]) ** 2 for b in m.blocks)
    return flops, 0, 4 * (steps * grams + len(m.blocks))


def _gated(rows: int, cols: int, model: ModelConfig, muon: MuonFields) -> tuple[tuple[int, int], ...]:
    """The logical matrices of an fc1 of ``rows`` = f (2f gated) full rows: gate and up, or one."""
    if model.gated_linear_unit and not muon.muon_fused_gate_up:
        return ((rows // 2, cols),) * 2
    return ((rows, cols),)


def attention_matrices(model: ModelConfig, muon: MuonFields, tp: int) -> list[MatrixParam]:
    """The attention's matrices on one TP rank (SelfAttention, or MLA's projections)."""
    h, heads = model.hidden_size, model.num_attention_heads
    if model.multi_latent_attention:
        qk, n = model.qk_head_dim + model.qk_pos_emb_head_dim, heads // tp
        r_kv = model.kv_lora_rank
        if model.q_lora_rank:
            query = [MatrixParam(model.q_lora_rank * h, ((model.q_lora_rank, h),)),      # replicated
                     sharded(n * qk * model.q_lora_rank, ((heads * qk, model.q_lora_rank),), tp)]
        else:
            query = [sharded(n * qk * h, ((heads * qk, h),), tp)]
        up = heads * (model.qk_head_dim + model.v_head_dim)
        return query + [MatrixParam((r_kv + model.qk_pos_emb_head_dim) * h, ((r_kv + model.qk_pos_emb_head_dim, h),)),
                        sharded(up // tp * r_kv, ((up, r_kv),), tp),
                        sharded(h * n * model.v_head_dim, ((h, heads * model.v_head_dim),), tp, split=1)]
    d, groups = model.kv_channels, model.num_query_groups
    local_heads, local_groups = local_attention_heads(model, tp)
    if muon.muon_split_qkv:
        qkv = ((heads * d, h), (groups * d, h), (groups * d, h))
        parts = ((local_heads * d, h), (local_groups * d, h), (local_groups * d, h))
    else:
        qkv, parts = (((heads + 2 * groups) * d, h),), (((local_heads + 2 * local_groups) * d, h),)
    return [sharded((local_heads + 2 * local_groups) * d * h, qkv, tp, parts=parts),
            sharded(local_heads * d * h, ((h, heads * d),), tp, split=1)]


def mlp_matrices(model: ModelConfig, muon: MuonFields, tp: int, ffn: int) -> list[MatrixParam]:
    """fc1 and fc2 of a tensor-parallel MLP of hidden size ``ffn``."""
    h, rows = model.hidden_size, (2 if model.gated_linear_unit else 1) * ffn
    return [sharded(rows // tp * h, _gated(rows, h, model, muon), tp),
            sharded(h * (ffn // tp), ((h, ffn),), tp, split=1)]


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
    matrices += [sharded(local * rows // etp * h, _gated(rows, h, model, muon) * local, etp, expert=True),
                 sharded(local * h * (f // etp), ((h, f),) * local, etp, split=1, expert=True)]
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
        matrices += [sharded(h // layout.tp * 2 * h, ((h, 2 * h),), layout.tp)] * mtp_depths(model)
    return matrices


def matrix_elements(workload: Workload, layout: Layout, pp_rank: int) -> tuple[int, int]:
    """(dense, expert) elements of pipeline rank ``pp_rank`` that Muon steps (one TP rank)."""
    matrices = rank_matrices(workload, layout, pp_rank)
    return (sum(m.local for m in matrices if not m.expert), sum(m.local for m in matrices if m.expert))


def optimizer_step_work(workload: Workload, layout: Layout, pp_rank: int) -> tuple[float, float, float]:
    """(Newton-Schulz FLOPs, bytes of fp32 matrices gathered whole over TP, bytes of fp32 Gram matrices
    all-reduced over TP) of one optimizer step on one rank of pipeline rank ``pp_rank`` (matrix_work), the
    share of one data-parallel rank under ZeRO (1/d dense, 1/EDP experts)."""
    total = (0.0, 0.0, 0.0)
    for m in rank_matrices(workload, layout, pp_rank):
        owners = 1 if layout.sharding == "no_shard" else (layout.expert_zero_shards if m.expert else layout.zero_shards)
        total = tuple(t + w / owners for t, w in zip(total, matrix_work(m, workload.muon)))
    return total
