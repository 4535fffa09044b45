"""Every byte of one training step by what it is for, and the step's peak: the accounting of a run
without peers (with or without storage, parallel/dry_run.py) and of --log-memory-breakdown in a real run.

``MemoryAccount`` is a dispatch mode over one step: it sees every tensor an operator creates and every
storage resize (ZeRO's gathered parameters and gradient staging come and go that way), and keeps the
live bytes of each storage under one label until the storage is freed. The peak is the largest sum of
live bytes during the step, and the breakdown is taken at that moment. It counts tensor storage only,
as CUDA's allocated-bytes counter does: no allocator rounding or caching, no communication library's
own buffers, nothing outside the step (the data loader's batches before they are used).

Labels, the first that applies:
- the rank's state, registered when the step starts: ``parameters`` (its weights, or its ZeRO-3
  shard; with --fp8-param-gather also the FP8 copy of its chunks of the FP8 buckets, and under FP8
  delayed scaling the GEMM recipes' amax histories and scales), ``gradients`` (the fp32 gradient
  buffer or its shard), ``optimizer state`` (fp32 master copy and Adam's moments), and the
  data-parallel buffers that exist only while in use: ``gathered parameters`` (ZeRO-3's full units)
  and ``gradient reduction`` (ZeRO-2/3 staging, reduce-scatter outputs);
- ``memory_label(name)`` (observe/memory.py) around an allocation (the data-parallel wrapper's reduce-scatter outputs);
- the forward of a module: ``activations: embedding``, ``activations: layer N`` (global layer number,
  every micro-batch's), ``activations: received`` (a pipeline stage's inputs and output gradients from
  its neighbours), and the rest of a chunk's forward, ``activations: head`` (final norm, output
  layer, loss) on a stage with the head and ``activations: other`` elsewhere; recomputation in backward
  counts as the layer's activations again;
- ``backward temporaries``: created while autograd runs a backward node (activation gradients);
- ``optimizer step``: temporaries of the update; anything else is ``activations: other``.

FP8 (precision/fp8.py) is counted as it runs: the linears save their inputs in the model's precision (no
FP8 copy is kept for backward), and each GEMM's quantisation (the working copies, the FP8 operands and
their scales, precision/fp8_quant.gemm_working_bytes) is the running label's, freed when the GEMM returns.
Not seen: what a kernel allocates outside tensor storage (torch._scaled_mm's cuBLASLt workspace, the same
one bf16 GEMMs use).

On the meta device every storage still has its size, so the same accounting runs without memory or
arithmetic. Values read back to the host there (a loss, the gradient norm) are stand-ins: the run
backend's ``value_reads`` answers them with zeros.
"""
from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from megalite.observe.memory import enter_label, innermost_label, leave_label
from megalite.precision.gemm import GemmPrecision

@dataclass
class Breakdown:
    """The step's peak and its labels' bytes at that moment (``at_peak``)."""
    peak: int = 0
    at_peak: dict[str, int] = field(default_factory=dict)

    def category(self, name: str) -> int:
        """Bytes at the peak of one of CATEGORIES (every activation label under "activations")."""
        return sum(v for label, v in self.at_peak.items() if category_of(label) == name)

    def layers(self) -> dict[str, int]:
        """Activation bytes at the peak by label, without the "activations: " prefix."""
        return {label.split(": ", 1)[1]: v for label, v in self.at_peak.items() if label.startswith("activations: ")}


CATEGORIES = ("parameters", "gathered parameters", "gradients", "gradient reduction", "optimizer state",
              "activations", "backward temporaries", "optimizer step")


def category_of(label: str) -> str:
    return "activations" if label.startswith("activations: ") else label


