"""Muon as an update rule: momentum orthogonalised by Newton-Schulz for the transformer layers' weight
matrices, AdamW (rules/adamw.py) for every other piece.

The optimizer cuts its master pieces so that each Muon parameter is a piece of its own (``matrices``:
its optim/muon_matrices.Matrix, None for the scalar optimizer's pieces). One step of a matrix, as
torch.optim.Muon (weight decay, decoupled with the unscaled learning rate, is applied before the rule
like AdamW's, mixed_precision.py):

    buffer <- momentum x buffer + (1 - momentum) x gradient        (buffer.lerp_(gradient, 1 - momentum))
    input  <- nesterov ? (1 - momentum) x gradient + momentum x buffer : buffer
    per logical matrix M of input:  W_M <- W_M - lr x ratio(M) x NewtonSchulz(M)

Newton-Schulz (``newton_schulz``) as torch.optim.Muon: cast to bf16 (--muon-fp32-matmul-prec medium; high
stays fp32), transpose a tall matrix, divide by its Frobenius norm (at least 1e-7), then per iteration
with coefficients (a, b, c): A = X X^T, X <- a X + (b A + c A A) X. A TP-sharded matrix is gathered over
its TP group first (--muon-tp-mode duplicated): every TP rank orthogonalises the whole matrix and keeps
its own part. The rule's named state is ``momentum`` for a matrix, AdamW's moments for the rest.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from megalite.config.muon_fields import NS_COEFFICIENTS
from megalite.config.schema import OptimizerConfig
from megalite.optim.muon_matrices import Matrix
from megalite.optim.rules.adamw import AdamW

NS_EPS = 1e-7           # torch.optim.Muon's floor on the norm Newton-Schulz divides by


def newton_schulz(m: torch.Tensor, coefficients: tuple, steps: int, bf16: bool) -> torch.Tensor:
    """The orthogonalised ``m`` (2-D, fp32), in fp32 (module docstring)."""
    x = m.to(torch.bfloat16 if bf16 else torch.float32, copy=True)
    tall = m.size(0) > m.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=NS_EPS))
    for a, b, c in itertools.islice(itertools.cycle(coefficients), steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).float()


class Muon:
    matrix_state_names = ("momentum",)
    state_names = AdamW.state_names          # the scalar optimizer's pieces

    def __init__(self, masters: list[torch.Tensor], decoupled: list[bool], config: OptimizerConfig,
                 matrices: list[Matrix | None]):
        self.config, self.steps = config, 0.0
        self.matrices = {id(m): spec for m, spec in zip(masters, matrices) if spec is not None}
        self.momentum = {id(m): torch.zeros_like(m) for m, spec in zip(masters, matrices) if spec is not None}
        scalars = [(m, d) for m, d, spec in zip(masters, decoupled, matrices) if spec is None]
        self.scalar = AdamW([m for m, _ in scalars], [d for _, d in scalars], config) if scalars else None
        self.coefficients = NS_COEFFICIENTS[config.muon_coefficient_type]

    def step(self, masters: list[torch.Tensor], grads: list[torch.Tensor], group_lr: dict[bool, float]) -> None:
        """One update: Muon for the matrices (at the --lr group's rate), AdamW for the rest."""
        scalar = [(m, g) for m, g in zip(masters, grads) if id(m) not in self.matrices]
        if self.scalar is not None:
            self.scalar.step([m for m, _ in scalar], [g for _, g in scalar], group_lr)
        self._step_matrices([(m, g, self.matrices[id(m)]) for m, g in zip(masters, grads) if id(m) in self.matrices],
                            group_lr[False])
        self.steps += 1

    def _step_matrices(self, items: list[tuple[torch.Tensor, torch.Tensor, Matrix]], lr: float) -> None:
        """Step each (master, gradient, matrix) in turn (muon_redistribute.py batches them instead)."""
        for master, grad, matrix in items:
            update = self._update_input(master, grad)
            self._apply(master, self._orthogonalise(update.view(matrix.local_shape), matrix), matrix, lr)

    def _update_input(self, master: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The momentum step (elementwise) and what Newton-Schulz orthogonalises (module docstring)."""
        c = self.config
        buf = self.momentum[id(master)]
        buf.lerp_(grad, 1 - c.muon_momentum)
        return grad.lerp(buf, c.muon_momentum) if c.muon_nesterov else buf

    @staticmethod
    def _apply(master: torch.Tensor, orthogonal: torch.Tensor, matrix: Matrix, lr: float) -> None:
        """W <- W - lr x ratio x orthogonal, per run of local rows in one logical matrix."""
        weights = master.view(matrix.local_shape)
        for a, b, ratio in matrix.row_runs:
            weights[a:b].add_(orthogonal[a:b], alpha=-(lr * ratio))

    def _orthogonalise(self, local: torch.Tensor, matrix: Matrix) -> torch.Tensor:
        """Newton-Schulz of each logical matrix of the full weight; this rank's part of the result."""
        full = local if matrix.group is None else _gather(local, matrix)
        out = torch.empty_like(full)
        bf16 = self.config.muon_fp32_matmul_prec == "medium"
        for index, _ in matrix.blocks:
            out.index_copy_(0, index, newton_schulz(full.index_select(0, index), self.coefficients,
                                                    self.config.muon_num_ns_steps, bf16))
        if matrix.group is None:
            return out
        rank = dist.get_rank(matrix.group)
        return out.index_select(0, matrix.rows[rank]).index_select(1, matrix.cols[rank])

    # ---- named state -----------------------------------------------------------------------------
    def named_state(self, master: torch.Tensor) -> dict[str, torch.Tensor]:
        if id(master) in self.momentum:
            return {"momentum": self.momentum[id(master)]}
        return self.scalar.named_state(master)

    @property
    def step_count(self) -> float:
        return self.steps

    @step_count.setter
    def step_count(self, value: float) -> None:
        self.steps = value
        if self.scalar is not None:
            self.scalar.step_count = value

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the rule's state: the matrices' momenta and the scalar optimizer's."""
        return list(self.momentum.values()) + (self.scalar.state_tensors() if self.scalar is not None else [])


def _gather(local: torch.Tensor, matrix: Matrix) -> torch.Tensor:
    """The full 2-D weight from every TP rank's part (rows and columns at their recorded positions)."""
    parts = [torch.empty_like(local) for _ in matrix.rows]
    dist.all_gather(parts, local.contiguous(), group=matrix.group)
    full = local.new_empty(matrix.full_shape)
    for part, rows, cols in zip(parts, matrix.rows, matrix.cols):
        full[rows[:, None], cols[None, :]] = part
    return full
