#!/usr/bin/env python
"""Peak memory of the loss: unfused vocabulary-parallel cross-entropy vs --cross-entropy-loss-fusion.

The unfused loss upcasts the logits [s*b, V] to fp32 and keeps the fp32 softmax for backward; the
fused (chunked) one keeps the low-precision logits and an fp32 log-sum-exp per token, and upcasts
one chunk of tokens at a time. ``cross_entropy_memory`` runs forward + backward of each on the same
bf16 logits and reports the peak bytes allocated by the loss (the logits themselves excluded): on
CUDA from the caching allocator's statistics, on CPU by tracking every tensor the loss creates
(``LiveBytes``) until it is freed.

    python bench/cross_entropy_memory.py            # a table for a few vocabulary sizes
"""
from __future__ import annotations

import os
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megalite.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy  # noqa: E402


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created by the ops run under it that are alive at once.

    Each op's output storages are counted once (by data pointer) until the last tensor tracked on
    them is freed (torch keeps a tensor's Python object alive as long as the tensor, so a weakref
    finaliser fires when autograd releases a saved tensor too)."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, int] = {}        # storage pointer -> tracked tensors on it
        self.sizes: dict[int, int] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # an output on an input's storage (a view, an in-place op) allocated nothing new
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set) -> None:
        storage = t.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or (ptr in inputs and ptr not in self.refs):
            return
        if ptr not in self.refs:
            self.refs[ptr], self.sizes[ptr] = 0, size
            self.current += size
            self.peak = max(self.peak, self.current)
        self.refs[ptr] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            del self.refs[ptr]
            self.current -= self.sizes.pop(ptr)


def _loss_peak_bytes(logits: torch.Tensor, target: torch.Tensor, fused: bool, chunk_tokens: int | None) -> int:
    def run():
        loss = vocab_parallel_cross_entropy(logits, target, None, 0, fused=fused, chunk_tokens=chunk_tokens)
        loss.mean().backward()
        logits.grad = None

    if logits.device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(logits.device)
        torch.cuda.reset_peak_memory_stats(logits.device)
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(logits.device) - before
    with LiveBytes() as tracker:
        run()
    return tracker.peak


def cross_entropy_memory(tokens: int, vocab: int, dtype: torch.dtype = torch.bfloat16, chunk_tokens: int | None = None,
                         device: str | torch.device = "cpu") -> dict:
    """Peak bytes of forward + backward of the unfused and fused loss over [tokens, vocab] logits of
    ``dtype`` (the logits and their gradient's dtype; the logits themselves are not counted)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    unfused = _loss_peak_bytes(logits, target, False, None)
    fused = _loss_peak_bytes(logits, target, True, chunk_tokens)
    return {"tokens": tokens, "vocab": vocab, "dtype": str(dtype).replace("torch.", ""),
            "logits bytes": logits.numel() * logits.element_size(), "unfused peak bytes": unfused,
            "fused peak bytes": fused, "saved bytes": unfused - fused, "ratio": fused / unfused}


def main() -> None:
    print("| tokens | vocab | dtype | logits MiB | unfused peak MiB | fused peak MiB | fused / unfused |")
    print("|---|---|---|---|---|---|---|")
    for vocab in (32000, 128256):
        r = cross_entropy_memory(2048, vocab)
        mib = lambda key: f"{r[key] / 2**20:.1f}"         # noqa: E731
        print(f"| {r['tokens']} | {vocab} | {r['dtype']} | {mib('logits bytes')} | {mib('unfused peak bytes')} | "
              f"{mib('fused peak bytes')} | {r['ratio']:.2f} |")


if __name__ == "__main__":
    main()
