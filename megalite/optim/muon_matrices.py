"""Which parameters Muon orthogonalises, and the logical matrices inside each.

Muon takes the weight matrices of the transformer layers (2-D parameters, and the stacked [E, ...]
expert weights); the word embedding, the output layer, the MoE routers and every 1-D parameter (norms,
biases) go to the scalar optimizer. It orthogonalises each LOGICAL matrix separately, as the models
megalite imports hold them, on the full (unsharded) weight viewed 2-D [rows, cols]:
- ``linear_qkv``: rows grouped per KV group g as [q heads of g; k_g; v_g]; Q is every group's q rows
  in order (the Hugging Face q_proj), K and V likewise (--muon-no-split-qkv: one matrix);
- a gated MLP's ``linear_fc1``: rows [gate; up], two matrices (--muon-fused-gate-up: one, as Megatron);
- stacked expert weights: each expert's rows on their own (split into gate and up for a gated fc1);
- everything else, MLA's projections included, is one matrix: MLA's ``linear_kv_up_proj`` (per head
  [k without RoPE; v]) is one matrix, as Hugging Face's kv_b_proj and Megatron hold it.

A ``Matrix`` records where this rank's local parameter (viewed 2-D) sits in the full weight, so a
tensor-parallel shard can be gathered whole (--muon-tp-mode duplicated) and the update cut back out; under
--muon-tp-mode distributed also which dimension TP splits and each logical matrix's local rows (a row or
column several ranks hold, KV heads replicated over TP, enters the Gram sums on the lowest rank only);
under blockwise the rank's part of each logical matrix is a matrix of its own, scaled by the part's shape
(Megatron scales a blockwise shard by its local shape). Under expert parallelism a rank holds whole experts
of a stacked weight and orthogonalises its own (with expert tensor parallelism, split over the ETP group as
a TP-sharded matrix over TP, in the same mode).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite.config.schema import ModelConfig, OptimizerConfig
from megalite.optim.master_weights import is_embedding_or_output
from megalite.parallel.param_meta import full_shape, param_meta
from megalite.parallel.tensor.layers import shard_positions


def is_muon_matrix(name: str, param: nn.Parameter) -> bool:
    """Muon's parameters: weight matrices other than the embedding, output layer and routers."""
    return param.dim() >= 2 and not is_embedding_or_output(name) and ".router." not in name


def logical_blocks(name: str, full_rows: int, model: ModelConfig, config: OptimizerConfig) -> list[list[tuple]]:
    """The logical matrices of a parameter's full 2-D weight, each as its runs [start, end) of full rows."""
    if name.endswith("linear_qkv.weight") and config.muon_split_qkv:
        groups, d = model.num_query_groups, model.kv_channels
        q = model.num_attention_heads // groups * d
        stride = q + 2 * d
        return [[(g * stride + a, g * stride + b) for g in range(groups)] for a, b in ((0, q), (q, q + d), (q + d, stride))]
    experts = model.num_experts if ".experts." in name else 1
    per = full_rows // experts
    halves = 2 if name.endswith("linear_fc1.weight") and model.gated_linear_unit and not config.muon_fused_gate_up else 1
    part = per // halves
    return [[(e * per + h * part, e * per + (h + 1) * part)] for e in range(experts) for h in range(halves)]


def scale_ratio(rows: int, cols: int, config: OptimizerConfig) -> float:
    """The update's scale for a logical matrix of this shape (--muon-scale-mode x --muon-extra-scale-factor)."""
    mode = config.muon_scale_mode
    if mode == "spectral":
        shape = math.sqrt(max(rows, cols))
    elif mode == "unit_rms_norm":
        shape = math.sqrt(rows / cols)
    else:
        shape = math.sqrt(max(1, rows / cols))
    return config.muon_extra_scale_factor * shape


@dataclass
class Matrix:
    """One Muon parameter on this rank: its local part viewed 2-D, the weight it orthogonalises (the full
    one gathered over TP; else its local part, a subset of a stacked expert weight's experts under expert
    parallelism), the logical matrices in it (as row indices of that weight) with their update scales, and
    how to gather it."""
    name: str
    local_shape: tuple[int, int]
    full_shape: tuple[int, int]
    blocks: list[tuple[torch.Tensor, float]]    # (rows of one logical matrix, its scale ratio)
    row_runs: list[tuple[int, int, float]]      # runs of local rows [a, b) in one logical matrix, its ratio
    group: object = None                        # the TP / ETP group to gather over (None: the rank holds it whole)
    rows: list = None                           # per rank of the group: its rows (per local row) and columns
    cols: list = None
    split: int = 0                              # --muon-tp-mode distributed: the dimension the group splits,
    parts: list = None                          # and per logical matrix its local rows and counted indices


