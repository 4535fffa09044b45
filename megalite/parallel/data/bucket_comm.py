"""The data-parallel bucket collectives: how a bucket is reduced and gathered over the data-parallel group.

``Comm`` calls the collectives (gloo: list forms in bounded slices, ``GlooSlices``; NCCL: single-tensor
forms). With hybrid sharding (``--num-distributed-optimizer-instances`` K > 1) a Comm's group is this rank's
instance (the shard group of DP/K ranks) and ``replica`` the K ranks holding the same shard in the other
instances: a gradient reduction is the reduce-scatter within the instance followed by the all-reduce of
the reduced shard across the replicas (``ThenAllReduce``), which sums over all DP ranks; parameters are
gathered within the instance only. ``GradReduction`` carries one ZeRO-2/3 bucket's gradients of one
micro-batch from the first gradient to this rank's gradient shard.

``Comm.holds_temporaries`` is where the backend decides how long ddp.py may leave a collective in
flight. gloo copies each bucket collective through temporaries that live until it is waited on, so
ddp bounds the ones in flight (``MAX_IN_FLIGHT``) and finishes ZeRO-2/3's reductions at the end of
every backward pass. NCCL reduces and gathers in the tensors it is given (so does torch's fake backend
of the dry run, which stands for a GPU run): there nothing bounds them, and ``ParamGathers`` waits on
a parameter all-gather only where forward first needs its bucket. The NCCL-semantics tier's switch
(MEGALITE_FORCE_NCCL_COLLECTIVE_PATH=1) turns these choices to NCCL's on gloo. ``traced`` names each
issue and wait in a torch.profiler trace.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch.profiler import record_function

from megalite.parallel import collectives
from megalite.parallel.data.grad_buffer import Bucket
from megalite.observe.clocks import waiting


class _Done:
    def wait(self) -> None:
        pass


DONE = _Done()         # a finished collective's stand-in


def traced(what: str, bucket: Bucket):
    """A torch.profiler range named after one bucket's collective ("param all-gather bucket 3")."""
    return record_function(f"{what} bucket {bucket.index}")


def wait(work, what: str, bucket: Bucket) -> None:
    """Wait for one bucket's collective: straggler time (``waiting``), a "wait ..." range in a profile."""
    with waiting(), traced("wait " + what, bucket):
        work.wait()


class Comm:
    """The data-parallel group and how its collectives are called. ``reduce_dtype``: the dtype gradients
    travel in (None: as they are, fp32). On gloo the bucket collectives take the list forms in slices,
    unless MEGALITE_FORCE_NCCL_COLLECTIVE_PATH=1 (collectives.bucket_list_form); otherwise the
    single-tensor forms, as on NCCL."""

    def __init__(self, group, size: int, reduce_dtype: torch.dtype | None, replica=None):
        self.group, self.size, self.reduce_dtype = group, size, reduce_dtype
        self.replica = replica             # hybrid sharding: the group the reduced shard is all-reduced over
        self.list_form = collectives.bucket_list_form(group)

    @property
    def holds_temporaries(self) -> bool:
        """Whether an asynchronous collective holds temporaries until it is waited on: gloo's (the
        list forms' branch, collectives.bucket_list_form), not NCCL's (module docstring)."""
        return self.list_form

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, chunks: list, async_op: bool):
        """Sum ``flat`` (cut into the ranks' ``chunks``) over the group, this rank keeping its chunk in
        ``out`` (and, with a replica group, then sum ``out`` over it). Equal chunks: a reduce-scatter
        (gloo: list input, faster than its single-tensor form on CPU, same bytes on the wire, in slices,
        see GlooSlices). Unequal chunks: one reduce per non-empty chunk to its owner, in rank order on
        every rank, in place; ``out`` is then this rank's chunk itself."""
        if not _equal(chunks):
            if out.data_ptr() != chunks[self.rank].data_ptr():
                raise ValueError("an uneven reduction lands in place: pass this rank's chunk as out")
            work = AllOf([dist.reduce(c, group_dst=r, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                          for r, c in enumerate(chunks) if c.numel()], async_op)
        elif self.list_form:
            work = GlooSlices(out.numel(), lambda lo, hi: dist.reduce_scatter(
                out[lo:hi], [c[lo:hi] for c in chunks], op=dist.ReduceOp.SUM, group=self.group, async_op=True),
                async_op)
        else:
            work = collectives.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=self.group,
                                                     async_op=async_op)
        if self.replica is None:
            return work
        return ThenAllReduce(work, out, self.replica, async_op)

    def all_gather(self, out: torch.Tensor, chunks: list, local: torch.Tensor, async_op: bool):
        """Every rank's ``local`` into its chunk of ``out`` (``chunks``: out cut into the ranks' chunks).
        Equal chunks: an all-gather; unequal: one broadcast per non-empty chunk from its owner, in rank
        order on every rank (``local`` first copied into this rank's chunk where it is not that chunk)."""
        if not _equal(chunks):
            mine = chunks[self.rank]
            if mine.numel() and mine.data_ptr() != local.data_ptr():
                mine.copy_(local)
            return AllOf([dist.broadcast(c, group_src=r, group=self.group, async_op=True)
                          for r, c in enumerate(chunks) if c.numel()], async_op)
        if self.list_form:
            return GlooSlices(local.numel(), lambda lo, hi: dist.all_gather(
                [c[lo:hi] for c in chunks], local[lo:hi], group=self.group, async_op=True), async_op)
        return collectives.all_gather_single(out, local, group=self.group, async_op=async_op)


