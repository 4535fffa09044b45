"""What one Newton-Schulz orthogonalisation costs, the one count that the whole-parameter ZeRO layout
balances its owners by and that the planner adds up.

Newton-Schulz (optim/rules/muon.newton_schulz) of a logical matrix of shape (m, n) with m <= n (a tall one
is transposed first) runs per iteration, with X of shape (m, n):
- A = X X^T: an (m, n) x (n, m) product, 2 m^2 n FLOPs;
- B = bA + c A A (one addmm): an (m, m) x (m, m) product, 2 m^3 (the scaled addition is O(m^2));
- X <- aX + B X (one addmm): an (m, m) x (m, n) product, 2 m^2 n.
So 4 m^2 n + 2 m^3 per iteration, --muon-num-ns-steps iterations per optimizer step; the normalisation and
the scalings are O(mn) and not counted.

Ownership (``owner_cost``): with ZeRO each data-parallel rank updates the whole parameters it owns
(parallel/data/grad_buffer.py), so under Muon the owners are balanced by these FLOPs, as Megatron's
LayerWiseDistributedOptimizer balances by Newton-Schulz cost: a parameter's cost is the sum over the logical
matrices that its owner orthogonalises for it, whole (a TP-sharded matrix is gathered whole under
--muon-tp-mode duplicated; a stacked expert weight counts only the experts this rank holds). The other TP
modes divide part of a TP-sharded matrix's work over TP (planning/muon.py counts them); the owners are
balanced by the whole-matrix count whatever the mode. The cost depends on the parameter's name, shape and
sharding only, so every rank of a data-parallel group computes the same costs and picks the same owners.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from megalite.config.schema import ModelConfig, OptimizerConfig
from megalite.optim.muon_matrices import is_muon_matrix, logical_blocks
from megalite.parallel.param_meta import full_shape
from megalite.parallel.tensor.layers import shard_positions


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs of ``steps`` Newton-Schulz iterations on one (rows, cols) matrix (module docstring)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def parameter_flops(name: str, param: nn.Parameter, model: ModelConfig, config: OptimizerConfig) -> int:
    """Newton-Schulz FLOPs of one step of Muon parameter ``name`` on the rank that updates it: every logical
    matrix of its full weight that holds any of this rank's rows, run whole."""
    rows, _, full_cols = shard_positions(param)
    held = torch.zeros(full_shape(param)[0], dtype=torch.bool)
    held[rows] = True
    flops = 0
    for runs in logical_blocks(name, len(held), model, config):
        index = torch.cat([torch.arange(a, b) for a, b in runs])
        if bool(held[index].any()):
            flops += newton_schulz_flops(len(index), full_cols, config.muon_num_ns_steps)
    return flops


def owner_cost(model: ModelConfig, config: OptimizerConfig) -> Callable[[str, nn.Parameter], int | None] | None:
    """What the whole-parameter layout balances owners by: under --optimizer muon, per parameter its
    Newton-Schulz FLOPs (None for the scalar optimizer's parameters, which are balanced by size); None
    (every parameter by size) for the other optimizers."""
    if config.optimizer != "muon":
        return None
    return lambda name, param: parameter_flops(name, param, model, config) if is_muon_matrix(name, param) else None
