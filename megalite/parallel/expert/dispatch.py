"""Token dispatch for expert parallelism: carrying each routed token to the rank that holds its expert and
its output back, with autograd through every exchange.

A rank holds its own tokens (its sequence shard under sequence/context parallelism, its micro-batch under
data parallelism) and E / EP whole experts, each split over ETP ranks along its hidden dimension
(parallel/mesh.py's expert grid). Two dispatchers (Megatron's ``--moe-token-dispatcher-type``):

- ``alltoall``: the (token, expert) assignments are sorted by expert; an all-to-all over the EP group
  sends each EP rank the rows for its experts (a count exchange first: the split sizes); with ETP > 1 the
  received rows are gathered over the ETP group, the experts' partial outputs summed back over it
  (reduce-scatter), and a second all-to-all returns the rows. Bytes per rank: 2 x T x k x h each way.
- ``allgather``: every rank of the EP x ETP group gathers all of the group's tokens, computes its local
  experts (partially, under ETP) on the tokens routed to them, and a reduce-scatter sums the partial
  outputs back onto each token's own rank. Bytes per rank: (g - 1) x T x h each way for a group of g;
  no count exchange.

Every exchange is one collective that all ranks of its group issue in the same order, so it runs
unchanged under NCCL (no point-to-point pairing to get wrong). Variable-size exchanges use
``all_to_all_single`` with split sizes, which needs the sizes on the host: that one count exchange per
layer is the only host synchronisation dispatch adds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function

from megalite.parallel.dry_run import REAL_RUN, RealRun
from megalite.parallel.tensor.mappings import gather_from_sp_region, reduce_scatter_to_sp_region


@dataclass
class ExpertParallel:
    """This rank's place in the expert grid: EP (which whole experts it holds) and ETP (which part of each
    expert's hidden dimension). ``ep_etp_group``: the EP x ETP ranks that share one layer's experts
    (the allgather dispatcher's group); groups are None at size 1."""
    ep_group: object = None
    ep_rank: int = 0
    ep_size: int = 1
    etp_group: object = None
    etp_rank: int = 0
    etp_size: int = 1
    ep_etp_group: object = None
    dispatcher: str = "alltoall"
    run: RealRun = REAL_RUN      # the run backend: the count exchanges' results (parallel/dry_run.py)
    # the micro-batch of each rank of the EP x ETP group, in the group's rank order (ETP fastest): ranks
    # with the same one hold parts of one micro-batch (TP x CP ranks), others other micro-batches (DP ranks)
    source_microbatch: tuple = (0,)

    def local_experts(self, num_experts: int) -> range:
        per_rank = num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)


@dataclass
class MoEContext:
    """What a model's MoE layers (model/moe.py) share: the expert grid ``ep``; the group over which one
    sequence's tokens are split (``sequence_group``: TP x CP, None when unsplit; ``sequence_split``: its
    size); the group of every token of the pipeline stage (``stage_group``: TP x CP x DP, for the
    per-step load counts); the CP size (each CP rank's loss share is scaled by it, as
    parallel/context/ring_attention.py's context_parallel_loss does); and this step's gradient scale of
    the auxiliary losses (``start_step``)."""
    ep: ExpertParallel
    sequence_group: object = None
    sequence_split: int = 1
    stage_group: object = None
    cp_size: int = 1
    grad_scale: float = 1.0

    def start_step(self, loss_scale: float, num_microbatches: int) -> None:
        """A training step of ``num_microbatches`` backward passes at ``loss_scale`` follows: the auxiliary
        losses backpropagate with the main loss's scale, loss scale / micro-batches."""
        self.grad_scale = loss_scale / num_microbatches


def build_moe_context(state, dispatcher: str, sequence_parallel: bool) -> MoEContext:
    """From a ParallelState (parallel/mesh.py) built with its expert groups."""
    def group(name: str, size: int):
        return state.group(name) if size > 1 else None
    size, first = state.ep_size * state.etp_size, state.edp_rank * state.ep_size * state.etp_size
    sources = tuple((first + i) // (state.tp_size * state.cp_size) for i in range(size))
    ep = ExpertParallel(group("ep", state.ep_size), state.ep_rank, state.ep_size,
                        group("etp", state.etp_size), state.etp_rank, state.etp_size,
                        group("ep_etp", size), dispatcher, state.run, sources)
    split = (state.tp_size if sequence_parallel else 1) * state.cp_size
    stage = state.tp_size * state.cp_size * state.dp_size
    return MoEContext(ep, group("tp_cp", split), split, group("stage", stage), state.cp_size)


# ---- autograd collectives -------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """Rows [sum(send), h] -> [sum(recv), h]: send[j] rows to rank j, recv[j] rows from it; backward
    sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, x, send: list, recv: list, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, send: list, recv: list, group) -> torch.Tensor:
    return x if group is None else _AllToAll.apply(x, send, recv, group)


