"""Data parallelism over the flat bucketed buffer, and the parameter/gradient side of ZeRO.

Every data-parallel rank runs the same model on its slice of the global batch; gradients are summed
over the data-parallel group and divided by its size (SUM then divide: ReduceOp.AVG does not give the
same result on every backend), so every rank ends with the gradient of the mean loss over the global
batch.

Strategies (Megatron's ``--data-parallel-sharding-strategy`` names):

- ``no_shard``: every rank keeps everything. After the last micro-batch each bucket of the fp32
  gradient buffer is all-reduced.
- ``optim`` (ZeRO-1, ``--use-distributed-optimizer``): each bucket of the full gradient buffer is
  reduce-scattered after the last micro-batch; rank r keeps the reduced r-th chunk of each bucket, steps
  only that chunk (optim/distrib_optimizer.py) and the updated chunks are all-gathered.
- ``optim_grads`` (ZeRO-2): no full gradient buffer. A bucket stages one micro-batch's gradients in a
  full-size tensor from its first gradient on; once complete it is reduce-scattered, the reduced chunk
  added into this rank's gradient shard, and the staging freed (``bucket_comm.GradReduction``).
- ``optim_grads_params`` (ZeRO-3): as ZeRO-2, and parameters are sharded too. Buckets follow the
  model's module units (``data_parallel_units``): the embedding, each transformer layer, and the head
  (final norm + output layer). A unit's parameters are all-gathered just before its forward and freed
  after it, gathered again when backward reaches the unit and freed when its backward is done (a hook
  on the unit's input gradient). The
  embedding's backward reads only the token ids, so it is not gathered for backward. With
  ``--overlap-param-gather`` the next unit's gather is prefetched (the previous one's in backward).

Overlap. ``--overlap-grad-reduce``: a post-accumulate-grad hook counts each parameter's gradients; when
every parameter of a bucket has received its last micro-batch's gradient the bucket's collective is
started asynchronously, so communication runs while backward continues through earlier layers.
Without it, the collectives run in ``finish_grad_sync`` after backward. ``--overlap-param-gather``:
the all-gathers of updated parameters (ZeRO-1/2) run asynchronously, every bucket in the order forward
needs them, each waited on in the forward pre-hook of the first unit using it (``ParamGathers``). On
NCCL they are issued at the next forward's first pre-hook and nothing else waits; ZeRO-2/3's last
reduction of a backward pass runs on into the next forward. On gloo they are issued at the optimizer
step, and its temporaries bound the collectives in flight (``MAX_IN_FLIGHT``; ZeRO-2/3 finish at the
end of each backward). ``Comm.holds_temporaries`` decides (bucket_comm.py).

``--fp8-param-gather`` (ZeRO-1/2/3): the weights of FP8 layers sit in buckets of their own, gathered in
FP8 with scales of the whole weight (fp8_gather.py): ZeRO-3 around each use, ZeRO-1/2 by each unit's first
forward after the optimizer step; the layers' GEMMs take those FP8 weights as they are.

``--grad-reduce-in-bf16``: the collectives carry bf16 gradients (half the bytes); accumulation over
micro-batches and the optimizer's gradients stay fp32.

Why a ZeRO-3 of its own beside the FSDP2 backend (fsdp2.py, ``torch.distributed.fsdp.fully_shard``):
FSDP2 replaces every parameter by a DTensor with its own per-parameter padded storage, while here
parameters are views into one flat buffer that the optimizer (fused AdamW over flat shards), clipping,
the bucketed reductions, the memory report and the tensor-/pipeline-parallel gradient fix-ups
(parallel/finalize_grads.py) all work on. Sharding that same buffer per unit keeps one code path and
one numerics for all four strategies (ZeRO-3 equals DP=1 to fp32 rounding) and composes with TP, SP
and interleaved PP as is.

``--use-layer-wise-distributed-optimizer`` (ZeRO-1/2/3): each rank's chunk of a bucket holds whole
parameters instead of an equal slice of the bucket, the chunks of unequal lengths without padding
(grad_buffer.py). Such a bucket's reduce-scatter is one reduce per owner rank (to it) and its all-gather
one broadcast per owner rank (from it), issued in the same order on every rank (bucket_comm.Comm); the
overlap, ZeRO-3 gathering and hybrid sharding above apply unchanged.

Hybrid sharding (``--num-distributed-optimizer-instances`` K, Megatron's distributed-optimizer instances,
PyTorch's HSDP): everything above happens within this rank's instance, a shard group of DP/K consecutive
data-parallel ranks (the buffer's chunks are cut over DP/K, so the optimizer's shard is 1/(DP/K)); after
each bucket's reduce-scatter the reduced chunk is all-reduced over the K ranks holding the same chunk in
the other instances (bucket_comm.ThenAllReduce), so it sums all DP ranks' gradients and is divided by DP
like any other. Parameters are all-gathered within the instance only. Expert weights split their
expert-data-parallel group the same way (parallel/mesh.py).

MoE expert weights: their buckets are reduced, sharded and gathered over the expert-data-parallel group
(``comm_of``), and divided by the data-parallel (x CP) size like the rest: an expert's gradient already
sums every token routed to it from its EP peers, so over EDP it sums all the stage's tokens.

Pipeline parallelism: pass the rank's model chunks as a list (one buffer for all of them, parameter
names prefixed ``chunk{i}.``); the count of backward passes per step is ``num_microbatches`` for every
chunk, whatever the schedule's order.

Bytes moved per step per rank (ring algorithms: an all-reduce moves 2(d-1)/d of the data, a
reduce-scatter or all-gather (d-1)/d), Ψ parameters, d data-parallel ranks:
no_shard all-reduce 2(d-1)/d·4Ψ; optim/optim_grads reduce-scatter (d-1)/d·4Ψ (ZeRO-2: per
micro-batch) + all-gather (d-1)/d·Ψ·bytes(param dtype); ZeRO-3 adds the parameter all-gathers of
forward and backward instead of the one after the step. Hybrid sharding: the same with s = d/K ranks in
place of d, plus the all-reduce of each reduced 4Ψ/s shard over K ranks, 2(K-1)/K·4Ψ/s.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch import nn

from megalite.config.schema import SHARDING_STRATEGIES, ParallelConfig
from megalite.parallel.data.bucket_comm import (DONE, Comm, GradReduction, InFlight, ParamGathers, comm_for,
                                              grad_reduction, shard_comms, traced, wait)
from megalite.parallel.data.fp8_gather import Fp8ParamGather, fp8_gathered_weights
from megalite.parallel.data.grad_buffer import Bucket, ParamAndGradBuffer
from megalite.parallel.data.materialise import LocalElements
from megalite.parallel.data.protocol import DataParallel
from megalite.parallel.data.units import Unit, collect_units, swap_replacements, tensors_in
from megalite.parallel.mesh import ParallelState
from megalite.observe.clocks import waiting

# Full-buffer collectives in flight at once that hold memory until waited on: gloo's (temporaries of the
# bucket's size) and --grad-reduce-in-bf16's bf16 copies. Unbounded, all parameters after the step (or a
# whole backward's gradients) would be copied at once. NCCL's fp32 ones work in place: not bounded.
MAX_IN_FLIGHT = 2
# A ZeRO-2/3 reduce-scatter reads a full-size staging bucket on every backend: one in flight, overlapping
# the backward that fills the next bucket's staging (gloo: and none once the backward pass has ended).
MAX_REDUCTIONS_IN_FLIGHT = 1


def default_bucket_size(dp_size: int, overlap_grad_reduce: bool) -> int | None:
    """Megatron's default: max(40M, 1M x dp) elements with overlap; one bucket without (one big
    collective is the fastest when nothing overlaps it)."""
    return max(40_000_000, 1_000_000 * dp_size) if overlap_grad_reduce else None


def data_parallel_group(parallel: ParallelState):
    """(group, size, rank) of the data-parallel (x context-parallel) group; group None only when no
    process group exists (a plain single process). A size-1 group is used like any other, so a
    single-GPU NCCL run exercises every collective path.

    Context-parallel ranks hold the same parameters and see other parts of the sequences, so like
    Megatron the gradients are reduced over dp x cp."""
    size = parallel.dp_size * parallel.cp_size
    group = parallel.group("dp_cp")
    if group is None:
        return None, 1, 0
    return group, size, dist.get_rank(group)


class DistributedDataParallel(DataParallel):
    """Owns the parameter/gradient buffer of one rank's model (or model chunks) and its reductions.

    Use per step: ``zero_grad()`` -> forward/backward over the micro-batches -> ``finish_grad_sync()``
    -> optimizer step (which calls ``start_param_sync()``). ``close()`` when done (waits for every
    collective still in flight).

    ``device``: where the buffer's storage lives; needed when the models were built on the meta device
    (sharded start-up): their parameters are swapped for ones viewing the buffer (this rank's part only),
    whose values materialise.py fills from ``local_elements()`` (build.py). ``owner_cost``: what the
    whole-parameter layout balances owners by (grad_buffer.py; None: size).
    """

    def __init__(self, model: nn.Module | list[nn.Module], config: ParallelConfig, parallel: ParallelState,
                 num_microbatches: int = 1, device: torch.device | None = None, owner_cost=None):
        self.models = list(model) if isinstance(model, (list, tuple)) else [model]
        self.strategy = config.data_parallel_sharding_strategy      # ParallelConfig folds in the ZeRO-1 flag
        if self.strategy not in SHARDING_STRATEGIES:
            raise ValueError(f"unknown data-parallel sharding strategy {self.strategy!r}")
        self.overlap_grad_reduce = config.overlap_grad_reduce
        self.overlap_param_gather = config.overlap_param_gather
        self.num_microbatches = num_microbatches
        self.parallel = parallel
        self.group, self.dp_size, self.dp_rank = data_parallel_group(parallel)
        if self.strategy == "no_shard" and parallel.instances > 1:
            raise ValueError("distributed-optimizer instances need a sharding strategy other than no_shard")
        reduce_dtype = torch.bfloat16 if config.grad_reduce_in_bf16 else None
        # the dense and MoE expert weights' shard groups; the buffer's chunks are cut over them
        self.comm, self.expert_comm, (shard_rank, shard_size), expert_dp = shard_comms(
            parallel, (self.group, self.dp_size, self.dp_rank), reduce_dtype)
        self.shard_optimizer = self.strategy != "no_shard"
        self.shard_grads = self.strategy in ("optim_grads", "optim_grads_params")
        self.shard_params = self.strategy == "optim_grads_params"

        named, unit_of, self.units = self._collect_units()
        fp8 = fp8_gathered_weights(self.models) if config.fp8_param_gather and self.shard_optimizer else {}
        bucket_size = config.ddp_bucket_size or default_bucket_size(self.dp_size, self.overlap_grad_reduce)
        self.buffer = ParamAndGradBuffer(
            named, bucket_size, shard_rank, shard_size, self.shard_grads, self.shard_params,
            units=unit_of if self.shard_grads else None, device=device,
            staging_dtype=self.comm.reduce_dtype or torch.float32, expert_dp=expert_dp,
            whole_params=config.use_layer_wise_distributed_optimizer and self.shard_optimizer, owner_cost=owner_cost,
            fp8_params=frozenset(fp8))
        named = swap_replacements(self.models, self.units, named, self.buffer.replacements)
        # --fp8-param-gather: the FP8 layers' weights travel in FP8 (fp8_gather.py)
        self._fp8 = Fp8ParamGather(self.buffer, fp8_gathered_weights(self.models)) if fp8 else None
        if config.gradient_accumulation_fusion:
            self.buffer.fuse_weight_grads()
        self.named_params = named
        self.buckets = self.buffer.buckets
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._name_of = {id(p): n for n, p in named}
        for unit in self.units:
            ids = {id(p) for p in unit.params}
            unit.buckets = [b for b in self.buckets if any(id(p) in ids for p in b.params)]

        self._reductions = {b.index: grad_reduction(b, self.buffer.local_grad_chunk(b), self.comm_of(b), bucket_size)
                            for b in self.buckets} if self.shard_grads else {}
        self._in_flight: deque[GradReduction] = deque()
        self._end_of_backward_queued = False
        self._window = InFlight(MAX_IN_FLIGHT)           # other asynchronous bucket collectives
        self._grad_work: dict[int, object] = {}
        self._comm_copies: dict[int, tuple] = {}    # bf16 copies of full-buffer buckets in flight
        self._param_gathers = ParamGathers(self.buffer, (self.comm, self.expert_comm), self.overlap_param_gather,
                                           self._window)
        self._gather_work: dict[int, object] = {}
        self._reset_step_state()
        self._hooks = []
        if self.shard_grads or (self.group is not None and self.overlap_grad_reduce):
            self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad_ready) for _, p in named]
        if self.shard_params:
            self._register_zero3_hooks()
        elif self.shard_optimizer and self.overlap_param_gather and self.group is not None:
            for unit in self.units:
                self._hooks.append(unit.module.register_forward_pre_hook(
                    lambda module, args, unit=unit: self._param_gathers.wait(unit.buckets)))
        if self._fp8 is not None and not self.shard_params:
            for unit in self.units:
                self._hooks.append(unit.module.register_forward_pre_hook(
                    lambda module, args, unit=unit: self._fp8.refresh(unit.buckets, self.comm_of)))

    # ---- structure -------------------------------------------------------------------------------
    @property
    def shard_group(self):
        """The dense weights' shard group (this rank's instance with hybrid sharding)."""
        return self.comm.group

    def comm_of(self, bucket: Bucket) -> Comm:
        """The group a bucket is reduced and gathered over (bucket_comm.comm_for)."""
        return comm_for(bucket, self.comm, self.expert_comm)

    def _collect_units(self):
        """Named trainable parameters, each one's unit index and the units in forward order (units.collect_units)."""
        return collect_units(self.models)

    def local_elements(self) -> list[LocalElements]:
        """This rank's elements of the storage-less parameters, in the buffer (materialise.py fills them)."""
        return self.buffer.local_elements()

    # ---- per step --------------------------------------------------------------------------------
    def _reset_step_state(self) -> None:
        self._arrivals: dict[int, int] = {}
        self._remaining = {b.index: len(b.params) for b in self.buckets}
        self._grad_work = {}

    def zero_grad(self, num_microbatches: int | None = None) -> None:
        self.buffer.zero_grad()
        if num_microbatches is not None:       # a batch-size schedule changes it from step to step
            self.num_microbatches = num_microbatches
        self._reset_step_state()

    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: this parameter's gradient of one backward pass is in place."""
        bucket = self._bucket_of[id(param)]
        if self.shard_grads:
            slot = self.buffer.slots[self._name_of[id(param)]]
            reduction = self._reductions[bucket.index]
            complete = reduction.accumulate(slot.start - bucket.start, param.grad)
            param.grad = None
            if complete:
                self._start_reduction(reduction)
            if self.comm.holds_temporaries:
                self._finish_reductions_when_backward_ends()
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

    def _finish_reductions_when_backward_ends(self) -> None:
        """ZeRO-2/3 on gloo: complete the reductions still in flight once this backward pass ends (as
        FSDP2 does). Otherwise the last bucket's staging, reduced output and gloo temporary (the
        embedding's: the largest) would stay alive through the next micro-batch's forward. NCCL lets
        it overlap that forward; the next backward's first reduction finishes it."""
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        while self._in_flight:
            self._in_flight.popleft().finish()

    def _start_reduction(self, reduction: GradReduction) -> None:
        """ZeRO-2/3: reduce-scatter a complete bucket, first finishing the oldest ones in flight."""
        while len(self._in_flight) >= MAX_REDUCTIONS_IN_FLIGHT:
            self._in_flight.popleft().finish()
        reduction.start(async_op=self.overlap_grad_reduce)
        if reduction.work is not None:
            self._in_flight.append(reduction)

    def _launch(self, bucket: Bucket, async_op: bool) -> None:
        """Start the reduction of a bucket of the full gradient buffer (no_shard, optim)."""
        flat, comm = self.buffer.bucket_grads(bucket), self.comm_of(bucket)
        if comm.reduce_dtype is not None:               # travel in bf16; copied back in _complete
            flat = flat.to(comm.reduce_dtype)
            chunks = bucket.regions(flat)
            out = torch.empty(bucket.chunk_numel, dtype=flat.dtype, device=flat.device) if bucket.even \
                else chunks[bucket.shard_rank]             # unequal chunks are reduced in place
            self._comm_copies[bucket.index] = (flat, out, chunks)      # alive until the collective is done
        else:
            out = self.buffer.local_grad_chunk(bucket)
            chunks = self.buffer.bucket_grad_chunks(bucket)
        with traced(self._reduction_name, bucket):
            if self.shard_optimizer:
                work = comm.reduce_scatter(out, flat, chunks, async_op)
            else:
                work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=comm.group, async_op=async_op)
        self._grad_work[bucket.index] = work if async_op else DONE
        if async_op:
            copied = comm.holds_temporaries or bucket.index in self._comm_copies
            self._window.add(lambda: self._complete(bucket), copied)
        else:
            self._complete(bucket)

    @property
    def _reduction_name(self) -> str:
        return "reduce-scatter" if self.shard_optimizer else "all-reduce"

    def _complete(self, bucket: Bucket) -> None:
        """Wait for a full-buffer bucket's reduction; with bf16 reduction copy the result back."""
        work = self._grad_work.get(bucket.index)
        if work is None:
            return
        if work is not DONE:
            wait(work, self._reduction_name, bucket)
        self._grad_work[bucket.index] = DONE
        copies = self._comm_copies.pop(bucket.index, None)
        if copies is None:
            return
        flat, out, _ = copies
        if self.shard_optimizer:
            self.buffer.local_grad_chunk(bucket).copy_(out)
        else:
            self.buffer.bucket_grads(bucket).copy_(flat)

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """After the last backward: complete every bucket's reduction and divide by the DP size.

        Afterwards the gradients the optimizer reads (the whole buffer for no_shard, this rank's
        chunks otherwise) hold the gradient of the mean loss over the global batch."""
        self._param_gathers.wait(self.buckets)       # none may write the parameters the optimizer updates
        if self.shard_grads:
            for reduction in self._reductions.values():
                if reduction.pending:                 # gradients that never completed a bucket
                    self._start_reduction(reduction)
            while self._in_flight:
                self._in_flight.popleft().finish()
            if self.dp_size > 1:
                self.buffer.grad_shard.mul_(1.0 / self.dp_size)
            if self.shard_params:
                self._release(self.buckets)           # anything a backward left gathered
                for unit in self.units:
                    unit.in_backward = False
        elif self.group is not None:
            for bucket in self.buckets:
                if bucket.index not in self._grad_work:
                    self._launch(bucket, async_op=True)
            for bucket in self.buckets:
                self._complete(bucket)
            self._window.clear()
            if self.dp_size > 1 and self.shard_optimizer:
                for bucket in self.buckets:
                    self.buffer.local_grad_chunk(bucket).mul_(1.0 / self.dp_size)
            elif self.dp_size > 1:
                self.buffer.grad_data.mul_(1.0 / self.dp_size)
        self._reset_step_state()
        self._grad_work = {b.index: DONE for b in self.buckets}   # nothing may launch before zero_grad

    def close(self) -> None:
        """Wait for every collective still in flight and remove the hooks (end of training)."""
        while self._in_flight:
            self._in_flight.popleft().finish()
        self.wait_for_param_gather()
        if self.shard_params:
            self._release(self.buckets)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.buffer.remove_hooks()

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

    # ---- parameters after the optimizer step (ZeRO-1/2) ------------------------------------------
    def start_param_sync(self) -> None:
        """All-gather the updated chunks of every bucket in the order forward needs them; with
        --overlap-param-gather each unit's forward pre-hook waits for its buckets (ParamGathers)."""
        if not self.shard_optimizer or self.shard_params or self.group is None:
            return
        self.wait_for_param_gather()
        order = []
        for unit in self.units:
            order += [b for b in unit.buckets if b not in order]
        if self._fp8 is not None:            # gathered in FP8 by the next forward that uses them
            self._fp8.mark_stale()
        self._param_gathers.start([b for b in order + [b for b in self.buckets if b not in order] if not b.fp8])

    def wait_for_param_gather(self) -> None:
        """Complete every pending parameter all-gather (before reading parameters outside forward)."""
        self._param_gathers.wait(self.buckets)
        self._window.clear()

    # ---- ZeRO-3: gather parameters per unit ------------------------------------------------------
    def _register_zero3_hooks(self) -> None:
        for unit in self.units:
            if not unit.buckets:
                continue
            self._hooks.append(unit.module.register_forward_pre_hook(
                lambda module, args, unit=unit: self._pre_forward(unit, args)))
            self._hooks.append(unit.end_module.register_forward_hook(
                lambda module, args, output, unit=unit: self._post_forward(unit, output)))

    def _is_gathered(self, bucket: Bucket) -> bool:
        return self._fp8.is_gathered(bucket) if bucket.fp8 else self.buffer.is_gathered(bucket)

    @torch.no_grad()
    def _gather(self, buckets, async_op: bool) -> None:
        for bucket in buckets:
            if self._is_gathered(bucket):
                continue
            if bucket.fp8:
                self._fp8.gather(bucket, self.comm_of(bucket), async_op)
                continue
            self.buffer.allocate(bucket)
            chunk = self.buffer.local_param_chunk(bucket)
            if self.group is None:
                bucket.unsharded.tensor.copy_(chunk)
                continue
            with traced("param all-gather", bucket):
                work = self.comm_of(bucket).all_gather(bucket.unsharded.tensor, self.buffer.bucket_param_chunks(bucket),
                                                       chunk, async_op=async_op)
            if async_op:
                self._gather_work[bucket.index] = work

    def _ensure_gathered(self, buckets) -> None:
        with waiting():
            self._gather(buckets, async_op=False)
            for bucket in buckets:
                if bucket.fp8:
                    self._fp8.wait(bucket)
                work = self._gather_work.pop(bucket.index, None)
                if work is not None:
                    wait(work, "param all-gather", bucket)

    def _release(self, buckets) -> None:
        for bucket in buckets:
            if bucket.fp8:
                self._fp8.release(bucket)
                continue
            work = self._gather_work.pop(bucket.index, None)
            if work is not None:
                wait(work, "param all-gather", bucket)
            self.buffer.release(bucket)

    def _pre_forward(self, unit: Unit, args) -> None:
        self._ensure_gathered(unit.buckets)
        if self.overlap_param_gather and not unit.in_backward and unit.next is not None:
            self._gather(unit.next.buckets, async_op=True)
        if torch.is_grad_enabled() and not unit.in_backward and unit.gather_in_backward:
            # the gradient of the unit's input is computed last in its backward: then it is done
            for t in tensors_in(args):
                if t.requires_grad:
                    t.register_hook(lambda grad, unit=unit: self._post_backward(unit))
                    break

    def _post_forward(self, unit: Unit, output) -> None:
        if unit.in_backward:             # recomputation during backward: the gradient needs them next
            return
        if torch.is_grad_enabled() and unit.gather_in_backward:
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, unit=unit: self._pre_backward(unit))
        self._release(unit.buckets)

    def _pre_backward(self, unit: Unit) -> None:
        unit.in_backward = True
        self._ensure_gathered(unit.buckets)
        if self.overlap_param_gather and unit.prev is not None and unit.prev.gather_in_backward:
            self._gather(unit.prev.buckets, async_op=True)

    def _post_backward(self, unit: Unit) -> None:
        unit.in_backward = False
        self._release(unit.buckets)
