"""Contiguous storage for all parameters and their fp32 gradients ("main_grad"), cut into buckets.

Every parameter's data becomes a view into one flat buffer in the model's dtype, and every gradient
accumulates into a view of one flat fp32 buffer, in reverse parameter order (the order backward
produces them). One flat tensor makes the optimizer step, gradient clipping and the data-parallel
reduction a handful of large operations instead of one per parameter.

fp32 models: ``param.grad`` *is* the main_grad view, so autograd accumulates into it in place.
bf16/fp16 models: a post-accumulate hook adds the low-precision grad into the fp32 main_grad and frees
it, so micro-batch accumulation happens in fp32 (Megatron's behaviour).
``fuse_weight_grads()`` marks the linear weights whose gradient the matmul itself can add into main_grad
(gradient-accumulation fusion, parallel/tensor/layers.py): fp32 weights anywhere, bf16/fp16 where PyTorch
has a mixed-dtype addmm on the device (CUDA). Not with ``shard_grads``: there main_grad is not kept.

Buckets (data parallelism). The flat layout is split into buckets, each a run of whole parameters
(about ``bucket_size`` elements; a parameter is never split). MoE expert weights (``expert`` in their
record) are replicated over the expert-data-parallel ranks instead (``expert_dp``: that group's rank and
size): they get buckets of their own, whose chunks are cut over that group, so every bucket belongs to one
group. A bucket is the unit of communication: one all-reduce, or one reduction to the owners + one
gather from them, per bucket. Data-parallel rank r owns the r-th of the ``dp_size`` contiguous chunks
(regions) of every bucket, laid back to back in rank order (``Bucket.bounds``).

Two layouts of a bucket's parameters (``whole_params``, --use-layer-wise-distributed-optimizer):
- equal slices (default, Megatron's distributed-optimizer layout): parameters one after another, the
  bucket padded to a multiple of the group size and cut into equal chunks, so a chunk boundary may cut
  a parameter anywhere, mid-row included; the collectives are a reduce-scatter and an all-gather;
- whole parameters (the layout of Megatron's LayerWiseDistributedOptimizer, which optimizers acting on
  whole matrices such as Muon need): each parameter is assigned to one rank, balanced by size or by a
  per-parameter cost (``owner_cost``: Muon's Newton-Schulz FLOPs; owners.py), and rank r's parameters
  fill its region; regions have unequal lengths and no padding, so a rank holds only its own parameters'
  elements. Unequal regions are reduced with one reduce per owner and gathered with one broadcast per
  owner (bucket_comm.Comm).

ZeRO sharding of the storage itself:
- ``shard_grads`` (ZeRO-2/3): no full fp32 gradient buffer; only this rank's chunks (``grad_shard``).
  Each bucket stages one micro-batch's gradients in a full-size tensor that exists only from the
  bucket's first gradient to the end of its reduction (``Bucket.staging``).
- ``shard_params`` (ZeRO-3): no full parameter buffer; only this rank's chunks (``param_shard``). Each
  bucket's parameters view its ``unsharded`` tensor, which has storage only while gathered.

Those temporaries are ``Transient`` tensors: the tensor object (and every view of it handed to a
collective) lives as long as the bucket, while its storage is allocated and freed around each use.
Freeing the bytes never drops the object a collective was given, so the release of a tensor is never
left to a communication thread.

Sharded start-up: for parameters built on the meta device (``GPTModel(meta=True)``) the buffer allocates
only what this rank holds on ``device`` and hands back parameters with that storage (``replacements``,
swapped into the modules by the data-parallel wrapper, each carrying its record); which elements of each
landed where is stated (``local_elements``) and filled once by materialise.py, so no rank ever
materialises a tensor it does not keep. Parameters that already have storage bring their values along.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from megalite.parallel.data.materialise import LocalElements
from megalite.parallel.data.owners import region_offsets, whole_param_owners
from megalite.parallel.data.protocol import FlatLayout
from megalite.parallel.param_meta import mark, param_meta


class Transient:
    """A tensor whose storage comes and goes while the tensor object (and its views) stay.

    Created allocated, so views can be taken (a view of an empty storage is refused); ``free()`` it then."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.tensor = torch.empty(numel, dtype=dtype, device=device)
        self._nbytes = self.tensor.untyped_storage().nbytes()

    @property
    def allocated(self) -> bool:
        return self.tensor.untyped_storage().nbytes() > 0

    def allocate(self, zero: bool = False) -> torch.Tensor:
        if not self.allocated:
            self.tensor.untyped_storage().resize_(self._nbytes)
            if zero:
                self.tensor.zero_()
        return self.tensor

    def free(self) -> None:
        self.tensor.untyped_storage().resize_(0)

    def nbytes(self) -> int:
        return self.tensor.untyped_storage().nbytes()


