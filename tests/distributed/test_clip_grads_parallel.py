"""The global gradient norm counts every element of the whole model once: TP-sharded parameters on
every TP rank, replicated ones once, replicated rows 1/r, shared copies never, ZeRO shards summed."""
import torch

from harness import run_ranks
from megalite.parallel.data.grad_buffer import BufferSlot
from megalite.optim.clip_grads import global_grad_norm, local_segments, norm_weights
from megalite.parallel.param_meta import mark


def fake(shape, sharded=None, rows=None, shared=False):
    p = torch.nn.Parameter(torch.zeros(shape))
    if sharded is not None:
        mark(p, tensor_model_parallel=sharded)
    if rows is not None:
        mark(p, replicated_rows=rows)
    if shared:
        mark(p, shared=True)
    return p


def layout(named):
    slots, offset = {}, 0
    for name, p in named:
        slots[name] = BufferSlot(offset, offset + p.numel(), tuple(p.shape))
        offset += p.numel()
    return slots


def test_norm_weights_follow_the_tensor_parallel_conventions():
    named = [("qkv", fake((6, 2), sharded=True, rows=(2, 4, 2))), ("norm", fake((3,))),
             ("fc", fake((2, 2), sharded=True)), ("tied", fake((2,), shared=True))]
    slots = layout(named)
    assert norm_weights(named, slots, tp_rank=0) == [(0, 4, 1.0), (4, 8, 0.5), (8, 19, 1.0)]   # 19-21: shared
    assert norm_weights(named, slots, tp_rank=1) == [(0, 4, 1.0), (4, 8, 0.5), (8, 12, 1.0), (15, 19, 1.0)]
    assert local_segments([(0, 4, 1.0), (4, 8, 0.5)], 3, 6) == [(0, 1, 1.0), (1, 3, 0.5)]


def _norms(rank, world):
    from megalite.parallel.mesh import ParallelState
    g = torch.Generator().manual_seed(0)
    sharded_full = torch.randn(2, 6, generator=g)              # a TP-sharded weight, split on rows
    replicated = torch.randn(5, generator=g)                   # identical on both TP ranks
    truth = float(torch.cat([sharded_full.view(-1), replicated]).norm())
    # TP = 2: each rank holds half of the sharded weight and the whole replicated one
    tp = ParallelState.build(world, rank, tp=2)
    named = [("w", fake((1, 6), sharded=True)), ("b", fake((5,)))]
    grads = torch.cat([sharded_full[rank], replicated])
    segments = [local_segments(norm_weights(named, layout(named), tp.tp_rank), 0, 11)]
    tp_norm = global_grad_norm([grads], segments, [tp.group("mp")])
    # DP = 2 with sharded gradients (ZeRO): each rank holds one contiguous half of the flat gradient
    dp = ParallelState.build(world, rank)
    flat = torch.cat([sharded_full.view(-1), replicated])
    half = flat[rank * 9:(rank + 1) * 9] if rank == 0 else flat[9:]
    named = [("w", fake((2, 6))), ("b", fake((5,)))]
    start, end = (0, 9) if rank == 0 else (9, 17)
    segments = [local_segments(norm_weights(named, layout(named), 0), start, end)]
    dp_norm = global_grad_norm([half], segments, [dp.group("dp")])
    return truth, tp_norm, dp_norm


def test_global_norm_over_tensor_and_data_parallel_ranks():
    for truth, tp_norm, dp_norm in run_ranks(2, _norms):
        assert abs(tp_norm - truth) < 1e-5 * truth
        assert abs(dp_norm - truth) < 1e-5 * truth
