"""megalite's pipeline schedules side by side with torch.distributed.pipelining's (used by bench_pipeline.py).

Both run on the same gloo ranks, the same model chunks (megalite's GPTModel stages built from the same seed,
so the weights are equal), the same layout (stage s on rank s; interleaved: stages r and r + p on rank r;
V: stages r and 2p - 1 - r) and the same micro-batches, one step (forward + backward of every micro-batch,
no optimizer) at a time, alternating megalite and torch so that both see the same machine load. Each side
accumulates fp32 gradients in place: megalite into its contiguous gradient buffer (as in training), torch
into each parameter's .grad. torch's last stage returns logits and its loss_fn takes the cross-entropy, the
same computation megalite's last stage does in one module; both scale each micro-batch's loss by 1/m.

The reference is one process running the whole model over the same micro-batches (gradient accumulation),
timed in the same loop while the other rank waits.
"""
from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

# (row, megalite --pipeline-schedule, model chunks per rank, torch.distributed.pipelining schedule class)
PAIRS = [
    ("1F1B", "1f1b", 1, "Schedule1F1B"),
    ("interleaved 1F1B (v=2)", "1f1b", 2, "ScheduleInterleaved1F1B"),
    ("GPipe", "gpipe", 1, "ScheduleGPipe"),
    # torch has no ZB-H1 class; ScheduleInterleavedZeroBubble (ZB1P) with one stage per rank is ZB-H1's order
    ("ZB-H1", "zb-h1", 1, "ScheduleInterleavedZeroBubble"),
    ("ZB-V", "zbv", 2, "ScheduleZBVZeroBubble"),
]