def _equal(chunks: list) -> bool:
    return len({c.numel() for c in chunks}) == 1


class AllOf:
    """Several collectives completed as one (``wait`` waits for each, in issue order)."""

    def __init__(self, works: list, async_op: bool):
        self._works = works
        if not async_op:
            self.wait()

    def wait(self) -> None:
        while self._works:
            self._works.pop(0).wait()


def shard_comms(parallel, dp: tuple, reduce_dtype) -> tuple[Comm, Comm, tuple, tuple | None]:
    """(dense Comm, expert Comm, (rank, size) of the dense shard group, of the expert one or None) for the
    data-parallel group ``dp`` = (group, size, rank): with hybrid sharding the instance's shard groups
    and their replica groups (module docstring), else the whole data-parallel and expert-data-parallel
    groups."""
    group, size, rank = dp
    hybrid = group is not None and parallel.instances > 1
    if hybrid:
        shard = (rank % (size // parallel.instances), size // parallel.instances)
        comm = Comm(parallel.group("dp_cp_shard"), shard[1], reduce_dtype, parallel.group("dp_cp_replica"))
    else:
        shard, comm = (rank, size), Comm(group, size, reduce_dtype)
    if parallel.group("edp") is None:
        return comm, comm, shard, None
    if hybrid:
        expert = (parallel.edp_shard_rank, parallel.edp_shard_size)
        return comm, Comm(parallel.group("edp_shard"), expert[1], reduce_dtype, parallel.group("edp_replica")), \
            shard, expert
    return comm, Comm(parallel.group("edp"), parallel.edp_size, reduce_dtype), shard, (parallel.edp_rank,
                                                                                      parallel.edp_size)


GLOO_SLICE = 1 << 21          # elements per rank's chunk in one gloo collective


class GlooSlices:
    """A gloo collective over a large bucket, run as consecutive slices of at most GLOO_SLICE elements
    per rank's chunk. gloo copies each collective through a temporary the size of its whole input or
    output and frees it only with the Work object; sliced, that temporary stays bounded. The first slice
    starts at once (asynchronously); ``wait()`` runs the rest one after another."""

    def __init__(self, numel: int, start_slice, async_op: bool):
        self._slices = [(lo, min(numel, lo + GLOO_SLICE)) for lo in range(0, max(numel, 1), GLOO_SLICE)]
        self._start = start_slice
        self._work = self._start(*self._slices.pop(0))
        if not async_op:
            self.wait()

    def wait(self) -> None:
        while self._work is not None:
            self._work.wait()
            self._work = self._start(*self._slices.pop(0)) if self._slices else None


def comm_for(bucket: Bucket, dense: Comm, expert: Comm) -> Comm:
    """The group a bucket is reduced and gathered over: expert-data-parallel for expert weights."""
    return expert if bucket.expert else dense


class InFlight:
    """Asynchronous bucket collectives that hold memory until they are waited on (gloo's temporaries,
    --grad-reduce-in-bf16's copies), each by the call that completes it, oldest first: at most
    ``limit`` stay in flight. It holds no reference to its owner, so the data-parallel wrapper is freed
    as soon as it is dropped (with its process-group handles, before the groups are destroyed)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._pending: deque = deque()

    def add(self, complete, holds_memory: bool) -> None:
        """Track a collective by ``complete``; complete the oldest ones beyond ``limit``."""
        if not holds_memory:
            return
        self._pending.append(complete)
        while len(self._pending) > self.limit:
            self._pending.popleft()()

    def clear(self) -> None:
        self._pending.clear()


class ParamGathers:
    """ZeRO-1/2: the all-gathers of the updated parameters after the optimizer step, bucket by bucket in
    the order forward needs them (``start``); ``wait`` completes some (the units' forward pre-hooks
    call it with theirs). Synchronous without ``overlap`` (--overlap-param-gather). With it, on gloo
    they are issued at the step and ``limit`` bounds those in flight (their temporaries). On NCCL they
    are issued at the first ``wait`` (the next forward's first pre-hook), so that what the step posts
    on the group after the optimizer (the loss average) does not queue behind them, and all at once:
    they write in place, and each has the forward up to its first user to run in. Each is waited on in
    the forward pre-hook of the first unit that uses its bucket, as with Megatron's
    --overlap-param-gather (which issues them one bucket ahead of the forward)."""

    def __init__(self, buffer, comms: tuple[Comm, Comm], overlap: bool, window: InFlight):
        self.buffer, self.comms, self.overlap, self.window = buffer, comms, overlap, window
        self.work: dict[int, object] = {}        # bucket index -> its gather in flight
        self.due: list[Bucket] = []              # NCCL: issued at the next wait

    def start(self, order: list[Bucket]) -> None:
        if self.overlap and not any(comm_for(b, *self.comms).holds_temporaries for b in order):
            self.due = order
        else:
            self._issue(order)

    def _issue(self, order: list[Bucket]) -> None:
        for bucket in order:
            comm = comm_for(bucket, *self.comms)
            with traced("param all-gather", bucket):
                work = comm.all_gather(self.buffer.bucket_params(bucket), self.buffer.bucket_param_chunks(bucket),
                                       self.buffer.local_param_chunk(bucket), async_op=self.overlap)
            if self.overlap:
                self.work[bucket.index] = work
                self.window.add(lambda bucket=bucket: self.wait([bucket]), comm.holds_temporaries)

    def wait(self, buckets: list[Bucket]) -> None:
        due, self.due = self.due, []
        self._issue(due)
        for bucket in buckets:
            work = self.work.pop(bucket.index, None)
            if work is not None:
                wait(work, "param all-gather", bucket)


class ThenAllReduce:
    """A reduce-scatter within the instance, then the all-reduce (SUM) of its output across the replica
    group. The all-reduce is posted once the reduce-scatter has completed (``wait``, or at once when
    synchronous), so every rank posts the two on their groups in the same order; its input is complete
    then on every backend without stream synchronisation."""

    def __init__(self, first, out: torch.Tensor, replica, async_op: bool):
        self._first, self._out, self._replica = first, out, replica
        self._done = False
        if not async_op:
            self.wait()

    def wait(self) -> None:
        if self._done:
            return
        if self._first is not None:
            self._first.wait()
        self._first = None
        if self._out.numel():            # an empty chunk is empty on every replica (they share a layout)
            dist.all_reduce(self._out, op=dist.ReduceOp.SUM, group=self._replica)
        self._done = True


class GradReduction:
    """ZeRO-2/3: one bucket's gradients of one micro-batch, from the first gradient to the shard.

    accumulate (allocates the full-size staging) -> start (reduce-scatter, asynchronous with overlap;
    unequal chunks: reduced in place in the staging) -> finish (wait, add the reduced chunk into this
    rank's gradient shard, free staging and output).
    A bucket's next micro-batch reuses the staging only after its previous reduction finished, and
    every reduction of a backward pass is finished when that pass ends, so no staging outlives it."""

    def __init__(self, bucket: Bucket, shard_chunk: torch.Tensor, comm: Comm):
        self.bucket, self.shard_chunk, self.comm = bucket, shard_chunk, comm
        self.arrived = 0
        self.work = self.out = None

    def accumulate(self, offset: int, grad: torch.Tensor) -> bool:
        """Add one parameter's gradient; True when every parameter of the bucket has arrived."""
        if self.work is not None:
            self.finish()
        staging = self.bucket.staging.allocate(zero=True)
        staging[offset:offset + grad.numel()].add_(grad.reshape(-1))
        self.arrived += 1
        return self.arrived == len(self.bucket.params)

    def start(self, async_op: bool) -> None:
        self.arrived = 0
        if self.comm.group is None:                 # a single process: nothing to reduce
            self.shard_chunk.add_(self.bucket.staging.tensor)
            self.bucket.staging.free()
            return
        reduced = self.bucket.reduced
        self.out = reduced.allocate() if reduced is not None else self.bucket.staging_chunks[self.bucket.shard_rank]
        with traced("reduce-scatter", self.bucket):
            self.work = self.comm.reduce_scatter(self.out, self.bucket.staging.tensor, self.bucket.staging_chunks,
                                                 async_op) or DONE
        if not async_op:
            self.finish()

    def finish(self) -> None:
        if self.work is None:
            return
        wait(self.work, "reduce-scatter", self.bucket)
        self.work = None
        self.shard_chunk.add_(self.out)
        self.out = None
        self.bucket.staging.free()
        if self.bucket.reduced is not None:
            self.bucket.reduced.free()

    @property
    def pending(self) -> bool:
        return self.arrived > 0


class PiecewiseReduction(GradReduction):
    """ZeRO-2/3: a bucket holding one parameter larger than the bucket size (a bucket never splits a
    parameter, so only the bucket size bounds the others), reduce-scattered in pieces of at most ``piece``
    elements of every rank's chunk: piece j stages, in the staging dtype, the j-th piece of each rank's
    chunk (``reduce_scatter(out[j], [chunk_i[j] for i in ranks])``), so each element gets the same sums
    as the whole bucket's reduce-scatter and the staging is bounded by the bucket size, not the largest
    parameter. The gradient is held from its arrival to ``start``; each piece is waited on before the
    next is staged, the last one as the whole bucket's is (``finish``). Every rank issues the same
    collectives in the same order."""

    def __init__(self, bucket: Bucket, shard_chunk: torch.Tensor, comm: Comm, piece: int):
        super().__init__(bucket, shard_chunk, comm)
        self.piece = piece
        self.grad, self.offset = None, 0
        self._in_flight = None        # (staging, out, first element of the piece in this rank's chunk)
        self.staged_peak = 0          # the most staging elements alive at once (tests read it)

    def accumulate(self, offset: int, grad: torch.Tensor) -> bool:
        if self.work is not None:
            self.finish()
        self.offset, self.grad = offset, grad.reshape(-1)
        self.arrived = 1
        return True

    def start(self, async_op: bool) -> None:
        self.arrived = 0
        grad, self.grad = self.grad, None
        n = self.bucket.chunk_numel
        for lo in range(0, n, self.piece):
            self.finish()
            staging = self._stage(grad, lo, min(n, lo + self.piece))
            out = torch.empty(staging.shape[1], dtype=staging.dtype, device=staging.device)
            with traced("reduce-scatter", self.bucket):
                self.work = self.comm.reduce_scatter(out, staging.view(-1), list(staging), async_op) or DONE
            self._in_flight = (staging, out, lo)
        if not async_op:
            self.finish()

    def _stage(self, grad: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of every rank's chunk of the bucket's gradients, one row per rank: the
        parameter's gradient where it lies (at ``offset`` in the bucket), zeros elsewhere (padding)."""
        n, end = self.bucket.chunk_numel, self.offset + grad.numel()
        staging = torch.zeros(self.bucket.shard_size, hi - lo, dtype=self.bucket.staging.tensor.dtype,
                              device=grad.device)
        for rank, row in enumerate(staging):
            first, last = max(rank * n + lo, self.offset), min(rank * n + hi, end)
            if first < last:
                row[first - rank * n - lo:last - rank * n - lo].add_(grad[first - self.offset:last - self.offset])
        self.staged_peak = max(self.staged_peak, staging.numel())
        return staging

    def finish(self) -> None:
        if self.work is None:
            return
        wait(self.work, "reduce-scatter", self.bucket)
        (staging, out, lo), self.work, self._in_flight = self._in_flight, None, None
        self.shard_chunk[lo:lo + out.numel()].add_(out)


def grad_reduction(bucket: Bucket, shard_chunk: torch.Tensor, comm: Comm, bucket_size: int | None) -> GradReduction:
    """The reduction of one ZeRO-2/3 bucket: in pieces (``PiecewiseReduction``) when it holds a single
    parameter whose chunk per rank exceeds ``bucket_size`` / the group's size and every rank's chunk has
    the same length (reduce-scatter applies; a whole-parameter bucket's owner reduces it whole), else whole."""
    piece = bucket_size // bucket.shard_size if bucket_size else 0
    if comm.group is not None and bucket.even and len(bucket.params) == 1 and 0 < piece < bucket.chunk_numel:
        return PiecewiseReduction(bucket, shard_chunk, comm, piece)
    return GradReduction(bucket, shard_chunk, comm)