@dataclass(frozen=True)
class BufferSlot:
    start: int
    end: int
    shape: tuple


@dataclass(eq=False)                 # identity: buckets are compared and looked up as objects
class Bucket:
    index: int
    start: int                       # offsets in the (padded) flat layout
    end: int
    names: list = field(default_factory=list)
    params: list = field(default_factory=list)
    unit: int = 0                    # the module unit (ZeRO-3 gather granularity) its parameters belong to
    expert: bool = False             # holds MoE expert weights: reduced and sharded over the expert DP group
    shard_rank: int = 0              # this rank's place in the bucket's data-parallel group, and its size
    shard_size: int = 1
    shard_start: int = 0             # where this rank's chunk of the bucket starts in the shard tensors
    bounds: tuple = (0, 0)           # rank r's chunk is [start + bounds[r], start + bounds[r + 1])
    own_bucket: bool = False         # holds one shared_embedding parameter and nothing else
    fp8: bool = False                # holds weights gathered in FP8 (--fp8-param-gather) and nothing else
    unsharded: Transient | None = None   # ZeRO-3: the full bucket of parameters while gathered
    fp8_gathered: Transient | None = None  # --fp8-param-gather: the bucket's FP8 bytes while gathered (fp8_gather.py)
    fp8_local: torch.Tensor | None = None  # --fp8-param-gather: this rank's chunk in FP8, kept for its gathers
    staging: Transient | None = None     # ZeRO-2/3: one micro-batch's gradients until reduced
    reduced: Transient | None = None     # ZeRO-2/3, equal chunks: this rank's reduced chunk while reduced
    staging_chunks: list = field(default_factory=list)   # views of staging, one per data-parallel rank

    @property
    def numel(self) -> int:
        return self.end - self.start

    def chunk(self, rank: int) -> tuple[int, int]:
        """[start, end) in the flat layout of data-parallel rank ``rank``'s chunk of this bucket."""
        return self.start + self.bounds[rank], self.start + self.bounds[rank + 1]

    @property
    def chunk_numel(self) -> int:
        """Elements of this rank's chunk."""
        return self.bounds[self.shard_rank + 1] - self.bounds[self.shard_rank]

    @property
    def largest_chunk_numel(self) -> int:
        return max(b - a for a, b in zip(self.bounds, self.bounds[1:]))

    @property
    def even(self) -> bool:
        """Whether every rank's chunk has the same length (reduce-scatter and all-gather apply)."""
        return len({b - a for a, b in zip(self.bounds, self.bounds[1:])}) == 1

    def regions(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A bucket-sized 1-D tensor cut into the ranks' chunks (views)."""
        return [flat[a:b] for a, b in zip(self.bounds, self.bounds[1:])]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ParamAndGradBuffer(FlatLayout):
    """The flat parameter and fp32 gradient storage of DistributedDataParallel (module docstring)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], bucket_size: int | None = None,
                 dp_rank: int = 0, dp_size: int = 1, shard_grads: bool = False, shard_params: bool = False,
                 units: list[int] | None = None, device: torch.device | None = None,
                 staging_dtype: torch.dtype = torch.float32, expert_dp: tuple[int, int] | None = None,
                 whole_params: bool = False, owner_cost=None, fp8_params: frozenset = frozenset()):
        """``units[i]`` is the module unit of ``named_params[i]``; a bucket never spans two units when given (ZeRO-2/3
        reduce and gather per unit). ``bucket_size`` None: one bucket (per unit). ``device``: where storage lives
        (needed when the parameters are on the meta device). ``staging_dtype``: dtype of ZeRO-2/3 per-micro-batch
        gradient staging (bf16 with --grad-reduce-in-bf16: the reduce-scatter moves half the bytes). ``expert_dp``:
        (rank, size) in the expert-data-parallel group, for expert weights (default: the data-parallel ones).
        ``whole_params``: each parameter in one rank's chunk, its owner balanced by ``owner_cost(name, param)``
        (owners.py). ``fp8_params``: ids of the weights gathered in FP8 (--fp8-param-gather), in buckets of theirs."""
        if not named_params:
            raise ValueError("ParamAndGradBuffer needs at least one parameter")
        dtypes = {p.dtype for _, p in named_params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters of one buffer must share a dtype, got {dtypes}")
        self.param_dtype = dtypes.pop()
        self.compute_dtype = self.param_dtype          # forward and backward run in the parameters' dtype
        self.params = [p for _, p in named_params]
        self.device = device or self.params[0].device
        if device is None and self.device.type == "meta":
            raise ValueError("parameters are on the meta device: pass the device their storage goes to")
        self.dp_rank, self.dp_size, self.whole_params = dp_rank, dp_size, whole_params
        self.expert_dp, self.fp8_params = expert_dp or (dp_rank, dp_size), fp8_params
        self.shard_grads, self.shard_params = shard_grads or shard_params, shard_params
        self.slots: dict[str, BufferSlot] = {}
        self.buckets: list[Bucket] = []
        self._views: dict[tuple, torch.Tensor] = {}
        self.numel_unpadded = sum(p.numel() for p in self.params)
        self._layout(named_params, bucket_size, units or [0] * len(named_params), owner_cost)
        self.numel = self.buckets[-1].end
        self.shard_numel = sum(b.chunk_numel for b in self.buckets)

        # ---- parameters (storage-less meta parameters are replaced by ones with storage: ``replacements``)
        self.replacements: dict[int, nn.Parameter] = {}
        self._elements: list[LocalElements] = []
        self.param_data = self.param_shard = None
        if not shard_params:
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=self.device)
            for bucket in self.buckets:
                for name, param in zip(bucket.names, bucket.params):
                    slot = self.slots[name]
                    target = self.param_data[slot.start:slot.end]
                    self._place(param, 0, param.numel(), target)
                    self._set_storage(param, target.view(slot.shape))
        else:
            self.param_shard = torch.zeros(self.shard_numel, dtype=self.param_dtype, device=self.device)
            for bucket in self.buckets:
                bucket.unsharded = Transient(bucket.numel, self.param_dtype, self.device)
                self._place_local_chunk(bucket)
                for name, param in zip(bucket.names, bucket.params):
                    slot = self.slots[name]
                    self._set_storage(param, bucket.unsharded.tensor[slot.start - bucket.start:slot.end - bucket.start]
                                      .view(slot.shape))
                bucket.unsharded.free()           # gathered only around its uses
        for bucket in self.buckets:
            bucket.params = [self.replacements.get(id(p), p) for p in bucket.params]
        self.params = [self.replacements.get(id(p), p) for p in self.params]

        # ---- gradients
        self.grad_data = self.grad_shard = None
        if not self.shard_grads:
            self.grad_data = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
            for name, param in zip(self._names(), self.params):
                param.main_grad = self.view(self.grad_data, name)
        else:
            self.grad_shard = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device)
            for bucket in self.buckets:
                bucket.staging = Transient(bucket.numel, staging_dtype, self.device)
                bucket.staging_chunks = bucket.regions(bucket.staging.tensor)
                if bucket.even:                   # unequal chunks are reduced in place in the staging
                    bucket.reduced = Transient(bucket.chunk_numel, staging_dtype, self.device)
                    bucket.reduced.free()
                bucket.staging.free()
        self.grads_are_main_grads = self.param_dtype == torch.float32 and not self.shard_grads
        self._hooks = []
        if not self.grads_are_main_grads and not self.shard_grads:
            self._hooks = [p.register_post_accumulate_grad_hook(_accumulate_into_main_grad) for p in self.params]
        self.zero_grad()

    # ---- layout ----------------------------------------------------------------------------------
    def _layout(self, named_params, bucket_size, units, owner_cost=None) -> None:
        """Reverse parameter order; a new bucket when the current one reaches ``bucket_size`` elements,
        the module unit changes, expert weights meet dense ones or FP8-gathered weights others
        (``_close`` places the parameters).

        A parameter marked ``shared_embedding`` (the word embedding that the first and last pipeline
        stages both hold) gets a bucket of its own when the buffer is sharded, so both stages shard it
        identically and its gradient can be summed across them after the data-parallel reduction."""
        limit = bucket_size if bucket_size else float("inf")
        order = list(zip(named_params, units))
        if self.fp8_params:        # each unit's FP8-gathered weights next to each other, so in buckets of their own
            order.sort(key=lambda entry: (entry[1], id(entry[0][1]) in self.fp8_params))
        self._owner = {}
        for expert, ranks in ((False, self.dp_size), (True, self.expert_dp[1])):
            group = [(n, p) for n, p in named_params if bool(param_meta(p).expert) == expert]
            if self.whole_params and ranks > 1:
                costs = [owner_cost(n, p) for n, p in group] if owner_cost else None
                self._owner.update(zip((id(p) for _, p in group),
                                       whole_param_owners([p.numel() for _, p in group], ranks, costs)))
        offset, current, filled = 0, None, 0
        for (name, param), unit in reversed(order):
            own_bucket = self.dp_size > 1 and param_meta(param).shared_embedding
            expert, fp8 = param_meta(param).expert, id(param) in self.fp8_params
            if current is not None and (filled >= limit or unit != current.unit or own_bucket
                                        or current.own_bucket or expert != current.expert or fp8 != current.fp8):
                offset = self._close(current)
                current = None
            if current is None:
                rank, size = self.expert_dp if expert else (self.dp_rank, self.dp_size)
                shard_start = self.buckets[-1].shard_start + self.buckets[-1].chunk_numel if self.buckets else 0
                current = Bucket(len(self.buckets), offset, offset, unit=unit, expert=expert, shard_rank=rank,
                                 shard_size=size, shard_start=shard_start, fp8=fp8)
                current.own_bucket, filled = own_bucket, 0
                self.buckets.append(current)
            current.names.append(name)
            current.params.append(param)
            filled += param.numel()
        self._close(current)

    def _close(self, bucket: Bucket) -> int:
        """Give the bucket's parameters their slots and the bucket its end and chunk bounds; returns the
        end. Equal slices: one after another, the bucket padded to a multiple of its group's size. Whole
        parameters: each in the region of the rank ``whole_param_owners`` assigns it to, no padding."""
        sizes, ranks = [p.numel() for p in bucket.params], bucket.shard_size
        if self.whole_params and ranks > 1:
            offsets, share = region_offsets(sizes, [self._owner[id(p)] for p in bucket.params], ranks)
            bucket.bounds = tuple(sum(share[:r]) for r in range(ranks + 1))
        else:
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            numel = _round_up(max(sum(sizes), 1), ranks)
            bucket.bounds = tuple(r * numel // ranks for r in range(ranks + 1))
        for name, param, offset in zip(bucket.names, bucket.params, offsets):
            self.slots[name] = BufferSlot(bucket.start + offset, bucket.start + offset + param.numel(),
                                          tuple(param.shape))
        bucket.end = bucket.start + bucket.bounds[-1]
        return bucket.end

    def _names(self) -> list[str]:
        order = {id(p): i for i, p in enumerate(self.params)}
        names = [None] * len(self.params)
        for bucket in self.buckets:
            for name, param in zip(bucket.names, bucket.params):
                names[order[id(param)]] = name
        return names

    def _set_storage(self, param: nn.Parameter, view: torch.Tensor) -> None:
        """Make ``param`` a view into the buffer. A meta parameter cannot take real data, so it is replaced
        by a new Parameter carrying its attributes and record (the caller swaps it into the module)."""
        if param.device.type != "meta":
            param.data = view
            return
        # .data (not the constructor): the parameter keeps a version counter of its own, so ZeRO-3's
        # re-gathers into the bucket between forward and backward do not look like in-place edits
        new = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device), requires_grad=param.requires_grad)
        new.data = view
        new.__dict__.update(param.__dict__)
        self.replacements[id(param)] = new

    def _place_local_chunk(self, bucket: Bucket) -> None:
        """ZeRO-3: this rank's chunk of ``bucket``, touching only the elements of the chunk."""
        start, end = self.local_range(bucket)
        chunk = self.local_param_chunk(bucket)
        for name, param in zip(bucket.names, bucket.params):
            slot = self.slots[name]
            lo, hi = max(start, slot.start), min(end, slot.end)
            if lo < hi:
                self._place(param, lo - slot.start, hi - slot.start, chunk[lo - start:hi - start])

    @torch.no_grad()
    def _place(self, param: nn.Parameter, start: int, end: int, target: torch.Tensor) -> None:
        """Elements [start, end) of ``param`` go to ``target`` (1-D): a parameter with storage brings its
        values now; a storage-less one's are stated for materialise to fill (``local_elements``)."""
        if param.device.type == "meta":
            self._elements.append(LocalElements(param, start, end, target))
        elif target.device.type != "meta":
            target.copy_(param.detach().reshape(-1)[start:end])

    def local_elements(self) -> list[LocalElements]:
        """The elements of each storage-less parameter this rank keeps and where they are, named by the
        parameter that holds them now (its replacement): what materialise.py fills."""
        return [dataclasses.replace(e, param=self.replacements[id(e.param)]) for e in self._elements]

    # ---- views -----------------------------------------------------------------------------------
    def view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """The part of a buffer-shaped flat tensor (params, grads, optimizer state) belonging to ``name``."""
        slot = self.slots[name]
        return flat[slot.start:slot.end].view(slot.shape)

    def local_range(self, bucket: Bucket) -> tuple[int, int]:
        """This rank's chunk of ``bucket`` in the flat layout."""
        return bucket.chunk(bucket.shard_rank)

    def _local_offsets(self, bucket: Bucket) -> tuple[int, int]:
        """Where this rank's chunk of ``bucket`` sits in the shard tensors (chunks in bucket order)."""
        return bucket.shard_start, bucket.shard_start + bucket.chunk_numel

    # Views are created once and kept, so a collective always gets the same tensor objects.
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
            return bucket.unsharded.tensor
        return self._cached("params", bucket, lambda: self.param_data[bucket.start:bucket.end])

    def bucket_grads(self, bucket: Bucket) -> torch.Tensor:
        return self._cached("grads", bucket, lambda: self.grad_data[bucket.start:bucket.end])

    def bucket_grad_chunks(self, bucket: Bucket) -> list[torch.Tensor]:
        """``bucket_grads(bucket)`` cut into the ranks' chunks (the inputs of its reduction)."""
        return self._cached("grad_chunks", bucket, lambda: bucket.regions(self.bucket_grads(bucket)))

    def bucket_param_chunks(self, bucket: Bucket) -> list[torch.Tensor]:
        """``bucket_params(bucket)`` cut into the ranks' chunks (the outputs of its gather)."""
        return self._cached("param_chunks", bucket, lambda: bucket.regions(self.bucket_params(bucket)))

    # ---- ZeRO-3 parameter storage ----------------------------------------------------------------
    def is_gathered(self, bucket: Bucket) -> bool:
        return bucket.unsharded.allocated

    def allocate(self, bucket: Bucket) -> None:
        """Give the bucket's unsharded tensor its storage back (contents undefined until gathered)."""
        bucket.unsharded.allocate()

    def release(self, bucket: Bucket) -> None:
        bucket.unsharded.free()

    # ---- gradients -------------------------------------------------------------------------------
    def remove_hooks(self) -> None:
        """Remove the hooks that add 16-bit gradients into main_grad (end of training)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

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

    def fuse_weight_grads(self) -> int:
        """Mark every 2-D parameter whose gradient the matmul can add straight into its main_grad
        (``fuse_wgrad_into_main_grad``); returns how many. Only the linears of parallel/tensor/layers.py
        act on the mark; an embedding's gradient still arrives through autograd."""
        if self.shard_grads:
            return 0
        fused = 0
        for p in self.params:
            if p.dim() == 2 and (p.dtype == torch.float32 or _mixed_dtype_addmm_works(p.device, p.dtype)):
                mark(p, fuse_wgrad_into_main_grad=True)
                fused += 1
        return fused

    # ---- accounting ------------------------------------------------------------------------------
    def state_tensors(self, kind: str) -> list[torch.Tensor]:
        """The storage this rank keeps for its parameters (the flat one, and with --fp8-param-gather the FP8
        copies of its chunks of the FP8 buckets) or its gradients (``kind``)."""
        if kind == "parameters":
            flat = (self.param_data, self.param_shard, *(b.fp8_local for b in self.buckets))
        else:
            flat = (self.grad_data, self.grad_shard)
        return [t for t in flat if t is not None]

    def transients(self) -> list[tuple[str, Transient]]:
        """The buffers that hold storage only while in use, each with what it holds: ZeRO-3's gathered
        buckets and the FP8 ones of --fp8-param-gather ("gathered parameters"), ZeRO-2/3's gradient
        staging and reduced chunks ("gradient reduction")."""
        found = []
        for b in self.buckets:
            found += [("gathered parameters", t) for t in (b.unsharded, b.fp8_gathered) if t is not None]
            found += [("gradient reduction", t) for t in (b.staging, b.reduced) if t is not None]
        return found

    def param_bytes(self) -> int:
        """Bytes of parameter storage this rank holds now (ZeRO-3: its shard plus gathered buckets; with
        --fp8-param-gather the FP8 copies of its chunks too)."""
        fp8 = sum(b.fp8_local.untyped_storage().nbytes() for b in self.buckets if b.fp8_local is not None)
        if self.param_data is not None:
            return self.param_data.untyped_storage().nbytes() + fp8
        return self.param_shard.untyped_storage().nbytes() + sum(b.unsharded.nbytes() for b in self.buckets) + fp8

    def grad_bytes(self) -> int:
        """Bytes of gradient storage held now (ZeRO-2/3: the shard plus buckets being reduced)."""
        flat = self.grad_data if self.grad_data is not None else self.grad_shard
        transient = sum(t.nbytes() for b in self.buckets for t in (b.staging, b.reduced) if t is not None)
        return flat.untyped_storage().nbytes() + transient


@functools.cache
def _mixed_dtype_addmm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(fp32 c, low-precision a, b, out_dtype=fp32, out=c)`` runs here and is right
    (PyTorch has it for CUDA only; on CPU it raises NotImplementedError)."""
    try:
        a = torch.ones(4, 8, dtype=dtype, device=device)
        c = torch.ones(4, 4, dtype=torch.float32, device=device)
        torch.addmm(c, a, a.t(), out_dtype=torch.float32, out=c)
        return bool((c == 9).all())
    except (RuntimeError, TypeError):         # NotImplementedError is a RuntimeError
        return False


def _accumulate_into_main_grad(param: nn.Parameter) -> None:
    if param.grad is not None:               # None: the matmul already added it (fuse_weight_grads)
        param.main_grad.add_(param.grad)
    param.grad = None
