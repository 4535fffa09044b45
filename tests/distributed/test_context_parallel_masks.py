"""Every --cp-comm-type (p2p ring, a2a Ulysses, a2a+p2p, allgather) against a dense fp64 reference, forward and
backward, at CP 2 and 4 under the NCCL-semantics tier: plain causal, per-sample documents that cross the
load-balanced chunks' boundaries, a sliding window, learnable sinks, and all of them at once."""
import pytest
import torch

from harness import run_ranks
from megalite.model.attention.core import core_attention
from megalite.model.attention.mask import MaskSpec
from megalite.parallel.context import ContextParallel, build_context_parallel, local_positions
from megalite.parallel.context.ulysses import context_attention
from megalite.parallel.mesh import ParallelState

S, B, NH, G, D = 32, 2, 8, 4, 8
# documents per sample, crossing chunk boundaries (chunks of 4 at CP 4, 8 at CP 2), padded by repeating S
CU = torch.tensor([[0, 5, 18, 32, 32], [0, 11, 12, 27, 32]], dtype=torch.int32)
MASKS = {"causal": (MaskSpec(), False), "documents": (MaskSpec(cu_seqlens=CU), False),
         "window": (MaskSpec(window=(5, 0)), False), "sinks": (MaskSpec(), True),
         "all": (MaskSpec(window=(6, 0), cu_seqlens=CU), True)}
# (comm type, a2a size of a2a+p2p) tried at each CP size
LAYOUTS = {2: [("p2p", None), ("a2a", None), ("a2a+p2p", 1), ("allgather", None)],
           4: [("p2p", None), ("a2a", None), ("a2a+p2p", 2), ("allgather", None)]}


def _inputs():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(S, B, NH, D, generator=g)
    k, v = torch.randn(S, B, G, D, generator=g), torch.randn(S, B, G, D, generator=g)
    return q, k, v, torch.randn(S, B, NH * D, generator=g), torch.randn(NH, generator=g)


def dense_attention(q, k, v, mask: MaskSpec, sinks=None):
    """[s, b, heads, d] -> [s, b, heads * d_v], the s x s scores of each sample masked by ``mask.visible``,
    with one sink logit per head in the denominator."""
    s, b, heads = q.shape[:3]
    k, v = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * q.shape[-1] ** -0.5
    seen = torch.stack([mask.visible(i, torch.arange(s), torch.arange(s)) for i in range(b)])
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(b, heads, s, 1).to(scores.dtype)], dim=-1)
    p = torch.softmax(scores, dim=-1)[..., :s]
    return torch.einsum("bhqk,kbhd->qbhd", p, v).reshape(s, b, -1)


def reference(mask: MaskSpec, with_sinks: bool):
    q, k, v, grad, sinks = (t.double().requires_grad_() for t in _inputs())
    out = dense_attention(q, k, v, mask, sinks if with_sinks else None)
    out.backward(grad.double())
    return [t.float() for t in (out.detach(), q.grad, k.grad, v.grad, sinks.grad if with_sinks else None)
            if t is not None]


def _local(t, cp):
    return t.index_select(0, local_positions(t.shape[0], cp.rank, cp.size))


def _dense_local(mask):
    def attend(q, k, v, sinks=None):
        return dense_attention(q, k, v, mask, sinks)
    return attend


