"""Context parallelism: ring attention (outputs and q/k/v gradients) vs full causal attention at cp = 2, 4
(with GQA) under the NCCL-semantics tier, with what it saves for backward, the data split, and
whole-model training equivalence at CP=2 and TP=2 x CP=2 x PP=2."""
import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.model.attention.mask import MaskSpec
from megalite.parallel.context import (ContextParallel, build_context_parallel, local_positions, ring_attention,
                                       slice_for_context_parallel)
from megalite.errors import UserError
from megalite.parallel.mesh import ParallelState

S, B, NH, D = 16, 2, 4, 8


def _inputs(groups: int):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(S, B, NH, D, generator=g)
    k, v = torch.randn(S, B, groups, D, generator=g), torch.randn(S, B, groups, D, generator=g)
    grad = torch.randn(S, B, NH * D, generator=g)
    return q, k, v, grad


def _full_attention(groups: int):
    q, k, v, grad = (t.clone().requires_grad_() if i < 3 else t for i, t in enumerate(_inputs(groups)))
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kk, vv = (t.repeat_interleave(NH // groups, dim=1) for t in (kk, vv))
    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).permute(2, 0, 1, 3).reshape(S, B, NH * D)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _local(t, cp: ContextParallel):
    return t.index_select(0, local_positions(t.shape[0], cp.rank, cp.size))


def _saved_bytes(tensors: list) -> int:
    return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in tensors}.values())


def _ring_ranks(rank, world):
    state = ParallelState.build(world, rank, cp=world)
    cp = build_context_parallel(state)
    results = {}
    for groups in (NH, 2):                                           # MHA and GQA
        q, k, v, grad = (_local(t, cp) for t in _inputs(groups))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = ring_attention(q, k, v, cp, MaskSpec())
        # what flash attention keeps: q, the unexpanded k and v, the output and the fp32 log-sum-exp
        theory = sum(t.numel() * t.element_size() for t in (q, k, v, out)) + B * NH * q.shape[0] * 4
        out.backward(grad)
        results[groups] = (out.detach(), q.grad, k.grad, v.grad, _saved_bytes(saved) / theory)
    return results


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_full_causal_attention(cp):
    """Under the NCCL-semantics tier: the KV prefetch and the asynchronous dK/dV hops are posted in an
    order NCCL runs without hanging."""
    results = run_ranks(cp, _ring_ranks, nccl=True)
    for groups in (NH, 2):
        ref = _full_attention(groups)
        for rank, got in enumerate(r[groups] for r in results):
            view = ContextParallel(rank=rank, size=cp)
            for name, r, x in zip(("out", "dq", "dk", "dv"), ref, got):
                torch.testing.assert_close(x, _local(r, view), rtol=1e-5, atol=1e-6, msg=f"{name} rank {rank}")
            assert got[4] == 1.0, f"saved bytes / (q, k, v, out, lse) = {got[4]} on rank {rank}"


def test_slice_for_context_parallel_takes_chunks_r_and_2cp_minus_1_minus_r():
    s, cp = 16, 4
    batch = {"tokens": torch.arange(2 * s).view(2, s), "labels": torch.arange(2 * s).view(2, s) + 1,
             "loss_mask": torch.ones(2, s), "position_ids": torch.arange(s).expand(2, s)}
    parts = [slice_for_context_parallel(batch, r, cp) for r in range(cp)]
    assert parts[0]["tokens"][0].tolist() == [0, 1, 14, 15]
    assert parts[1]["position_ids"][1].tolist() == [2, 3, 12, 13]
    assert sorted(torch.cat([p["tokens"] for p in parts], dim=1)[0].tolist()) == list(range(s))
    assert local_positions(s, 1, cp).tolist() == [2, 3, 12, 13]


def test_context_parallel_flag_validation():
    with pytest.raises(UserError, match="--seq-length 32 divisible by 6"):
        parse_args(with_flags(TINY_LLAMA_ARGS, context_parallel_size=3), world_size=3)
    with pytest.raises(UserError, match="--attention-dropout"):
        parse_args(with_flags(TINY_LLAMA_ARGS, context_parallel_size=2, attention_dropout=0.1), world_size=2)
    parse_args(with_flags(TINY_LLAMA_ARGS, context_parallel_size=2), world_size=2)


# ---- whole model --------------------------------------------------------------------------------
ARGS = with_flags(TINY_LLAMA_ARGS, num_layers=4, seq_length=64, max_position_embeddings=64, global_batch_size=8,
                  train_iters=10, clip_grad=1.0)


def _train(rank, world, argv):
    from megalite.train.trainer import pretrain
    return pretrain(parse_args(argv, world_size=world), print_fn=lambda *_: None).history


def test_training_with_context_parallelism_equals_serial():
    serial = run_ranks(1, _train, ARGS)[0]
    for world, flags in ((2, {"context_parallel_size": 2}),
                         (8, {"context_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True,
                              "pipeline_model_parallel_size": 2, "use_distributed_optimizer": True})):
        histories = run_ranks(world, _train, with_flags(ARGS, **flags))
        logged = histories[-1]                                 # the last pipeline stage logs the loss
        assert len(logged) == len(serial) == 10
        for got, want in zip(logged, serial):
            assert got == pytest.approx(want, rel=1e-5), (flags, logged, serial)