class MemoryAccount(TorchDispatchMode):
    """Live bytes by label over one training step of the model ``chunks``, their flat parameter
    ``buffer`` and ``optimizer`` (module docstring). Use as a context around the step; ``breakdown``
    holds the result."""

    def __init__(self, chunks: list[torch.nn.Module], buffer, optimizer):
        super().__init__()
        self.chunks, self.buffer, self.optimizer = chunks, buffer, optimizer      # dropped on exit
        self._finalizers: list[weakref.finalize] = []
        self._label_of = WeakIdKeyDictionary()      # storage -> [label, bytes]
        self.live: dict[str, int] = {}
        self.total = 0
        self.breakdown = Breakdown()
        self._hooks: list = []
        self._resize = torch.UntypedStorage.resize_

    # ---- what exists when the step starts ------------------------------------------------------
    def _register_state(self) -> None:
        buffer, optimizer = self.buffer, self.optimizer
        for label, tensors in (("parameters", buffer.state_tensors("parameters")),
                               ("gradients", buffer.state_tensors("gradients")),
                               ("optimizer state", optimizer.state_tensors())):
            for tensor in tensors:
                self._add(tensor.untyped_storage(), label)
        for label, transient in buffer.transients():
            self._add(transient.tensor.untyped_storage(), label)
        for chunk in self.chunks:               # parameters outside the flat buffer, if any
            for param in chunk.parameters():
                self._add(param.untyped_storage(), "parameters")
            for module in chunk.modules():      # a GEMM recipe's state: delayed scaling's histories and scales
                if isinstance(module, GemmPrecision):
                    for state in module.buffers():
                        self._add(state.untyped_storage(), "parameters")

    def _add(self, storage: torch.UntypedStorage, label: str) -> None:
        if storage in self._label_of:
            return
        entry = [label, storage.nbytes()]
        self._label_of[storage] = entry
        self._finalizers.append(weakref.finalize(storage, self._freed, entry))
        self._change(label, entry[1])

    def _freed(self, entry: list) -> None:
        self._change(entry[0], -entry[1])
        entry[1] = 0

    def _change(self, label: str, delta: int) -> None:
        if not delta:
            return
        self.live[label] = self.live.get(label, 0) + delta
        self.total += delta
        if self.total > self.breakdown.peak:
            self.breakdown = Breakdown(self.total, {k: v for k, v in self.live.items() if v})

    # ---- labels ---------------------------------------------------------------------------------
    def _current_label(self) -> str:
        label = innermost_label()
        if label is not None:
            return label
        if torch._C._current_autograd_node() is not None:
            return "backward temporaries"
        return "activations: other"

    def _hook_modules(self) -> None:
        """Forward hooks that label each chunk's, embedding's and layer's forward."""
        for chunk in self.chunks:
            self._label_forward(chunk, "activations: head" if chunk.post_process else "activations: other")
            if chunk.pre_process:
                self._label_forward(chunk.embedding, "activations: embedding")
            for layer in chunk.decoder.layers:
                self._label_forward(layer, f"activations: layer {layer.layer_number}")

    def _label_forward(self, module: torch.nn.Module, label: str) -> None:
        def enter(*_):
            enter_label(label)

        def leave(*_):
            leave_label()
        self._hooks += [module.register_forward_pre_hook(enter),
                        module.register_forward_hook(leave, always_call=True)]

    # ---- the mode -------------------------------------------------------------------------------
    def __enter__(self):
        self._register_state()
        self._hook_modules()
        account = self

        def resize_(storage, size):
            account._resize(storage, size)
            entry = account._label_of.get(storage)
            if entry is None:
                account._add(storage, account._current_label())
            elif storage.nbytes() != entry[1]:
                account._change(entry[0], storage.nbytes() - entry[1])
                entry[1] = storage.nbytes()
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        for hook in self._hooks:
            hook.remove()
        for finalizer in self._finalizers:        # the account is done: no storage keeps it alive
            finalizer.detach()
        self.chunks = self.buffer = self.optimizer = self._finalizers = self._label_of = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, _types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        label = None
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage not in self._label_of:
                    self._add(storage, label or (label := self._current_label()))
        return out


def format_breakdown(rank: int, b: Breakdown) -> list[str]:
    """Two lines: the peak with its categories, then the activations at the peak by layer."""
    parts = " | ".join(f"{name} {b.category(name)} bytes" for name in CATEGORIES)
    layers = sorted(b.layers().items(), key=lambda item: _layer_order(item[0]))
    return [f"memory rank {rank} peak {b.peak} bytes ({b.peak / 2**30:.3f} GiB): {parts}",
            f"memory rank {rank} activations at the peak: "
            + (" | ".join(f"{name} {v} bytes" for name, v in layers) or "none")]


def _layer_order(name: str) -> tuple:
    if name.startswith("layer "):
        return (1, int(name.split()[1]))
    return ({"received": 0, "embedding": 0, "head": 2}.get(name, 3), 0)


PEAK_LINE = re.compile(r"^memory rank (\d+) peak (\d+) bytes \([^)]*\): (.*)$", re.M)
LAYERS_LINE = re.compile(r"^memory rank (\d+) activations at the peak: (.*)$", re.M)


def parse_breakdowns(text: str) -> dict[int, dict]:
    """format_breakdown's lines in ``text``, by rank: {"peak": n, category: n, ..., "layers": {name: n}}."""
    found = {}
    for m in PEAK_LINE.finditer(text):
        found[int(m.group(1))] = {"peak": int(m.group(2)), **_fields(m.group(3))}
    for m in LAYERS_LINE.finditer(text):
        found.setdefault(int(m.group(1)), {})["layers"] = _fields(m.group(2))
    return found


def _fields(text: str) -> dict[str, int]:
    fields = {}
    for part in text.split(" | "):
        name, _, value = part.rpartition(" ")[0].rpartition(" ")
        if name:
            fields[name] = int(value)
    return fields

