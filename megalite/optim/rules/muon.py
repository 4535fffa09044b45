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
and low stay fp32), transpose a tall matrix, divide by its Frobenius norm (at least 1e-7), then per
iteration with coefficients (a, b, c): A = X X^T, X <- a X + (b A + c A A) X.

A matrix sharded over a TP group (an expert weight: over its ETP group), by --muon-tp-mode:
- duplicated: gathered over the group; every rank orthogonalises the whole matrix and keeps its part;
- distributed (``distributed_newton_schulz``): each rank iterates on its own part X_r. Rows split: with
  G = X^T X = sum_r X_r^T X_r (n x n, n the columns), all-reduced, X_r <- X_r (a I + b G + c G G); columns
  split: G = X X^T = sum_r X_r X_r^T, X_r <- (a I + b G + c G G) X_r. Since A^k X = X (X^T X)^k both equal
  torch's iteration on the whole matrix in exact arithmetic, tall or wide; the norm is the square root of
  the all-reduced sum of squares. In bf16 each rank's Gram is a bf16 GEMM (fp32 accumulation, one rounding,
  as the whole matrix's) and the sums are fp32;
- blockwise: each rank's part of each logical matrix is orthogonalised alone (muon_matrices.py), no
  communication.
The rule's named state is ``momentum`` for a matrix, AdamW's moments for the rest.
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
    x, = _iterate([x], coefficients, steps, lambda ys: [y @ y.T for y in ys])
    return (x.T if tall else x).float()


def distributed_newton_schulz(parts: list[torch.Tensor], split: int, counted: list[torch.Tensor | None], group,
                              coefficients: tuple, steps: int, bf16: bool) -> list[torch.Tensor]:
    """This rank's parts of the orthogonalised logical matrices whose ``parts`` (2-D, fp32, one unsplit
    dimension n for all) the ranks of ``group`` hold, split along dimension ``split`` (module docstring);
    ``counted``: per part, the indices along ``split`` that enter the sums (None: all; a row several ranks
    hold counts once). One all-reduce carries every part's sum of squares, one per iteration every part's
    n x n Gram matrix. A collective: every rank of the group calls it with the same logical matrices."""
    xs = [p.to(torch.bfloat16 if bf16 else torch.float32, copy=True) for p in parts]
    if split == 0:
        xs = [x.T for x in xs]      # the split dimension is now x's columns, over which x x^T sums

    def own(ys: list[torch.Tensor]) -> list[torch.Tensor]:
        return [y if index is None else y.index_select(1, index) for y, index in zip(ys, counted)]

    squares = torch.stack([y.float().square().sum() for y in own(xs)])
    dist.all_reduce(squares, group=group)
    for x, square in zip(xs, squares):
        x.div_(square.sqrt().to(x.dtype).clamp(min=NS_EPS))
    xs = _iterate(xs, coefficients, steps, lambda ys: _summed_grams(own(ys), group))
    return [(x.T if split == 0 else x).float() for x in xs]


def _summed_grams(ys: list[torch.Tensor], group) -> torch.Tensor:
    """Per y, the sum over the group's ranks of y_r y_r^T: each rank's product in y's dtype (a bf16 GEMM
    accumulates in fp32 and rounds once, as the whole matrix's), summed in fp32."""
    grams = torch.stack([y @ y.T for y in ys]).float()
    dist.all_reduce(grams, group=group)
    return grams.to(ys[0].dtype)


def _iterate(xs: list[torch.Tensor], coefficients: tuple, steps: int, grams) -> list[torch.Tensor]:
    """``steps`` Newton-Schulz iterations of each normalised x of ``xs``, with coefficients (a, b, c) in
    turn: A = x x^T (``grams``: all of them), x <- a x + (b A + c A A) x."""
    for a, b, c in itertools.islice(itertools.cycle(coefficients), steps):
        xs = [torch.addmm(x, torch.addmm(g, g, g, beta=b, alpha=c), x, beta=a) for x, g in zip(xs, grams(xs))]
    return xs


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
        bf16 = self.config.muon_fp32_matmul_prec == "medium"
        if matrix.parts is not None:
            return self._orthogonalise_distributed(local, matrix, bf16)
        full = local if matrix.group is None else _gather(local, matrix)
        out = torch.empty_like(full)
        for index, _ in matrix.blocks:
            out.index_copy_(0, index, newton_schulz(full.index_select(0, index), self.coefficients,
                                                    self.config.muon_num_ns_steps, bf16))
        if matrix.group is None:
            return out
        rank = dist.get_rank(matrix.group)
        return out.index_select(0, matrix.rows[rank]).index_select(1, matrix.cols[rank])

    def _orthogonalise_distributed(self, local: torch.Tensor, matrix: Matrix, bf16: bool) -> torch.Tensor:
        """--muon-tp-mode distributed: each logical matrix through Gram all-reduces over the TP group."""
        out = torch.empty_like(local)
        parts = distributed_newton_schulz([local.index_select(0, rows) for rows, _ in matrix.parts], matrix.split,
                                          [counted for _, counted in matrix.parts], matrix.group, self.coefficients,
                                          self.config.muon_num_ns_steps, bf16)
        for (rows, _), part in zip(matrix.parts, parts):
            out.index_copy_(0, rows, part)
        return out

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
