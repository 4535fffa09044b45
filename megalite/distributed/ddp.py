"""Data parallelism over the flat bucketed buffer, and the parameter/gradient side of ZeRO.

Every data-parallel rank runs the same model on its slice of the global batch; gradients are summed
over the data-parallel group and divided by its size (SUM then divide: gloo's ReduceOp.AVG is not to
be trusted, REFERENCE §7), so every rank ends with the gradient of the mean loss over the global batch.

Strategies (Megatron's ``--data-parallel-sharding-strategy`` names):

- ``no_shard``: every rank keeps everything. After the last micro-batch each bucket of the fp32
  gradient buffer is all-reduced.
- ``optim`` (ZeRO-1, ``--use-distributed-optimizer``): each bucket of the full gradient buffer is
  reduce-scattered after the last micro-batch; rank r keeps the reduced r-th chunk of each bucket, steps
  only that chunk (optimizer/distrib_optimizer.py) and the updated chunks are all-gathered.
- ``optim_grads`` (ZeRO-2): no full gradient buffer. Every micro-batch's gradients of a bucket are
  collected in a temporary bucket tensor and reduce-scattered as soon as the bucket is complete, then
  added into this rank's gradient shard; the temporary is freed.
- ``optim_grads_params`` (ZeRO-3): as ZeRO-2, and parameters are sharded too. Buckets follow module
  units (each transformer layer; the rest of the model is the "root" unit): a unit's parameters are
  all-gathered before its forward and freed after it, gathered again when backward reaches the unit and
  freed once its gradients are reduce-scattered. The root unit stays gathered from its forward until
  its gradients are done (its parameters are used at both ends of the model).

Overlap. ``--overlap-grad-reduce``: a post-accumulate-grad hook counts each parameter's gradients; when
every parameter of a bucket has received its last micro-batch's gradient the bucket's collective is
started asynchronously, so communication runs while backward continues through earlier layers.
Without it, the collectives run in ``finish_grad_sync`` after backward. ``--overlap-param-gather``:
the all-gather of updated parameters (ZeRO-1/2) is started asynchronously after the optimizer step
and each unit's forward pre-hook waits only for the buckets it needs; for ZeRO-3 the next unit's
gather is prefetched during the current unit's forward (and the previous unit's during backward).

Why not FSDP2 (``torch.distributed.fsdp.fully_shard``) for ZeRO-3: it replaces every parameter by a
DTensor with its own per-parameter padded storage, while here parameters are views into one flat
buffer that the optimizer (fused AdamW over flat shards), clipping, the bucketed reductions, the
memory report and the tensor-/pipeline-parallel gradient fix-ups (``all_reduce_param_grads``) all
work on. Sharding that same buffer per unit keeps one code path and one numerics for all four
strategies (ZeRO-3 equals DP=1 to fp32 rounding) and composes with TP, SP and interleaved PP as is.

Pipeline parallelism: pass the rank's model chunks as a list (one buffer for all of them, parameter
names prefixed ``chunk{i}.``); the count of backward passes per step is ``num_microbatches`` for every
chunk, whatever the schedule's order.

Bytes moved per step per rank (ring algorithms, REFERENCE §6), Ψ parameters, d data-parallel ranks:
no_shard all-reduce 2(d-1)/d·4Ψ; optim/optim_grads reduce-scatter (d-1)/d·4Ψ (ZeRO-2: per
micro-batch) + all-gather (d-1)/d·Ψ·bytes(param dtype); ZeRO-3 adds the parameter all-gathers of
forward and backward instead of the one after the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import ParallelConfig
from megalite.distributed.grad_buffer import Bucket, ParamAndGradBuffer
from megalite.parallel_state import ParallelState

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def default_bucket_size(dp_size: int, overlap_grad_reduce: bool) -> int | None:
    """Megatron's default: max(40M, 1M x dp) elements with overlap; one bucket without (one big
    collective is the fastest when nothing overlaps it)."""
    return max(40_000_000, 1_000_000 * dp_size) if overlap_grad_reduce else None


def data_parallel_group(parallel: ParallelState):
    """(group, size, rank) of the data-parallel (x context-parallel) group; group None when size 1.

    Context-parallel ranks hold the same parameters and see other parts of the sequences, so like
    Megatron the gradients are reduced over dp x cp."""
    size = parallel.dp_size * parallel.cp_size
    group = parallel.group("dp_cp")
    if group is None or size == 1:
        return None, 1, 0
    return group, size, dist.get_rank(group)


@dataclass(eq=False)
class Unit:
    """A module whose parameters are gathered together (ZeRO-3) or waited for together (param gather)."""
    module: nn.Module
    is_root: bool = False
    buckets: list = field(default_factory=list)      # buckets holding any of its parameters
    next: "Unit | None" = None                       # the unit that runs after it in forward
    prev: "Unit | None" = None
    in_backward: bool = False
    params: list = field(default_factory=list)


class _Done:
    def wait(self) -> None:
        pass


_DONE = _Done()


class DistributedDataParallel:
    """Owns the parameter/gradient buffer of one rank's model (or model chunks) and its reductions.

    Use per step: ``zero_grad()`` -> forward/backward over the micro-batches -> ``finish_grad_sync()``
    -> optimizer step (which calls ``start_param_sync()``).
    """

    def __init__(self, model: nn.Module | list[nn.Module], config: ParallelConfig, parallel: ParallelState,
                 num_microbatches: int = 1):
        self.models = list(model) if isinstance(model, (list, tuple)) else [model]
        self.strategy = config.data_parallel_sharding_strategy
        if self.strategy == "no_shard" and config.use_distributed_optimizer:
            self.strategy = "optim"
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown data-parallel sharding strategy {self.strategy!r}")
        self.overlap_grad_reduce = config.overlap_grad_reduce
        self.overlap_param_gather = config.overlap_param_gather
        self.num_microbatches = num_microbatches
        self.parallel = parallel
        self.group, self.dp_size, self.dp_rank = data_parallel_group(parallel)
        self._gloo = self.group is not None and dist.get_backend(self.group) == "gloo"
        self.shard_optimizer = self.strategy != "no_shard"
        self.shard_grads = self.strategy in ("optim_grads", "optim_grads_params")
        self.shard_params = self.strategy == "optim_grads_params"

        named, unit_of, self.units = self._collect_units()
        self.named_params = named
        bucket_size = config.ddp_bucket_size or default_bucket_size(self.dp_size, self.overlap_grad_reduce)
        self.buffer = ParamAndGradBuffer(named, bucket_size, self.dp_rank, self.dp_size, self.shard_grads,
                                         self.shard_params, units=unit_of if self.shard_params else None)
        self.buckets = self.buffer.buckets
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._name_of = {id(p): n for n, p in named}
        for unit in self.units:
            ids = {id(p) for p in unit.params}
            unit.buckets = [b for b in self.buckets if any(id(p) in ids for p in b.params)]
        self._unit_of_bucket = {b.index: u for u in self.units for b in u.buckets} if self.shard_params else {}

        self._grad_work: dict[int, object] = {}
        self._param_gather_work: dict[int, object] = {}
        self._gather_work: dict[int, object] = {}
        self._inflight: dict[int, tuple] = {}
        self._retired: list = []             # ZeRO-2/3 temporaries of finished reductions, freed next step
        self._scalar = torch.zeros(1, dtype=torch.float64, device=self.buffer.params[0].device)
        self._reset_step_state()
        self._hooks = []
        if self.shard_grads or (self.dp_size > 1 and self.overlap_grad_reduce):
            self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad_ready) for _, p in named]
        if self.shard_params:
            self._register_zero3_hooks()
        elif self.shard_optimizer and self.overlap_param_gather and self.dp_size > 1:
            for unit in self.units:
                self._hooks.append(unit.module.register_forward_pre_hook(
                    lambda module, args, unit=unit: self._wait_param_gather(unit.buckets)))

    # ---- structure -------------------------------------------------------------------------------
    def _collect_units(self):
        """Named trainable parameters, each one's unit index, and the units in forward order per chunk:
        the chunk itself (root: embedding, final norm, output layer) then each ``decoder.layers[i]``."""
        named, unit_of, units = [], [], []
        for c, model in enumerate(self.models):
            prefix = f"chunk{c}." if len(self.models) > 1 else ""
            root = Unit(model, is_root=True)
            layers = [Unit(layer) for layer in getattr(getattr(model, "decoder", None), "layers", [])]
            chain = [root] + layers
            for a, b in zip(chain, chain[1:]):
                a.next = b
            for a, b in zip(layers, layers[1:]):
                b.prev = a
            owner = {id(p): u for u in layers for p in u.module.parameters()}
            for name, param in model.named_parameters():
                if param.requires_grad:
                    unit = owner.get(id(param), root)
                    unit.params.append(param)
                    named.append((prefix + name, param))
                    unit_of.append(len(units) + chain.index(unit))
            units += chain
        return named, unit_of, units

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_params]

    # ---- per step --------------------------------------------------------------------------------
    def _reset_step_state(self) -> None:
        self._arrivals: dict[int, int] = {}
        self._remaining = {b.index: len(b.params) for b in self.buckets}
        self._grad_work = {}
        self._temp: dict[int, torch.Tensor | None] = {b.index: None for b in self.buckets}
        self._arrived = {b.index: 0 for b in self.buckets}

    def zero_grad(self) -> None:
        self.buffer.zero_grad()
        self._reset_step_state()
        self._retired.clear()

    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: this parameter's gradient of one backward pass is in place."""
        bucket = self._bucket_of[id(param)]
        if self.shard_grads:
            temp = self._temp[bucket.index]
            if temp is None:
                temp = self._temp[bucket.index] = torch.zeros(bucket.numel, dtype=torch.float32,
                                                              device=param.device)
            slot = self.buffer.slots[self._name_of[id(param)]]
            temp[slot.start - bucket.start:slot.end - bucket.start].add_(param.grad.reshape(-1))
            param.grad = None
            self._arrived[bucket.index] += 1
            if self._arrived[bucket.index] == len(bucket.params):
                self._reduce_scatter_bucket(bucket)
            return
        n = self._arrivals[id(param)] = self._arrivals.get(id(param), 0) + 1
        if n == self.num_microbatches:
            self._remaining[bucket.index] -= 1
            if self._remaining[bucket.index] == 0 and self.overlap_grad_reduce:
                self._launch(bucket, async_op=True)
        elif n > self.num_microbatches and bucket.index in self._grad_work:
            raise RuntimeError(
                f"{self._name_of[id(param)]}: gradient number {n} arrived after its bucket's reduction started "
                f"(expected {self.num_microbatches} backward passes per step); call zero_grad() every step")

    def _launch(self, bucket: Bucket, async_op: bool) -> None:
        """Start the reduction of a bucket of the full gradient buffer (no_shard, optim)."""
        flat = self.buffer.bucket_grads(bucket)
        if self.shard_optimizer:
            chunks = self.buffer._cached("grad_chunks", bucket, lambda: list(flat.chunk(self.dp_size)))
            work = self._reduce_scatter(self.buffer.local_grad_chunk(bucket), flat, chunks, async_op)
        else:
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        self._grad_work[bucket.index] = work if async_op else _DONE

    def _reduce_scatter_bucket(self, bucket: Bucket) -> None:
        """ZeRO-2/3: reduce-scatter this micro-batch's gradients of a bucket into the shard."""
        temp, self._temp[bucket.index] = self._temp[bucket.index], None
        self._arrived[bucket.index] = 0
        self._finish_inflight(bucket)
        if self.group is None:
            self.buffer.local_grad_chunk(bucket).add_(temp)
        else:
            out = torch.empty(bucket.numel // self.dp_size, dtype=torch.float32, device=temp.device)
            chunks = list(temp.chunk(self.dp_size))
            work = self._reduce_scatter(out, temp, chunks, self.overlap_grad_reduce)
            self._inflight[bucket.index] = (work or _DONE, out, (temp, chunks))
            if not self.overlap_grad_reduce:
                self._finish_inflight(bucket)
        if self.shard_params:
            self._release([bucket])
            unit = self._unit_of_bucket[bucket.index]
            if not any(self.buffer.is_gathered(b) for b in unit.buckets):
                unit.in_backward = False

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, chunks: list, async_op: bool):
        """Sum ``flat`` over the group, this rank keeping its chunk in ``out``. gloo's list-input
        reduce-scatter is 1.5-2x faster than its single-tensor one on CPU (same bytes on the wire)."""
        if self._gloo:
            return dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        return dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def _finish_inflight(self, bucket: Bucket) -> None:
        entry = self._inflight.pop(bucket.index, None)
        if entry is not None:
            work, out, temp = entry
            work.wait()
            self.buffer.local_grad_chunk(bucket).add_(out)
            self._retired.append((out, temp))

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """After the last backward: complete every bucket's reduction and divide by the DP size.

        Afterwards the gradients the optimizer reads (the whole buffer for no_shard, this rank's
        chunks otherwise) hold the gradient of the mean loss over the global batch."""
        if self.shard_grads:
            for bucket in self.buckets:
                if self._arrived[bucket.index] > 0:          # gradients that never completed a bucket
                    self._reduce_scatter_bucket(bucket)
            for bucket in self.buckets:
                self._finish_inflight(bucket)
            if self.dp_size > 1:
                self.buffer.grad_shard.mul_(1.0 / self.dp_size)
            if self.shard_params:
                self._release(self.buckets)
                for unit in self.units:
                    unit.in_backward = False
        elif self.dp_size > 1:
            for bucket in self.buckets:
                if bucket.index not in self._grad_work:
                    self._launch(bucket, async_op=True)
            for bucket in self.buckets:
                self._grad_work[bucket.index].wait()
            if self.shard_optimizer:
                for bucket in self.buckets:
                    self.buffer.local_grad_chunk(bucket).mul_(1.0 / self.dp_size)
            else:
                self.buffer.grad_data.mul_(1.0 / self.dp_size)
        self._reset_step_state()
        self._grad_work = {b.index: _DONE for b in self.buckets}   # nothing may launch before zero_grad

    # ---- what the model-parallel fix-ups see --------------------------------------------------
    def grad_views(self, param: nn.Parameter) -> list[tuple[torch.Tensor, int]]:
        """After ``finish_grad_sync``: the reduced gradient of ``param`` this rank holds, as (1-D view,
        offset of its first element in the flattened parameter). Empty when none of it is local."""
        name = self._name_of[id(param)]
        slot = self.buffer.slots[name]
        if not self.shard_optimizer:
            return [(self.buffer.grad_data[slot.start:slot.end], 0)]
        bucket = self._bucket_of[id(param)]
        start, end = self.buffer.local_range(bucket)
        lo, hi = max(start, slot.start), min(end, slot.end)
        if lo >= hi:
            return []
        return [(self.buffer.local_grad_chunk(bucket)[lo - start:hi - start], lo - slot.start)]

    @torch.no_grad()
    def all_reduce_param_grads(self, selection: list[tuple[nn.Parameter, tuple | None]], group) -> None:
        """Sum over ``group`` the reduced gradients of the selected parameters, or of a row range
        ``(first_row, end_row)`` of each (model-parallel fix-ups after ``finish_grad_sync``, e.g. the
        sequence-parallel norm weights over TP). Works for every sharding strategy: only the part of
        each gradient this rank holds is reduced; ranks of ``group`` share the buffer layout."""
        if group is None:
            return
        views = []
        for param, rows in selection:
            lo, hi = 0, param.numel()
            if rows is not None:
                row = param.numel() // param.shape[0]
                lo, hi = rows[0] * row, rows[1] * row
            for view, offset in self.grad_views(param):
                a, b = max(lo, offset), min(hi, offset + view.numel())
                if a < b:
                    views.append(view[a - offset:b - offset])
        if not views:
            return
        flat = torch.cat(views)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for view in views:
            view.copy_(flat[offset:offset + view.numel()])
            offset += view.numel()

    def average_over_dp(self, value: float) -> float:
        """The mean of ``value`` over the data-parallel ranks (e.g. the loss for logging)."""
        if self.group is None:
            return value
        t = self._scalar                               # kept alive: see ParamAndGradBuffer._cached
        t.fill_(value)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return float(t) / self.dp_size

    # ---- parameters after the optimizer step (ZeRO-1/2) ------------------------------------------
    def start_param_sync(self) -> None:
        """All-gather the updated chunks of every bucket, asynchronously with --overlap-param-gather
        (each unit's forward pre-hook then waits for its buckets), in the order forward needs them."""
        if not self.shard_optimizer or self.shard_params or self.group is None:
            return
        self.wait_for_param_gather()
        order = []
        for unit in self.units:
            order += [b for b in unit.buckets if b not in order]
        for bucket in order:
            work = dist.all_gather_single(self.buffer.bucket_params(bucket),
                                          self.buffer.local_param_chunk(bucket), group=self.group,
                                          async_op=self.overlap_param_gather)
            if self.overlap_param_gather:
                self._param_gather_work[bucket.index] = work

    def _wait_param_gather(self, buckets) -> None:
        for bucket in buckets:
            work = self._param_gather_work.pop(bucket.index, None)
            if work is not None:
                work.wait()

    def wait_for_param_gather(self) -> None:
        """Complete every pending parameter all-gather (before reading parameters outside forward)."""
        self._wait_param_gather(self.buckets)

    # ---- ZeRO-3: gather parameters per unit ------------------------------------------------------
    def _register_zero3_hooks(self) -> None:
        for unit in self.units:
            if not unit.buckets:
                continue
            self._hooks.append(unit.module.register_forward_pre_hook(
                lambda module, args, unit=unit: self._pre_forward(unit)))
            self._hooks.append(unit.module.register_forward_hook(
                lambda module, args, output, unit=unit: self._post_forward(unit, output)))

    @torch.no_grad()
    def _gather(self, buckets, async_op: bool) -> None:
        for bucket in buckets:
            if self.buffer.is_gathered(bucket):
                continue
            self.buffer.allocate(bucket)
            chunk = self.buffer.local_param_chunk(bucket)
            if self.group is None:
                bucket.unsharded.copy_(chunk)
            else:
                work = dist.all_gather_single(bucket.unsharded, chunk, group=self.group, async_op=async_op)
                if async_op:
                    self._gather_work[bucket.index] = work

    def _ensure_gathered(self, buckets) -> None:
        self._gather(buckets, async_op=False)
        for bucket in buckets:
            work = self._gather_work.pop(bucket.index, None)
            if work is not None:
                work.wait()

    def _release(self, buckets) -> None:
        for bucket in buckets:
            work = self._gather_work.pop(bucket.index, None)
            if work is not None:
                work.wait()
            self.buffer.release(bucket)

    def _pre_forward(self, unit: Unit) -> None:
        self._ensure_gathered(unit.buckets)
        if self.overlap_param_gather and not unit.in_backward and unit.next is not None:
            self._gather(unit.next.buckets, async_op=True)

    def _post_forward(self, unit: Unit, output) -> None:
        if unit.in_backward:             # recomputation during backward: the gradient needs them next
            return
        needs_grad = [t for t in _tensors(output) if t.requires_grad] if torch.is_grad_enabled() else []
        for t in needs_grad:
            t.register_hook(lambda grad, unit=unit: self._pre_backward(unit))
        if not (unit.is_root and needs_grad):
            self._release(unit.buckets)

    def _pre_backward(self, unit: Unit) -> None:
        unit.in_backward = True
        self._ensure_gathered(unit.buckets)
        if self.overlap_param_gather and unit.prev is not None:
            self._gather(unit.prev.buckets, async_op=True)


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []
