"""Contiguous storage for all parameters and their fp32 gradients ("main_grad"), cut into buckets.

Every parameter's data becomes a view into one flat buffer in the model's dtype, and every gradient
accumulates into a view of one flat fp32 buffer, in reverse parameter order (the order backward
produces them). One flat tensor makes the optimizer step, gradient clipping and the data-parallel
reduction a handful of large operations instead of one per parameter.

fp32 models: ``param.grad`` *is* the main_grad view, so autograd accumulates into it in place.
bf16/fp16 models: a post-accumulate hook adds the low-precision grad into the fp32 main_grad and frees
it, so micro-batch accumulation happens in fp32 (Megatron's behaviour).

Buckets (data parallelism). The flat layout is split into buckets, each a run of whole parameters
(about ``bucket_size`` elements; a parameter is never split) and padded to a multiple of the
data-parallel size ``dp_size``. A bucket is the unit of communication: one all-reduce, or one
reduce-scatter + all-gather, per bucket. Data-parallel rank r owns the r-th of the ``dp_size`` equal,
contiguous chunks of every bucket (Megatron's distributed-optimizer layout); with one bucket that is
simply the r-th contiguous chunk of the whole buffer.

ZeRO sharding of the storage itself:
- ``shard_grads`` (ZeRO-2/3): no full fp32 gradient buffer; only this rank's chunks (``grad_shard``,
  numel / dp_size). Gradients of a bucket are collected in a temporary full-size bucket tensor by the
  data-parallel wrapper and reduce-scattered into the shard.
- ``shard_params`` (ZeRO-3): no full parameter buffer; only this rank's chunks (``param_shard``). Each
  bucket has an ``unsharded`` tensor that the parameters of the bucket view; its storage is allocated
  only while the bucket is gathered (``gather`` / ``release`` resize it between full size and 0).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class BufferSlot:
    start: int
    end: int
    shape: tuple


@dataclass(eq=False)                 # identity: buckets are compared and looked up as objects
class Bucket:
    index: int
    start: int                       # offsets in the (padded) flat layout
    end: int                         # (end - start) is a multiple of dp_size
    names: list = field(default_factory=list)
    params: list = field(default_factory=list)
    unit: int = 0                    # the module unit (ZeRO-3 gather granularity) its parameters belong to
    alone: bool = False              # holds one shared_embedding parameter and nothing else
    unsharded: torch.Tensor | None = None   # ZeRO-3: full bucket of parameters, storage freed when released

    @property
    def numel(self) -> int:
        return self.end - self.start

    def chunk(self, rank: int, size: int) -> tuple[int, int]:
        """[start, end) in the flat layout of data-parallel rank ``rank``'s chunk of this bucket."""
        n = self.numel // size
        return self.start + rank * n, self.start + (rank + 1) * n


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ParamAndGradBuffer:
    def __init__(self, named_params: list[tuple[str, nn.Parameter]], bucket_size: int | None = None,
                 dp_rank: int = 0, dp_size: int = 1, shard_grads: bool = False, shard_params: bool = False,
                 units: list[int] | None = None):
        """``units[i]`` is the module unit of ``named_params[i]``; a bucket never spans two units when
        given (ZeRO-3 gathers per unit). ``bucket_size`` None: one bucket (per unit)."""
        if not named_params:
            raise ValueError("ParamAndGradBuffer needs at least one parameter")
        dtypes = {p.dtype for _, p in named_params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters of one buffer must share a dtype, got {dtypes}")
        self.param_dtype = dtypes.pop()
        self.params = [p for _, p in named_params]
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.shard_grads, self.shard_params = shard_grads or shard_params, shard_params
        self.slots: dict[str, BufferSlot] = {}
        self.buckets: list[Bucket] = []
        self._views: dict[tuple, torch.Tensor] = {}
        self.numel_unpadded = sum(p.numel() for p in self.params)
        self._layout(named_params, bucket_size, units or [0] * len(named_params))
        self.numel = self.buckets[-1].end
        device = self.params[0].device

        # ---- parameters
        self.param_data = self.param_shard = None
        if not shard_params:
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
            for bucket in self.buckets:
                for name, param in zip(bucket.names, bucket.params):
                    self._adopt(param, self.param_data, self.slots[name].start)
        else:
            self.param_shard = torch.zeros(self.numel // dp_size, dtype=self.param_dtype, device=device)
            for bucket in self.buckets:
                bucket.unsharded = torch.zeros(bucket.numel, dtype=self.param_dtype, device=device)
                for name, param in zip(bucket.names, bucket.params):
                    self._adopt(param, bucket.unsharded, self.slots[name].start - bucket.start)
                start, end = bucket.chunk(dp_rank, dp_size)
                self.local_param_chunk(bucket).copy_(bucket.unsharded[start - bucket.start:end - bucket.start])
                self.release(bucket)

        # ---- gradients
        self.grad_data = self.grad_shard = None
        if not self.shard_grads:
            self.grad_data = torch.zeros(self.numel, dtype=torch.float32, device=device)
            for name, param in zip(self._names(), self.params):
                param.main_grad = self.view(self.grad_data, name)
        else:
            self.grad_shard = torch.zeros(self.numel // dp_size, dtype=torch.float32, device=device)
        self.grads_are_main_grads = self.param_dtype == torch.float32 and not self.shard_grads
        self._hooks = []
        if not self.grads_are_main_grads and not self.shard_grads:
            self._hooks = [p.register_post_accumulate_grad_hook(_accumulate_into_main_grad) for p in self.params]
        self.zero_grad()

    # ---- layout ----------------------------------------------------------------------------------
    def _layout(self, named_params, bucket_size, units) -> None:
        """Reverse parameter order; a new bucket when the current one reaches ``bucket_size`` elements
        or the module unit changes; every bucket padded to a multiple of dp_size.

        A parameter marked ``shared_embedding`` (the word embedding that the first and last pipeline
        stages both hold) gets a bucket of its own when the buffer is sharded, so both stages shard it
        identically and its gradient can be summed across them after the data-parallel reduction."""
        limit = bucket_size if bucket_size else float("inf")
        offset, current = 0, None
        for (name, param), unit in reversed(list(zip(named_params, units))):
            alone = self.dp_size > 1 and getattr(param, "shared_embedding", False)
            if current is not None and (offset - current.start >= limit or unit != current.unit or alone
                                        or current.alone):
                offset = self._close(current, offset)
                current = None
            if current is None:
                current = Bucket(len(self.buckets), offset, offset, unit=unit)
                current.alone = alone
                self.buckets.append(current)
            self.slots[name] = BufferSlot(offset, offset + param.numel(), tuple(param.shape))
            current.names.append(name)
            current.params.append(param)
            offset += param.numel()
        self._close(current, offset)

    def _close(self, bucket: Bucket, offset: int) -> int:
        bucket.end = bucket.start + _round_up(max(offset - bucket.start, 1), self.dp_size)
        return bucket.end

    def _names(self) -> list[str]:
        order = {id(p): i for i, p in enumerate(self.params)}
        names = [None] * len(self.params)
        for bucket in self.buckets:
            for name, param in zip(bucket.names, bucket.params):
                names[order[id(param)]] = name
        return names

    def _adopt(self, param: nn.Parameter, storage: torch.Tensor, offset: int) -> None:
        n = param.numel()
        storage[offset:offset + n].copy_(param.data.view(-1))
        param.data = storage[offset:offset + n].view(param.shape)

    # ---- views -----------------------------------------------------------------------------------
    def view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """The part of a buffer-shaped flat tensor (params, grads, optimizer state) belonging to ``name``."""
        slot = self.slots[name]
        return flat[slot.start:slot.end].view(slot.shape)

    def local_range(self, bucket: Bucket) -> tuple[int, int]:
        """This rank's chunk of ``bucket`` in the flat layout."""
        return bucket.chunk(self.dp_rank, self.dp_size)

    def _local_offsets(self, bucket: Bucket) -> tuple[int, int]:
        """Where this rank's chunk of ``bucket`` sits in the shard tensors (chunks in bucket order)."""
        n = bucket.numel // self.dp_size
        return bucket.start // self.dp_size, bucket.start // self.dp_size + n

    # The views below are created once and kept: tensors handed to asynchronous collectives must stay
    # alive in Python until the backend's worker thread has let go of them, otherwise that thread
    # frees their Python objects and, at interpreter exit, aborts the process (gloo).
    def _cached(self, kind: str, bucket: Bucket, make) -> torch.Tensor:
        key = (kind, bucket.index)
        if key not in self._views:
            self._views[key] = make()
        return self._views[key]

    def local_param_chunk(self, bucket: Bucket) -> torch.Tensor:
        if self.param_shard is not None:
            return self._cached("param_chunk", bucket, lambda: self.param_shard[slice(*self._local_offsets(bucket))])
        return self._cached("param_chunk", bucket, lambda: self.param_data[slice(*self.local_range(bucket))])

    def local_grad_chunk(self, bucket: Bucket) -> torch.Tensor:
        if self.grad_shard is not None:
            return self._cached("grad_chunk", bucket, lambda: self.grad_shard[slice(*self._local_offsets(bucket))])
        return self._cached("grad_chunk", bucket, lambda: self.grad_data[slice(*self.local_range(bucket))])

    def bucket_params(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's parameters (ZeRO-3: its unsharded tensor, empty while released)."""
        if self.param_data is None:
            return bucket.unsharded
        return self._cached("params", bucket, lambda: self.param_data[bucket.start:bucket.end])

    def bucket_grads(self, bucket: Bucket) -> torch.Tensor:
        return self._cached("grads", bucket, lambda: self.grad_data[bucket.start:bucket.end])

    # ---- ZeRO-3 parameter storage ----------------------------------------------------------------
    def is_gathered(self, bucket: Bucket) -> bool:
        return bucket.unsharded.untyped_storage().nbytes() > 0

    def allocate(self, bucket: Bucket) -> None:
        """Give the bucket's unsharded tensor its storage back (contents undefined until gathered)."""
        if not self.is_gathered(bucket):
            bucket.unsharded.untyped_storage().resize_(bucket.numel * bucket.unsharded.element_size())

    def release(self, bucket: Bucket) -> None:
        bucket.unsharded.untyped_storage().resize_(0)

    # ---- gradients -------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        if self.grad_data is not None:
            self.grad_data.zero_()
        else:
            self.grad_shard.zero_()
        if self.grads_are_main_grads:
            for p in self.params:
                p.grad = p.main_grad
        else:
            for p in self.params:
                p.grad = None

    # ---- accounting ------------------------------------------------------------------------------
    def param_bytes(self) -> int:
        """Bytes of parameter storage this rank holds now (ZeRO-3: its shard plus gathered buckets)."""
        if self.param_data is not None:
            return self.param_data.untyped_storage().nbytes()
        return self.param_shard.untyped_storage().nbytes() + sum(
            b.unsharded.untyped_storage().nbytes() for b in self.buckets)

    def grad_bytes(self) -> int:
        flat = self.grad_data if self.grad_data is not None else self.grad_shard
        return flat.untyped_storage().nbytes()


def _accumulate_into_main_grad(param: nn.Parameter) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None