def model_argv(opts: dict) -> list[str]:
    return ["--num-layers", str(opts["layers"]), "--hidden-size", str(opts["hidden"]),
            "--num-attention-heads", str(opts["heads"]), "--seq-length", str(opts["seq"]),
            "--max-position-embeddings", str(opts["seq"]), "--position-embedding-type", "rope",
            "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--attention-dropout", "0", "--hidden-dropout", "0", "--micro-batch-size", str(opts["mbs"]),
            "--lr", "1e-4", "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(opts["vocab"]), "--make-vocab-size-divisible-by", "128"]


def make_batches(opts: dict, m: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(m):
        x = torch.randint(0, opts["vocab"], (opts["mbs"], opts["seq"] + 1), generator=g)
        out.append({"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(opts["mbs"], opts["seq"]),
                    "position_ids": torch.arange(opts["seq"]).expand(opts["mbs"], opts["seq"])})
    return out


class MegaliteRunner:
    """One step of megalite's schedule executor on this rank's chunks, as training runs it."""

    def __init__(self, cfg, state, tp, schedule: str, chunks_per_rank: int, batches: list):
        from megalite.parallel.data.grad_buffer import ParamAndGradBuffer
        from megalite.parallel.pipeline.p2p import PipelineComm
        from megalite.parallel.pipeline.plan import rank_plan
        from megalite.parallel.pipeline.orders import stage_placement
        from megalite.model.chunks import build_model_chunks
        from megalite.parallel.pipeline.stages import chunk_forward
        self.placement = stage_placement(schedule)
        self.chunks = build_model_chunks(cfg, 1, tp, state.pp_rank, state.pp_size, chunks_per_rank,
                                         placement=self.placement)
        self.buffer = ParamAndGradBuffer([(f"{i}.{n}", p) for i, c in enumerate(self.chunks)
                                          for n, p in c.named_parameters()])
        mbs, seq = batches[0]["tokens"].shape
        self.comm = PipelineComm(state.group("pp"), state.pp_rank, state.pp_size, (seq, mbs, cfg.hidden_size),
                                 torch.float32, torch.device("cpu"))
        self.plan = rank_plan(schedule, state.pp_size, state.pp_rank, len(batches), chunks_per_rank)
        self.forward = chunk_forward(self.chunks, torch.device("cpu"))
        self.batches, self.chunks_per_rank = batches, chunks_per_rank

    def step(self) -> list[float]:
        from megalite.parallel.pipeline.executor import run_pipeline_schedule
        self.buffer.zero_grad()
        return run_pipeline_schedule(self.plan, self.forward, self.batches, self.comm)


class StageModule(torch.nn.Module):
    """A megalite chunk as a torch.distributed.pipelining stage: one tensor in, one out (tokens in on the
    first stage, logits [b, s, V] out of the last)."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x):
        return self.chunk(x) if self.chunk.pre_process else self.chunk(hidden_states=x)


class TorchRunner:
    """One step of torch.distributed.pipelining's schedule on copies of the same chunks."""

    def __init__(self, cfg, state, tp, schedule: str, chunks_per_rank: int, torch_schedule: str, batches: list):
        import torch.nn.functional as F
        from torch.distributed import pipelining
        from megalite.parallel.pipeline.orders import StageMap, stage_placement
        from megalite.model.chunks import build_model_chunks
        pp, m = state.pp_size, len(batches)
        placement = stage_placement(schedule)
        self.chunks = build_model_chunks(cfg, 1, tp, state.pp_rank, pp, chunks_per_rank, placement=placement)
        for c in self.chunks:
            for p in c.parameters():
                p.grad = torch.zeros_like(p)           # accumulated in place, as megalite's buffer
        stage_map = StageMap(pp, state.pp_rank, chunks_per_rank, placement)
        stages = [pipelining.PipelineStage(StageModule(c), stage_map.stage[i], pp * chunks_per_rank,
                                           torch.device("cpu"), group=state.group("pp"))
                  for i, c in enumerate(self.chunks)]
        vocab = cfg.vocab_size

        def loss_fn(logits, labels):                    # megalite's last stage: mean token loss / m
            return F.cross_entropy(logits.reshape(-1, vocab).float(), labels.reshape(-1)) / m

        cls = getattr(pipelining, torch_schedule)
        self.schedule = cls(stages[0] if cls.__name__ in ("Schedule1F1B", "ScheduleGPipe") else stages,
                            n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
        self.first = any(stage_map.first(i) for i in range(chunks_per_rank))
        self.last = any(stage_map.last(i) for i in range(chunks_per_rank))
        self.tokens = torch.cat([b["tokens"] for b in batches])
        self.labels = torch.cat([b["labels"] for b in batches])
        self.m = m

    def step(self) -> list[float]:
        for c in self.chunks:
            for p in c.parameters():
                p.grad.zero_()
        losses = [] if self.last else None
        args = (self.tokens,) if self.first else ()
        kwargs = {"target": self.labels, "losses": losses} if self.last else {}
        self.schedule.step(*args, **kwargs)
        return [float(x.detach()) * self.m for x in losses] if self.last else []


class ReferenceRunner:
    """The whole model in this one process over the same micro-batches."""

    def __init__(self, cfg, batches: list):
        from megalite.model.gpt import GPTModel
        self.model = GPTModel(cfg, seed=1)
        self.batches = batches

    def step(self) -> list[float]:
        self.model.zero_grad(set_to_none=False)
        losses = []
        for b in self.batches:
            loss = self.model(b["tokens"], labels=b["labels"]).mean()
            (loss / len(self.batches)).backward()
            losses.append(loss.item())
        return losses


def _timed(step):
    """Seconds from a barrier to the end of ``step`` on every rank; returns (seconds, step's result)."""
    dist.barrier()
    start = time.perf_counter()
    result = step()
    dist.barrier()
    return time.perf_counter() - start, result


def compare(rank: int, world: int, opts: dict) -> dict:
    """On every rank: for each micro-batch count, every pair's step times (megalite, torch, alternating)
    and the reference's. Returns {m: {row: {"megalite": [s], "torch": [s], "losses": (megalite, torch)}},
    "reference" row with its times and losses on rank 0}."""
    from megalite.train.command_line import parse_args
    from megalite.parallel.mesh import ParallelState
    from megalite.parallel.tensor.setup import build_tensor_parallel
    cfg = parse_args(model_argv(opts), world_size=1).model
    state = ParallelState.build(world, rank, pp=world)
    tp = build_tensor_parallel(state, False, 1, torch.device("cpu"), cfg.num_query_groups)
    results = {}
    for m in opts["microbatches"]:
        batches = make_batches(opts, m)
        runners = {row: (MegaliteRunner(cfg, state, tp, s, v, batches),
                         TorchRunner(cfg, state, tp, s, v, torch_cls, batches)) for row, s, v, torch_cls in PAIRS}
        reference = ReferenceRunner(cfg, batches) if rank == 0 else None
        rows = {row: {"megalite": [], "torch": [], "losses": None} for row in runners}
        rows["reference"] = {"seconds": [], "losses": None}
        for rep in range(opts["repeats"] + 1):             # the first round warms up and is not counted
            for row, (mine, theirs) in runners.items():
                t_mine, l_mine = _timed(mine.step)
                t_theirs, l_theirs = _timed(theirs.step)
                if rep:
                    rows[row]["megalite"].append(t_mine)
                    rows[row]["torch"].append(t_theirs)
                rows[row]["losses"] = (l_mine, l_theirs)
            t_ref, l_ref = _timed(reference.step if reference else list)
            if rep:
                rows["reference"]["seconds"].append(t_ref)
            rows["reference"]["losses"] = l_ref
            if rank == 0:
                print(f"  vs torch: m={m}, round {rep + 1} of {opts['repeats'] + 1} done", flush=True)
        results[m] = rows
        del runners, reference
    dist.barrier()
    return results


def _rank_main(rank: int, world: int, port: int, out_dir: str, opts: dict) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(compare(rank, world, opts), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_comparison(pp: int, opts: dict) -> list[dict]:
    """Spawn ``pp`` gloo ranks running ``compare``; returns each rank's results."""
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(pp, port, out_dir, opts), nprocs=pp, join=True)
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(pp)]


def last_stage_losses(per_rank: list[dict], m: int, row: str) -> tuple[list[float], list[float]]:
    """(megalite's, torch's) micro-batch losses from whichever rank holds the last stage."""
    mine = next(r[m][row]["losses"][0] for r in per_rank if r[m][row]["losses"][0])
    theirs = next(r[m][row]["losses"][1] for r in per_rank if r[m][row]["losses"][1])
    return mine, theirs


def summarize(per_rank: list[dict], m: int) -> tuple[dict, list[float], float]:
    """{row: (megalite ms, torch ms, ratio, max relative loss difference)}, the reference losses and ms.
    A step's time is the slowest rank's (they end at a barrier, so they differ by its latency only). The
    ratio is the median over rounds of megalite's step over torch's step of the same round: the two ran
    back to back, so a round's load slows both, and pairing them cancels it (shared cores vary by ±10%
    from one round to the next)."""
    ref = per_rank[0][m]["reference"]
    ref_losses = ref["losses"]
    out = {}
    for row, *_ in PAIRS:
        mine_s = [max(r[m][row]["megalite"][i] for r in per_rank) for i in range(len(ref["seconds"]))]
        theirs_s = [max(r[m][row]["torch"][i] for r in per_rank) for i in range(len(ref["seconds"]))]
        mine_l, theirs_l = last_stage_losses(per_rank, m, row)
        diff = max(abs(a - c) / abs(c) for a, c in zip(mine_l + theirs_l, ref_losses + ref_losses))
        mine_ms, theirs_ms = 1000 * statistics.median(mine_s), 1000 * statistics.median(theirs_s)
        ratio = statistics.median(a / b for a, b in zip(mine_s, theirs_s))
        out[row] = (mine_ms, theirs_ms, ratio, diff)
    return out, ref_losses, 1000 * statistics.median(ref["seconds"])
