"""What the pipeline tests share: the tiny model and micro-batches, the one-process reference, and one
schedule step through megalite's executor on a spawned rank."""
import pytest
import torch

from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.parallel.data.grad_buffer import ParamAndGradBuffer
from megalite.model.gpt import GPTModel
from megalite.parallel.mesh import ParallelState
from megalite.parallel.pipeline.executor import run_pipeline_schedule
from megalite.parallel.pipeline.p2p import PipelineComm
from megalite.parallel.pipeline.plan import rank_plan
from megalite.parallel.pipeline.orders import stage_placement
from megalite.parallel.finalize_grads import finalize_tensor_parallel_grads, sync_shared_embedding_grads
from megalite.model.chunks import build_model_chunks
from megalite.parallel.pipeline.stages import chunk_forward
from megalite.parallel.tensor.setup import build_tensor_parallel

ARGS = with_flags(TINY_LLAMA_ARGS, num_layers=4, make_vocab_size_divisible_by=32)
M, MBS, SEQ = 4, 2, 32


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The single-process references run in the test process with one thread, as each spawned rank does:
    the model is tiny, and OpenMP threads competing for a busy machine's cores slow it down."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def batches():
    g = torch.Generator().manual_seed(4)
    out = []
    for _ in range(M):
        x = torch.randint(0, 201, (MBS, SEQ + 1), generator=g)
        out.append({"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(MBS, SEQ),
                    "position_ids": torch.arange(SEQ).expand(MBS, SEQ)})
    return out


def reference(argv):
    """The whole model in one process over the same micro-batches: (losses, gradient per global name).
    With tied embeddings the last stage's output copy reports under the embedding's global name, so both
    copies are compared with the full (embedding + output) gradient."""
    model = GPTModel(parse_args(argv, world_size=1).model, seed=11)
    losses = []
    for batch in batches():
        loss = model(batch["tokens"], labels=batch["labels"]).mean()
        (loss / M).backward()
        losses.append(loss.item())
    return losses, {model.global_name(n): p.grad for n, p in model.named_parameters()}


def run_executor(rank, world, argv, pp, tp, schedule, chunks_per_rank):
    """One step of ``schedule`` on this rank: (losses on the rank holding the last stage, else None;
    gradients per global name at TP=1, else {})."""
    cfg = parse_args(argv, world_size=1).model
    state = ParallelState.build(world, rank, tp=tp, pp=pp)
    sp = "--sequence-parallel" in argv
    tpc = build_tensor_parallel(state, sp, 11, torch.device("cpu"), cfg.num_query_groups)
    placement = stage_placement(schedule)
    chunks = build_model_chunks(cfg, 11, tpc, state.pp_rank, pp, chunks_per_rank, placement=placement)
    named = [(f"{i}.{n}", p) for i, c in enumerate(chunks) for n, p in c.named_parameters()]
    ParamAndGradBuffer(named)
    comm = PipelineComm(state.group("pp"), state.pp_rank, pp, (SEQ // tp if sp else SEQ, MBS, cfg.hidden_size),
                        torch.float32, torch.device("cpu"))
    plan = rank_plan(schedule, pp, state.pp_rank, M, chunks_per_rank)
    losses = run_pipeline_schedule(plan, chunk_forward(chunks, torch.device("cpu")), batches(), comm)
    finalize_tensor_parallel_grads([p for _, p in named], tpc)
    sync_shared_embedding_grads(chunks, state)
    grads = {c.global_name(n): p.main_grad.clone() for c in chunks for n, p in c.named_parameters()}
    holds_last = any(c.post_process for c in chunks)
    return (losses.tolist() if holds_last else None), (grads if tp == 1 else {})
