"""The dense MLP: fc1 -> GELU, SwiGLU or quick GEGLU -> fc2, tensor-parallel (column then row), with a SwiGLU
that keeps only fc1's output for backward."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config.schema import ModelConfig
from megalite.model.kernels import records_autograd
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, TensorParallel


class MLP(nn.Module):
    """fc1 -> activation -> fc2. With a gated activation (SwiGLU, quick GEGLU), fc1 rows are [gate ; up]
    (Megatron's layout); a TP shard is [gate_r ; up_r], so each rank applies it to its own columns."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        ffn = config.ffn_hidden_size
        self.swiglu = config.swiglu
        self.quick_geglu = quick_geglu_of(config) if config.quick_geglu else None
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        gated = config.gated_linear_unit
        fc1_out = 2 * ffn if gated else ffn
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, fc1_out, config.add_bias_linear, dtype, tp,
                                               local_rows=_swiglu_rows(ffn, tp) if gated else None)
        self.linear_fc2 = RowParallelLinear(ffn, config.hidden_size, config.add_bias_linear, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.swiglu:
            h = swiglu(h)
        elif self.quick_geglu is not None:
            h = self.quick_geglu(h)
        else:
            h = F.gelu(h, approximate=self.gelu_approximate)
        return self.linear_fc2(h)


class _SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up over fc1's [gate | up] output, keeping only that output for backward.

    Autograd of the two ops would also keep silu(gate) (s x b x f); like Megatron's fused bias-SwiGLU
    this recomputes it in backward. Backward runs the ops autograd of silu(gate) * up would run (so the
    same values), written straight into the two halves of one gradient: silu's own fused backward
    kernel, not a chain of fp32 elementwise ops (memory-bound on a CPU, so several times slower in bf16).
    Each pass writes in place into the one tensor it returns: a CPU pays for every new tensor as a pass
    of page faults (the allocator gives freed memory back to the OS)."""

    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        gate, up = h.chunk(2, dim=-1)
        out = torch.ops.aten.silu.out(gate, out=torch.empty(up.shape, dtype=h.dtype, device=h.device))
        return out.mul_(up)

    @staticmethod
    def backward(ctx, grad):
        h, = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        grad_h = torch.empty_like(h)
        grad_gate, grad_up = grad_h.chunk(2, dim=-1)
        torch.mul(grad, up, out=grad_gate)
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        torch.ops.aten.silu.out(gate, out=grad_up).mul_(grad)
        return grad_h


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """[..., 2f] fc1 output [gate | up] -> silu(gate) * up [..., f]."""
    if records_autograd(h):
        return _SwiGLUFunction.apply(h)           # compiled: the plain ops, fused and partitioned by inductor
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def quick_geglu(h: torch.Tensor, offset: float = 0.0, clamp: float | None = None) -> torch.Tensor:
    """[..., 2f] fc1 output [gate | linear] -> gate sigmoid(1.702 gate) (linear + offset) [..., f] (Megatron's
    quick GEGLU); with ``clamp`` v the gate is first clamped to <= v and the linear half to [-v, v]. GPT-OSS's
    experts: offset 1, v = 7."""
    gate, linear = h.chunk(2, dim=-1)
    if clamp is not None:
        gate, linear = gate.clamp(max=clamp), linear.clamp(min=-clamp, max=clamp)
    return (linear + offset) * (gate * torch.sigmoid(gate * 1.702))


def quick_geglu_of(config: ModelConfig):
    """The quick GEGLU of --glu-linear-offset and --activation-func-clamp-value."""
    return partial(quick_geglu, offset=config.glu_linear_offset, clamp=config.activation_func_clamp_value)


def _swiglu_rows(ffn: int, tp: TensorParallel):
    """This rank's [gate_r ; up_r] rows of a full [gate ; up] fc1 weight or bias."""
    def local_rows(full: torch.Tensor) -> torch.Tensor:
        halves = full.view(2, ffn, *full.shape[1:])
        return tp.chunk(halves, dim=1).reshape(-1, *full.shape[1:])
    return local_rows
