"""Gradient clipping over the global L2 norm (Megatron: coefficient max_norm / (norm + 1e-6))."""
from __future__ import annotations

import torch


@torch.no_grad()
def clip_by_global_norm(flat_grads: torch.Tensor, max_norm: float) -> float:
    """Clips ``flat_grads`` in place when ``max_norm`` > 0; returns the norm before clipping."""
    norm = float(torch.linalg.vector_norm(flat_grads, 2.0, dtype=torch.float32))
    if max_norm > 0.0:
        coefficient = max_norm / (norm + 1.0e-6)
        if coefficient < 1.0:
            flat_grads.mul_(coefficient)
    return norm
