"""Muon on row-sharded parameters (--use-torch-fsdp2): each matrix is gathered whole on one owner rank for
Newton-Schulz and the result sent back, as torchtitan's DistMuon redistributes FSDP shards.

FSDP2 shards every parameter by rows (Shard(0) of its TP-local tensor), so no rank holds a whole matrix.
Per step, with d data-parallel ranks:
- the momentum stays sharded like the parameter: its update, and the Nesterov input, are elementwise on
  the rank's rows (rules/muon.py, ``_update_input``);
- each Muon parameter has an owner among the d ranks, balanced by its Newton-Schulz FLOPs
  (parallel/data/owners.py, optim/muon_cost.py), the same on every rank;
- one all-to-all sends every rank's rows of each matrix to its owner (a rank's send to an owner: its rows of
  the owner's matrices, in parameter order; a rank holding no rows of one sends none);
- each owner puts its matrices together (rows in rank order, FSDP2's order) and orthogonalises them whole
  (rules/muon.py's ``_orthogonalise``, which first gathers a TP-sharded matrix over TP: the TP peers of an
  owner own the same matrices, so they gather together, in parameter order);
- a second all-to-all, the first one's reverse, sends each rank its rows of the results, which it applies.
Every rank issues the same two collectives each step, so they pair up under NCCL's ordering rules too.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from megalite.config.schema import ModelConfig, OptimizerConfig
from megalite.optim.master_weights import MasterWeights
from megalite.optim.muon_cost import parameter_flops
from megalite.optim.muon_matrices import Matrix, build_matrix, is_muon_matrix
from megalite.optim.rules.muon import Muon
from megalite.parallel.data.owners import whole_param_owners
from megalite.parallel.data.protocol import FlatLayout


@dataclasses.dataclass
class Redistribution:
    """Every Muon parameter of the model in parameter order: its whole (TP-local) ``Matrix``, its owner and
    each rank's element count of it (its rows x columns); this rank's place in the data-parallel ``group``
    of ``ranks``."""
    matrices: list[Matrix]
    owners: list[int]
    counts: list[list[int]]         # counts[k][r]: elements of matrix k on rank r
    group: object
    rank: int
    ranks: int
    device: torch.device

    def __post_init__(self):
        peers, me = range(self.ranks), self.rank
        # elements this rank sends to each owner, and receives from each peer for the matrices it owns
        self.sends = [sum(c[me] for o, c in zip(self.owners, self.counts) if o == p) for p in peers]
        self.receives = [sum(c[p] for o, c in zip(self.owners, self.counts) if o == me) for p in peers]
        self.order = sorted(range(len(self.matrices)), key=lambda k: self.owners[k])    # by owner, then k
        self.owned = [k for k in range(len(self.matrices)) if self.owners[k] == me]

    def orthogonalise(self, rows: dict[str, torch.Tensor], orthogonalise) -> dict[str, torch.Tensor]:
        """This rank's rows of every orthogonalised matrix (1-D, by name), from its rows of the update
        inputs (``rows``, by name; absent: none); ``orthogonalise(whole, matrix)`` runs on the owner."""
        empty = torch.empty(0, dtype=torch.float32, device=self.device)
        send = torch.cat([empty] + [rows.get(self.matrices[k].name, empty).reshape(-1) for k in self.order])
        received = send.new_empty(sum(self.receives))
        dist.all_to_all_single(received, send, self.receives, self.sends, group=self.group)
        # per peer, its rows of each matrix this rank owns
        parts = [segment.split([self.counts[k][p] for k in self.owned])
                 for p, segment in enumerate(received.split(self.receives))]
        results = []
        for i, k in enumerate(self.owned):
            whole = torch.cat([peer[i] for peer in parts]).view(self.matrices[k].local_shape)
            results.append(orthogonalise(whole, self.matrices[k]).reshape(-1).split(self.counts[k]))
        back = torch.cat([empty] + [result[p] for p in range(self.ranks) for result in results])
        out = send.new_empty(sum(self.sends))
        dist.all_to_all_single(out, back, self.sends, self.receives, group=self.group)
        return dict(zip((self.matrices[k].name for k in self.order),
                        out.split([self.counts[k][self.rank] for k in self.order])))


class RedistributedMuon(Muon):
    """Muon whose matrices are row shards: each step's Newton-Schulz runs on the owners (module docstring)."""

    def __init__(self, masters: list[torch.Tensor], decoupled: list[bool], config: OptimizerConfig,
                 matrices: list[Matrix | None], redistribution: Redistribution):
        super().__init__(masters, decoupled, config, matrices)
        self.redistribution = redistribution

    def _step_matrices(self, items: list[tuple[torch.Tensor, torch.Tensor, Matrix]], lr: float) -> None:
        inputs = {matrix.name: self._update_input(master, grad) for master, grad, matrix in items}
        orthogonal = self.redistribution.orthogonalise(inputs, self._orthogonalise)
        for master, _, matrix in items:
            self._apply(master, orthogonal[matrix.name].view(matrix.local_shape), matrix, lr)


def row_shard(matrix: Matrix, r0: int, r1: int) -> Matrix:
    """``matrix`` (a whole TP-local weight) as its rows [r0, r1): their shape and their runs of rows."""
    runs = [(max(a, r0) - r0, min(b, r1) - r0, ratio) for a, b, ratio in matrix.row_runs if max(a, r0) < min(b, r1)]
    return dataclasses.replace(matrix, local_shape=(r1 - r0, matrix.local_shape[1]), row_runs=runs)


def row_sharded_muon(weights: MasterWeights, named_params: list[tuple[str, nn.Parameter]], buffer: FlatLayout,
                     model: ModelConfig, config: OptimizerConfig, groups: tuple, dp_group) -> RedistributedMuon:
    """The Muon rule over ``weights``' pieces, rows of FSDP2's shards (``buffer.row_shards``): every Muon
    parameter's whole Matrix (collective over TP / ETP, ``groups``), its owner and rows per rank."""
    from megalite.parallel.data.fsdp2 import dim0_shard     # FSDP2's row split: imported only under FSDP2
    size, rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    named = [(n, p) for n, p in named_params if is_muon_matrix(n, p)]
    whole = [build_matrix(n, p, model, config, *groups) for n, p in named]
    counts = [[(b - a) * m.local_shape[1] for a, b in (dim0_shard(m.local_shape[0], r, size) for r in range(size))]
              for m in whole]
    owners = whole_param_owners([p.numel() for _, p in named], size,
                                [parameter_flops(n, p, model, config) for n, p in named])
    by_name, specs = {m.name: m for m in whole}, []
    for piece, name in zip(weights.pieces, weights.whole_names):
        if name is None:
            specs.append(None)
            continue
        cols = by_name[name].local_shape[1]
        r0 = (piece.start - buffer.slots[name].start) // cols
        specs.append(row_shard(by_name[name], r0, r0 + (piece.end - piece.start) // cols))
    device = named_params[0][1].device
    return RedistributedMuon(weights.masters, weights.decoupled, config, specs,
                             Redistribution(whole, owners, counts, dp_group, rank, size, device))