def build_matrix(name: str, param: nn.Parameter, model: ModelConfig, config: OptimizerConfig, tp_group,
                 etp_group=None) -> Matrix:
    """The ``Matrix`` of one Muon parameter (collective over ``tp_group`` when the parameter is TP-sharded,
    over ``etp_group`` when it is an expert weight split over expert tensor parallelism: the ranks' row and
    column positions are gathered once)."""
    rows, cols, full_cols = shard_positions(param)
    full_rows, device = full_shape(param)[0], param.device
    blocks, block_of = [], torch.empty(full_rows, dtype=torch.long)
    for i, runs in enumerate(logical_blocks(name, full_rows, model, config)):
        index = torch.cat([torch.arange(a, b) for a, b in runs])
        blocks.append((index, scale_ratio(len(index), full_cols, config)))
        block_of[index] = i
    local_blocks = block_of[rows]
    meta = param_meta(param)
    group = etp_group if meta.expert else tp_group if meta.tensor_model_parallel else None
    local = (len(rows), len(cols))
    if group is None or dist.get_world_size(group) == 1:
        return Matrix(name, local, local, _held_blocks(blocks, _positions(rows, full_rows), device),
                      _row_runs(local_blocks, [ratio for _, ratio in blocks]))
    if config.muon_tp_mode == "blockwise":
        return _blockwise(name, local_blocks, len(blocks), len(cols), config, device)
    ranks_rows, ranks_cols = _gathered(rows.to(device), group), _gathered(cols.to(device), group)
    held = torch.cat(ranks_rows).unique().cpu()       # the rows the group holds (an expert weight: its experts)
    position = _positions(held, full_rows)
    matrix = Matrix(name, local, (len(held), full_cols), _held_blocks(blocks, position, device),
                    _row_runs(local_blocks, [ratio for _, ratio in blocks]), group,
                    [position.to(device)[r] for r in ranks_rows], ranks_cols)
    if config.muon_tp_mode == "distributed":
        matrix.split, matrix.parts = _distributed_parts(matrix)
    return matrix


def _row_runs(local_blocks: torch.Tensor, ratios: list[float]) -> list[tuple[int, int, float]]:
    """The runs [a, b) of local rows in one logical matrix (``local_blocks``: each local row's), with its ratio."""
    local_blocks = local_blocks.tolist()
    row_runs, start = [], 0
    for i in range(1, len(local_blocks) + 1):
        if i == len(local_blocks) or local_blocks[i] != local_blocks[start]:
            row_runs.append((start, i, ratios[local_blocks[start]]))
            start = i
    return row_runs


def _blockwise(name: str, local_blocks: torch.Tensor, count: int, cols: int, config: OptimizerConfig,
               device) -> Matrix:
    """--muon-tp-mode blockwise: the rank's own part of each logical matrix (of ``count``) as a matrix of its
    own, scaled by that part's shape (as Megatron, whose blockwise mode scales by the local shard's)."""
    blocks, ratios = [], []
    for i in range(count):
        index = torch.nonzero(local_blocks == i).flatten()
        ratios.append(scale_ratio(len(index), cols, config))
        if len(index):
            blocks.append((index.to(device), ratios[-1]))
    local = (len(local_blocks), cols)
    return Matrix(name, local, local, blocks, _row_runs(local_blocks, ratios))


def _distributed_parts(matrix: Matrix) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """(the dimension the group splits: 0 rows, column-parallel weights; 1 columns, row-parallel ones; per
    logical matrix of ``matrix.blocks``, the local rows in it and the indices along that dimension of those
    rows that enter the Gram sums, None for all): a row or column several ranks hold (KV heads replicated
    over TP) counts on the lowest of them only."""
    rank = dist.get_rank(matrix.group)
    split = 0 if len(matrix.cols[rank]) == matrix.full_shape[1] else 1
    along = matrix.rows if split == 0 else matrix.cols
    first = ~torch.isin(along[rank], torch.cat(along[:rank] or [along[rank][:0]]))     # held by no lower rank
    block_of = torch.full((matrix.full_shape[0],), -1, dtype=torch.long, device=first.device)
    for i, (index, _) in enumerate(matrix.blocks):
        block_of[index] = i
    local_blocks, parts = block_of[matrix.rows[rank]], []
    for i in range(len(matrix.blocks)):
        rows = torch.nonzero(local_blocks == i).flatten()
        counted = first[rows] if split == 0 else first
        parts.append((rows, None if bool(counted.all()) else torch.nonzero(counted).flatten()))
    return split, parts


def _positions(rows: torch.Tensor, full_rows: int) -> torch.Tensor:
    """Per full row, its index among ``rows`` (-1: not among them)."""
    position = torch.full((full_rows,), -1, dtype=torch.long)
    position[rows] = torch.arange(len(rows))
    return position


def _held_blocks(blocks: list[tuple[torch.Tensor, float]], position: torch.Tensor, device) -> list:
    """The logical matrices among the rows held (a rank's own, or those its TP / ETP group gathers), as
    indices into them (``position``): every block of a dense weight; of a stacked expert weight under expert
    parallelism, the blocks of the experts held (each expert lies wholly in one expert-parallel rank's part)."""
    held = [(position[index], ratio) for index, ratio in blocks]
    return [(index.to(device), ratio) for index, ratio in held if bool((index >= 0).all())]


def _gathered(index: torch.Tensor, group) -> list[torch.Tensor]:
    """Every TP rank's index vector (the same length on each). Zero-filled first, so a dry run's process
    group, which moves nothing, leaves valid indices."""
    out = [torch.zeros_like(index) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, index, group=group)
    return out