def gather_rows(x: torch.Tensor, sizes: list, group) -> torch.Tensor:
    """Every rank's rows (rank j has sizes[j]), concatenated in rank order; backward sums each rank's
    gradient rows over the group and keeps this rank's (a reduce-scatter of variable sizes)."""
    if group is None:
        return x
    n = x.shape[0]
    return _AllToAll.apply(x.repeat(len(sizes), *([1] * (x.dim() - 1))), [n] * len(sizes), sizes, group) \
        if len(set(sizes)) > 1 else gather_from_sp_region(x, group)


def scatter_rows(y: torch.Tensor, sizes: list, rank: int, group) -> torch.Tensor:
    """The reverse of gather_rows: this rank's rows summed over the group's partial copies of them."""
    if group is None:
        return y
    if len(set(sizes)) == 1:
        return reduce_scatter_to_sp_region(y, group)
    received = _AllToAll.apply(y, sizes, [sizes[rank]] * len(sizes), group)
    return received.view(len(sizes), sizes[rank], *y.shape[1:]).sum(0)


def expert_counts(expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert [num_experts] of ``expert`` (expert ids). Without storage (the meta device)
    the router's choices have no values: a balanced router's counts stand in, on the host."""
    if expert.device.type == "meta":
        base, extra = divmod(expert.numel(), num_experts)
        return torch.tensor([base + (e < extra) for e in range(num_experts)])
    return torch.bincount(expert, minlength=num_experts)


# ---- the two dispatchers ------------------------------------------------------------------------------
@dataclass
class Routed:
    """One rank's routed tokens: ``tokens`` [T, h], and per (token, slot) assignment its expert
    ``experts`` [T, k] (global ids) and weight ``weights`` [T, k]; ``keep`` [T, k] False for assignments
    dropped by capacity."""
    tokens: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor | None = None


def _sorted_assignments(routed: Routed):
    """Kept (token, slot) assignments sorted by expert (stable: in token order within an expert):
    (token index per row, expert per row, weight per row)."""
    experts, weights = routed.experts.reshape(-1), routed.weights.reshape(-1)
    token = torch.arange(routed.tokens.shape[0], device=experts.device).repeat_interleave(routed.experts.shape[1])
    if routed.keep is not None and experts.device.type != "meta":   # (meta: a balanced router drops nothing)
        keep = routed.keep.reshape(-1)
        experts, weights, token = experts[keep], weights[keep], token[keep]
    order = torch.argsort(experts, stable=True)
    return token[order], experts[order], weights[order]


def microbatch_segments(counts: list, source_microbatch: tuple) -> list:
    """``counts`` [E_local][sources]: each local expert's rows from each source rank of the EP x ETP group
    (its rank order) -> per local expert its rows' sizes per micro-batch, sources of one micro-batch
    (consecutive in the group) merged."""
    segments = []
    for per_source in counts:
        sizes = [per_source[0]]
        for source in range(1, len(per_source)):
            if source_microbatch[source] == source_microbatch[source - 1]:
                sizes[-1] += per_source[source]
            else:
                sizes.append(per_source[source])
        segments.append(sizes)
    return segments


def dispatch_alltoall(routed: Routed, run_experts, num_experts: int, ep: ExpertParallel,
                      by_source: bool = False) -> torch.Tensor:
    """``run_experts(rows [N, h], counts [E_local] on the host, segments) -> partial outputs [N, h]`` over
    this rank's experts, rows grouped by local expert. ``by_source``: within an expert the rows come in the
    EP x ETP group's rank order, and ``segments`` (microbatch_segments) gives each micro-batch's share of
    them (FP8 scales each micro-batch's rows as the single process does); else None. Returns the MoE
    output [T, h]: per token the weighted sum of its experts' outputs."""
    token, expert, weight = _sorted_assignments(routed)
    rows = routed.tokens.index_select(0, token)          # its backward is an index_add
    per_expert = expert_counts(expert, num_experts)
    if ep.ep_group is None and ep.etp_group is None:     # every expert here, whole: rows are in expert order
        with record_function("moe/experts"):
            out = run_experts(rows, per_expert.tolist(), None)
        return combine(out, token, weight, routed.tokens.shape[0])
    local = num_experts // ep.ep_size
    with record_function("moe/dispatch/counts"):
        recv_counts = ep.run.exchange_counts(per_expert.view(ep.ep_size, local), ep.ep_group,
                                             ep.ep_rank)                                     # [src, local]
        etp_counts = ep.run.gather_counts(recv_counts.reshape(-1), ep.etp_group).view(ep.etp_size, ep.ep_size,
                                                                                      local)
        # the one host read: the split sizes of the exchanges below (what arrives, then what this rank sends)
        host = torch.cat([etp_counts.reshape(-1), per_expert.view(ep.ep_size, local).sum(1)]).tolist()
    send = host[-ep.ep_size:]
    host = [[host[(t * ep.ep_size + s) * local:(t * ep.ep_size + s + 1) * local] for s in range(ep.ep_size)]
            for t in range(ep.etp_size)]
    recv = [sum(c) for c in host[ep.etp_rank]]
    sizes = [sum(sum(c) for c in block) for block in host]
    with record_function("moe/dispatch/exchange"):
        received = all_to_all(rows, send, recv, ep.ep_group)                  # ordered (source, local expert)
        gathered = gather_rows(received, sizes, ep.etp_group)                 # ordered (etp, source, expert)
    row_expert = torch.repeat_interleave(torch.arange(local, device=rows.device).repeat(ep.etp_size * ep.ep_size),
                                         etp_counts.reshape(-1).to(rows.device), output_size=gathered.shape[0])
    segments = None
    if by_source:        # within an expert, the sources in the group's rank order (ETP fastest)
        group = ep.etp_size * ep.ep_size
        position = torch.arange(ep.etp_size)[:, None, None] + ep.etp_size * torch.arange(ep.ep_size)[None, :, None]
        row_expert = row_expert * group + torch.repeat_interleave(
            position.expand(-1, -1, local).reshape(-1).to(rows.device), etp_counts.reshape(-1).to(rows.device),
            output_size=gathered.shape[0])
        segments = microbatch_segments([[host[p % ep.etp_size][p // ep.etp_size][e] for p in range(group)]
                                        for e in range(local)], ep.source_microbatch)
    order = torch.argsort(row_expert, stable=True)
    counts = etp_counts.sum((0, 1)).tolist()
    grouped = gathered[order]
    with record_function("moe/experts"):
        out = run_experts(grouped, counts, segments)
    out = out[torch.argsort(order)]                                            # back in the received order
    with record_function("moe/dispatch/exchange"):
        out = scatter_rows(out, sizes, ep.etp_rank, ep.etp_group)
        out = all_to_all(out, recv, send, ep.ep_group)
    return combine(out, token, weight, routed.tokens.shape[0])


def dispatch_allgather(routed: Routed, run_experts, num_experts: int, ep: ExpertParallel,
                       by_source: bool = False) -> torch.Tensor:
    """As dispatch_alltoall, gathering every token of the EP x ETP group (in its rank order) instead of
    exchanging rows."""
    size = ep.ep_size * ep.etp_size
    sizes = [routed.tokens.shape[0]] * size
    with record_function("moe/dispatch/exchange"):
        tokens = gather_rows(routed.tokens, sizes, ep.ep_etp_group)
        experts = gather_rows(routed.experts, sizes, ep.ep_etp_group)
        weights = gather_rows(routed.weights, sizes, ep.ep_etp_group)
        keep = None if routed.keep is None else gather_rows(routed.keep, sizes, ep.ep_etp_group)
    token, expert, weight = _sorted_assignments(Routed(tokens, experts, weights, keep))
    mine = ep.local_experts(num_experts)
    counts = expert_counts(expert, num_experts).tolist()        # sorted by expert: this rank's are one range
    start = sum(counts[:mine.start])
    stop = start + sum(counts[mine.start:mine.stop])
    token, weight, counts = token[start:stop], weight[start:stop], counts[mine.start:mine.stop]
    segments = None
    if by_source and expert.device.type != "meta":        # a row's source: its token's rank in the group
        per_source = torch.bincount((expert[start:stop] - mine.start) * size + token // routed.tokens.shape[0],
                                    minlength=len(mine) * size)
        segments = microbatch_segments(per_source.view(len(mine), size).tolist(), ep.source_microbatch)
    rows = tokens.index_select(0, token)
    with record_function("moe/experts"):
        rows = run_experts(rows, counts, segments)
    out = combine(rows, token, weight, tokens.shape[0])
    rank = dist.get_rank(ep.ep_etp_group) if ep.ep_etp_group is not None else 0
    with record_function("moe/dispatch/exchange"):
        return scatter_rows(out, sizes, rank, ep.ep_etp_group)


def combine(rows: torch.Tensor, token: torch.Tensor, weight: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """out[t] = sum over the rows of token t of weight x row (in the rows' dtype)."""
    out = rows.new_zeros(num_tokens, rows.shape[1])
    return out.index_add(0, token, rows * weight.to(rows.dtype)[:, None])


def dispatch(routed: Routed, run_experts, num_experts: int, ep: ExpertParallel,
             by_source: bool = False) -> torch.Tensor:
    if ep.dispatcher == "allgather":
        return dispatch_allgather(routed, run_experts, num_experts, ep, by_source)
    return dispatch_alltoall(routed, run_experts, num_experts, ep, by_source)