def _ranks(rank, world, kind, a2a):
    state = ParallelState.build(world, rank, cp=world, cp_a2a=a2a)
    cp = build_context_parallel(state, (kind,), None if a2a is None else (a2a, world // a2a)).for_layer(1)
    results = {}
    for name, (mask, with_sinks) in MASKS.items():
        q, k, v, grad, sinks = _inputs()
        q, k, v, grad = (_local(t, cp) for t in (q, k, v, grad))
        q, k, v, sinks = (t.clone().requires_grad_() for t in (q, k, v, sinks))
        # a2a's local attention: the model's own path where it takes the mask, else the dense one
        local = _dense_local(mask) if with_sinks or not mask.plain else (lambda *t: core_attention(*t, mask))
        out = context_attention(q, k, v, cp, mask, local, sinks=sinks if with_sinks else None)
        out.backward(grad)
        results[name] = [out.detach(), q.grad, k.grad, v.grad] + ([sinks.grad] if with_sinks else [])
    return results


@pytest.mark.parametrize("cp", [2, 4])
def test_every_comm_type_equals_dense_attention(cp):
    want = {name: reference(*spec) for name, spec in MASKS.items()}
    for kind, a2a in LAYOUTS[cp]:
        results = run_ranks(cp, _ranks, kind, a2a, nccl=True)
        for name, ref in want.items():
            for rank, got in enumerate(r[name] for r in results):
                view = ContextParallel(rank=rank, size=cp)
                for label, g, w in zip(("out", "dq", "dk", "dv"), got, ref):
                    torch.testing.assert_close(g, _local(w, view), rtol=1e-5, atol=1e-5,
                                               msg=lambda m: f"{kind} {name} {label} rank {rank}: {m}")
            if len(ref) == 5:       # each rank's share of the sinks' gradient; the DP x CP reduction sums them
                torch.testing.assert_close(sum(r[name][4] for r in results), ref[4], rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{kind} {name} dsinks: {m}")


# ---- bad input: one line naming the flag ----------------------------------------------------------
def _parse(cp: int, *extra: str, **flags):
    from megalite.train.command_line import parse_args
    from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
    return parse_args(with_flags(TINY_LLAMA_ARGS, context_parallel_size=cp, **flags) + list(extra), world_size=cp)


@pytest.mark.parametrize("extra, message", [
    (["--cp-comm-type", "a2a"], r"--cp-comm-type a2a splits heads over 4 ranks: .* must divide by 4"),
    (["--cp-comm-type", "a2a+p2p"], r"--cp-comm-type a2a\+p2p needs --hierarchical-context-parallel-sizes A B"),
    (["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "3"], r"A x B = .* 4; got \[2, 3\]"),
    (["--cp-comm-type", "p2p", "a2a"], r"--cp-comm-type takes one value or one per layer \(3\); got 2"),
])
def test_cp_comm_type_refusals(extra, message):
    from megalite.errors import UserError
    with pytest.raises(UserError, match=message) as err:
        _parse(4, *extra, num_attention_heads=2, num_query_groups=2, num_layers=3)
    assert "\n" not in str(err.value)


def test_cp_comm_type_accepted_forms():
    args = _parse(4, "--cp-comm-type", "a2a+p2p", "p2p", "a2a", "allgather", "--hierarchical-context-parallel-sizes",
                  "2", "2", num_attention_heads=8, num_query_groups=4, num_layers=4)
    assert args.parallel.cp_comm_type == ["a2a+p2p", "p2p", "a2a", "allgather"]
    assert args.parallel.hierarchical_context_parallel_sizes == [2, 2]


# ---- whole model ----------------------------------------------------------------------------------
def _train(rank, world, argv):
    from megalite.train.command_line import parse_args
    from megalite.train.trainer import pretrain
    return pretrain(parse_args(argv, world_size=world), print_fn=lambda *_: None).history


def test_training_with_every_comm_type_equals_serial():
    """Ulysses alone and all-gather alone at CP=2, and at CP=4 a different comm type per layer (Megatron's
    list form)."""
    from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
    argv = with_flags(TINY_LLAMA_ARGS, num_layers=4, num_query_groups=4, seq_length=64, max_position_embeddings=64,
                      global_batch_size=8, train_iters=4)
    serial = run_ranks(1, _train, argv)[0]
    for cp, extra in ((2, ["--cp-comm-type", "a2a"]), (2, ["--cp-comm-type", "allgather"]),
                      (4, ["--cp-comm-type", "p2p", "a2a", "a2a+p2p", "a2a", "--hierarchical-context-parallel-sizes",
                           "2", "2"])):
        logged = run_ranks(cp, _train, with_flags(argv, context_parallel_size=cp) + extra)[-1]
        assert len(logged) == len(serial) == 4
        assert logged == pytest.approx(serial, rel=1e-5), (extra, logged, serial)


# ---- allgather's memory ---------------------------------------------------------------------------
def _allgather_peak(rank, world, chunk):
    """Peak live bytes of one allgather forward + backward on this rank, at chunks of ``chunk`` tokens."""
    from bench.cross_entropy_memory import LiveBytes
    from megalite.parallel.context.allgather import allgather_attention
    cp = build_context_parallel(ParallelState.build(world, rank, cp=world), ("allgather",)).for_layer(1)
    g = torch.Generator().manual_seed(rank)
    q, grad = torch.randn(2 * chunk, B, NH, D, generator=g), torch.randn(2 * chunk, B, NH * D, generator=g)
    k, v = (torch.randn(2 * chunk, B, G, D, generator=g).requires_grad_() for _ in range(2))
    q.requires_grad_()
    with LiveBytes() as live:
        allgather_attention(q, k, v, cp, MaskSpec()).backward(grad)
    return live.peak


def test_allgather_holds_the_gathered_kv_and_block_sized_temporaries():
    """Beyond the gathered K/V and its fp32 dK/dV (the whole sequence's, 2 cp local K/V sizes), one layer
    holds a few fp32 [s_local, b, heads, d] tensors (output, dQ, kernel outputs), never a block's
    [b, heads, c, c] scores: measured at c and 4c on CP rank 0 of 2."""
    peaks = {}
    for chunk in (64, 256):
        local = 2 * chunk * B * NH * D * 4                      # one fp32 [s_local, b, heads, d] tensor
        whole_kv = 2 * (2 * 2 * chunk) * B * G * D * 4          # K and V of the 2 cp chunks (fp32)
        peaks[chunk] = run_ranks(2, _allgather_peak, chunk)[0]
        assert peaks[chunk] <= 2 * whole_kv + 6 * local, (chunk, peaks[chunk] / local)
    assert peaks[256] / peaks[64] == pytest.approx(4.0, rel=0.1)              # c x 4: memory x 4, not x 16
    assert peaks[256] < B * NH * 256 * 256 * 4                                  # one block's fp32 scores
