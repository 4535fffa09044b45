"""Column-, row- and vocabulary-parallel layers (Megatron's tensor parallelism).

A ColumnParallelLinear keeps a block of output rows of the full weight; a RowParallelLinear a block of
input columns. Pairing them (QKV -> attention -> output projection; fc1 -> activation -> fc2) needs
one all-reduce in forward and one in backward per pair, or with sequence parallelism an all-gather
before the column layer and a reduce-scatter after the row layer. Under sequence parallelism the
column layer keeps only this rank's [s/t, b, h] input for backward and gathers it again there
(``linear_with_sequence_gather``), as Megatron does.

Each linear owns a ``precision`` (megalite/precision/gemm.py, the recipe ``TensorParallel.gemm_recipe``
names) and runs all three of its GEMMs through it: the forward, the input gradient and the weight
gradient, in a plain backward and in the zero-bubble split alike. The precision knows the linear's layout
(``TensorParallel.gemm_layout``: its TP group and the axis it cuts, and the CP group), over which an FP8
recipe reduces its amaxes (precision/fp8_layout.py).

Every parameter's record (``param_meta``) holds ``full_shape``, ``partition_dim`` (the dimension its
shard selects along, as in Megatron) and ``take_shard(full) -> local``; ``shard_positions`` turns those
into the full-tensor rows and columns of the local elements, so initialisation and checkpoints address
the unsharded tensor without ever building it. ``tensor_model_parallel`` marks sharded parameters and
``sequence_parallel`` replicated ones whose gradients differ per rank under sequence parallelism.

Gradient-accumulation fusion (Megatron's, on by default; ``--no-gradient-accumulation-fusion``): a weight
marked ``fuse_wgrad_into_main_grad`` (parallel/data/grad_buffer.py marks those it can) gets its gradient
added straight into its fp32 ``main_grad`` by the weight-gradient GEMM itself, ``main_grad += grad_y^T x``, instead of
a separate [out, in] gradient that autograd then adds (fp32) or a hook adds and frees (bf16). That saves
one weight-sized temporary and one pass over it per linear per micro-batch. The backward returns no
weight gradient; autograd still runs the parameter's post-accumulate hooks (with ``grad`` None), so the
data-parallel reduction sees the weight as ready exactly as before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megalite.parallel.pipeline.split_backward import input_grads_to_compute
from megalite.parallel.param_meta import full_shape, mark, param_meta
from megalite.parallel.tensor.mappings import (all_gather, all_gather_sequence_async, copy_to_tp_region,
                                               gather_from_tp_region, reduce_from_tp_region,
                                               reduce_scatter_sequence_async, reduce_scatter_to_sp_region)
from megalite.parallel.tensor.random import RNGTracker
from megalite.precision.fp8_layout import IN, OUT, GemmLayout
from megalite.precision.gemm import DEFAULT_RECIPE, GemmPrecision, build_gemm_precision


@dataclass
class TensorParallel:
    """This rank's place in its tensor-parallel group (size 1: plain single-device layers).

    At size 1 ``group`` is None whatever was passed (a distributed run's one-rank TP group): every
    mapping is then the identity, with no collective, no copy and no autograd node, and the loss is the
    plain cross-entropy (vocab_parallel_cross_entropy with no group)."""
    group: Optional[object] = None
    rank: int = 0
    size: int = 1
    sequence_parallel: bool = False
    rng: Optional[RNGTracker] = None
    kv_replica_group: Optional[object] = None   # the ranks sharing this rank's KV head (tensor/setup.py)
    gemm_recipe: object = DEFAULT_RECIPE        # the layers' GEMM recipe: a name, or precision/fp8.py's Fp8Recipe
    cp_group: Optional[object] = None           # the context-parallel ranks (other tokens of the same sequences)
    cp_size: int = 1

    def __post_init__(self):
        if self.size == 1:
            self.group = None
        if self.cp_size == 1:
            self.cp_group = None

    def gemm_layout(self, split: str) -> GemmLayout:
        """Where a linear's operands are cut, its weight along ``split`` (precision/fp8_layout.py): the ranks
        over which an FP8 recipe reduces block amaxes."""
        return GemmLayout(self.group, self.size, split, self._cp_tokens())

    def replicated_gemm_layout(self) -> GemmLayout:
        """The layout of a linear whose weight is whole on every TP rank and which runs on the rank's own
        tokens: its sequence shard under sequence parallelism, and its CP positions."""
        sequence = ((self.group, self.size),) if self.sequence_parallel and self.group is not None else ()
        return GemmLayout(token_groups=sequence + self._cp_tokens())

    def _cp_tokens(self) -> tuple:
        return ((self.cp_group, self.cp_size),) if self.cp_group is not None else ()

    def chunk(self, full: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return full.chunk(self.size, dim=dim)[self.rank]


def _mark(param: nn.Parameter, full_shape, take_shard: Callable, sharded: bool, partition_dim: int = 0) -> nn.Parameter:
    return mark(param, full_shape=tuple(full_shape), take_shard=take_shard, partition_dim=partition_dim,
                tensor_model_parallel=sharded)


def shard_positions(param: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(rows, cols, full_cols): local element (i, j) of ``param`` (viewed as 2-D [rows, cols]) is element
    (rows[i], cols[j]) of the full tensor viewed as 2-D [full_rows, full_cols], i.e. flat index
    ``rows[i] * full_cols + cols[j]``. 1-D parameters are [n, 1].

    Only index vectors as long as one dimension are built (never the full tensor): a shard selects
    whole rows (``partition_dim`` 0: column-parallel weights, fused QKV / SwiGLU, vocabulary) or a block
    of columns (``partition_dim`` 1: row-parallel weights)."""
    meta = param_meta(param)
    full = full_shape(param)
    full_rows, full_cols = full[0], (math.prod(full[1:]) if len(full) > 1 else 1)
    rows, cols = torch.arange(full_rows), torch.arange(full_cols)
    if meta.expert:                  # an expert weight: its experts' rows, its ETP columns (model/moe.py)
        rows = meta.take_shard(rows)
        cols = cols if meta.take_cols is None else meta.take_cols(cols)
    elif meta.take_shard is not None and meta.tensor_model_parallel:
        if meta.partition_dim == 0:
            rows = meta.take_shard(rows).reshape(-1)
        else:
            cols = meta.take_shard(cols.view(1, full_cols)).reshape(-1)
    return rows, cols, full_cols


def _fuses_into_main_grad(weight: torch.Tensor) -> bool:
    """Whether adding into main_grad is exactly what autograd would do with the gradient: always for a
    low-precision weight (its hook adds .grad into main_grad), and for an fp32 weight while its .grad is
    the main_grad view (the buffer's zero_grad sets that; code that resets .grad to None, such as a plain
    torch optimizer's zero_grad, gets autograd's fresh .grad instead)."""
    if torch.compiler.is_compiling() or not param_meta(weight).fuse_wgrad_into_main_grad:
        return False
    if weight.main_grad.dtype != weight.dtype:
        return True
    return weight.grad is not None and weight.grad.data_ptr() == weight.main_grad.data_ptr()


def _main_grad_to_fuse(weight: torch.Tensor) -> torch.Tensor | None:
    """The main_grad the weight-gradient GEMM adds into, for a weight marked for gradient-accumulation
    fusion (None: the GEMM returns the gradient for autograd to accumulate)."""
    return weight.main_grad if _fuses_into_main_grad(weight) else None


class _Linear(torch.autograd.Function):
    """y = x W^T (+ b), its three GEMMs those of the layer's GemmPrecision; the same saved tensors (x, W)
    as F.linear. In the zero-bubble split B runs only the input GEMM and W only the weight GEMM."""

    @staticmethod
    def forward(ctx, x, weight, bias, precision: GemmPrecision):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.precision = bias is not None, precision
        return precision.forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = input_grads_to_compute(ctx)[:3]     # zero-bubble B / W: one side each
        grad_x = ctx.precision.grad_input(grad_y, weight) if need_x else None
        grad_2d = grad_y.reshape(-1, grad_y.shape[-1])
        grad_w = None
        if need_w:
            grad_w = ctx.precision.grad_weight(grad_2d, x.reshape(-1, x.shape[-1]), _main_grad_to_fuse(weight))
        grad_b = grad_2d.sum(dim=0) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class _LinearAccumulatingWeightGrad(_Linear):
    """_Linear for a weight marked for gradient-accumulation fusion, whose backward adds grad_W into
    W.main_grad: its own node type, so a graph shows which linears fuse."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, precision: GemmPrecision) -> torch.Tensor:
    """y = x W^T (+ b) through ``precision``, with gradient-accumulation fusion for a weight marked for it.
    A compiled region calls the recipe's forward and lets autograd differentiate it: torch.compile builds
    its own backward, which cannot write into main_grad."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return precision.forward(x, weight, bias)
    if param_meta(weight).fuse_wgrad_into_main_grad:
        return _LinearAccumulatingWeightGrad.apply(x, weight, bias, precision)
    return _Linear.apply(x, weight, bias, precision)


class _LinearWithSequenceGather(torch.autograd.Function):
    """y = all_gather_seq(x) W^T (+ b), keeping only the local x shard [s/t, b, h] for backward.

    Megatron's LinearWithGradAccumulationAndAsyncCommunication with sequence parallelism: saving the
    gathered [s, b, h] input would cost t times the shard per column-parallel linear (QKV, fc1, the
    output layer). Backward gathers x again while it computes grad_x = grad_y W, then reduce-scatters
    grad_x along the sequence while it computes grad_W = grad_y^T x. The three GEMMs are those of the
    layer's GemmPrecision."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, precision: GemmPrecision):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias, ctx.precision = group, bias is not None, precision
        return precision.forward(all_gather(x, group, dim=0), weight, bias)     # the gathered input is a temporary

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = input_grads_to_compute(ctx)[:3]     # zero-bubble B / W: one side each
        if need_w:
            x_full, gathering = all_gather_sequence_async(x, ctx.group)      # in flight during grad_x
        grad_x = ctx.precision.grad_input(grad_y, weight) if need_x else None
        grad_w = grad_b = scattering = None
        if need_w:
            gathering.wait()
        if need_x:
            grad_x, scattering = reduce_scatter_sequence_async(grad_x, ctx.group)   # in flight during grad_W
        grad_2d = grad_y.reshape(-1, grad_y.shape[-1])
        if need_w:
            grad_w = ctx.precision.grad_weight(grad_2d, x_full.reshape(-1, x_full.shape[-1]),
                                               _main_grad_to_fuse(weight))
        if need_b and ctx.has_bias:
            grad_b = grad_2d.sum(dim=0)
        if scattering is not None:
            scattering.wait()
        return grad_x, grad_w, grad_b, None, None


def linear_with_sequence_gather(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                tp: TensorParallel, precision: GemmPrecision) -> torch.Tensor:
    """Column-parallel linear on a [s(/t), b, h] input: all-gathered along the sequence under sequence
    parallelism (the shard, not the gathered input, is saved for backward), else entered with
    copy_to_tp_region (backward all-reduces the input gradient)."""
    if tp.sequence_parallel and tp.group is not None:
        return _LinearWithSequenceGather.apply(x, weight, bias, tp.group, precision)
    return linear(copy_to_tp_region(x, tp.group), weight, bias, precision)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across TP ranks; output stays split unless gathered.

    ``local_rows(full)`` picks this rank's rows of a full weight or bias (default: a contiguous chunk);
    fused layouts (SwiGLU's [gate; up], grouped QKV) pass their own. ``gemm_recipe``: the GEMM recipe when
    not ``tp``'s (the output head's).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, tp: TensorParallel,
                 gather_output: bool = False, local_rows: Callable | None = None, local_out: int | None = None,
                 gemm_recipe=None):
        super().__init__()
        self.tp, self.gather_output = tp, gather_output
        local_rows = local_rows or tp.chunk
        local_out = local_out or out_features // tp.size
        sharded = tp.size > 1
        self.weight = _mark(nn.Parameter(torch.empty(local_out, in_features, dtype=dtype)),
                            (out_features, in_features), local_rows, sharded)
        self.bias = _mark(nn.Parameter(torch.empty(local_out, dtype=dtype)), (out_features,), local_rows,
                          sharded) if bias else None
        self.precision = build_gemm_precision(tp.gemm_recipe if gemm_recipe is None else gemm_recipe,
                                              tp.gemm_layout(OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear_with_sequence_gather(x, self.weight, self.bias, self.tp, self.precision)
        return gather_from_tp_region(y, self.tp.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across TP ranks; input arrives already split."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = _mark(nn.Parameter(torch.empty(out_features, in_features // tp.size, dtype=dtype)),
                            (out_features, in_features), lambda full: tp.chunk(full, dim=1), tp.size > 1,
                            partition_dim=1)
        self.bias = None
        if bias:   # replicated; added once, after the reduction
            self.bias = _mark(nn.Parameter(torch.empty(out_features, dtype=dtype)), (out_features,),
                              lambda full: full, sharded=False)
            mark(self.bias, sequence_parallel=tp.sequence_parallel)
        self.precision = build_gemm_precision(tp.gemm_recipe, tp.gemm_layout(IN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None, self.precision)
        if self.tp.sequence_parallel:
            y = reduce_scatter_to_sp_region(y, self.tp.group)
        else:
            y = reduce_from_tp_region(y, self.tp.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across TP ranks by vocabulary range; returns per-rank *partial* sums.

    Ids outside this rank's range contribute zeros; the caller sums over TP (all-reduce, or
    reduce-scatter with sequence parallelism) to get the full embedding.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.per_rank = num_embeddings // tp.size
        self.weight = _mark(nn.Parameter(torch.empty(self.per_rank, embedding_dim, dtype=dtype)),
                            (num_embeddings, embedding_dim), tp.chunk, tp.size > 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(ids, self.weight, self.tp, self.per_rank)


def vocab_parallel_lookup(ids: torch.Tensor, weight: torch.Tensor, tp: TensorParallel, per_rank: int) -> torch.Tensor:
    """Rows of ``weight``, this rank's ``per_rank`` rows of the vocabulary (a contiguous range, as
    VocabParallelEmbedding and the output layer split it), for ``ids``; ids of other ranks give zeros (a
    partial sum over TP)."""
    if tp.size == 1:
        return F.embedding(ids, weight)
    vocab_start = tp.rank * per_rank
    outside = (ids < vocab_start) | (ids >= vocab_start + per_rank)
    local_ids = (ids - vocab_start).masked_fill(outside, 0)
    return F.embedding(local_ids, weight).masked_fill(outside.unsqueeze(-1), 0.0)


def parallel_logits(x: torch.Tensor, weight: torch.Tensor, tp: TensorParallel,
                    precision: GemmPrecision) -> torch.Tensor:
    """[s(/tp), b, h] hidden states -> [s, b, V/tp] logits for this rank's vocabulary range."""
    return linear_with_sequence_gather(x, weight, None, tp, precision)

