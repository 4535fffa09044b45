"""Where the structure is trivial the plain path runs: a one-rank TP group issues no collective and builds
no mapping node, and its loss is the plain cross-entropy; selective recomputation leaves a fused attention
kernel alone; RMSNorm keeps its own backward on CPU, where it keeps and costs less than torch's. Each
gives the same losses and gradients as the path it replaces."""
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.activation_memory import Shape, count_saved, model_config
from megalite.train.command_line import parse_args
from megalite.model.gpt import GPTModel
from megalite.model.attention import core
from megalite.model.kernels import sdpa_runs_fused
from megalite.model.norms import RMSNorm
from megalite.planning import inputs, memory
from megalite_test_utils import TINY_LLAMA_ARGS, masked_micro_batches

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather", "reduce_scatter",
               "all_to_all_single", "broadcast")


@pytest.fixture
def one_rank_world(tmp_path):
    """A gloo world of one process, as a distributed TP=1 run has (its "tp" group is a real one-rank group)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _run(model, batch, monkeypatch):
    """(losses, gradients, the collectives, autograd Functions and loss functions called) of one forward and
    backward."""
    from megalite.parallel.tensor import cross_entropy, mappings
    calls = []

    def counted(owner, name, label):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, **k: (calls.append(label), real(*a, **k))[1])
    for name in COLLECTIVES:
        counted(dist, name, name)
    counted(mappings._Mapping, "apply", "mapping")
    counted(cross_entropy._VocabParallelCrossEntropy, "apply", "vocab-parallel loss")
    counted(cross_entropy._ChunkedCrossEntropy, "apply", "chunked loss")
    counted(F, "cross_entropy", "F.cross_entropy")
    loss = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
    (loss * batch["loss_mask"]).sum().backward()
    monkeypatch.undo()
    return loss.detach(), [p.grad for p in model.parameters()], calls


@pytest.mark.parametrize("fusion", [False, True])
def test_a_one_rank_tp_group_issues_no_collective_and_equals_the_group_path(one_rank_world, monkeypatch, fusion):
    from megalite.parallel.mesh import ParallelState
    from megalite.parallel.tensor.setup import build_tensor_parallel
    config = parse_args(TINY_LLAMA_ARGS + (["--cross-entropy-loss-fusion"] if fusion else []), world_size=1).model
    state = ParallelState.build(1, 0)
    assert state.group("tp") is not None                          # the one-rank group a distributed run has
    batch = masked_micro_batches()[0]
    results = []
    for use_group in (False, True):
        tp = build_tensor_parallel(state, False, 1234, torch.device("cpu"), config.num_query_groups)
        assert tp.group is None
        if use_group:                                             # the path a one-rank group took before
            tp.group = state.group("tp")
        results.append(_run(GPTModel(config, seed=1, tp=tp), batch, monkeypatch))
    (loss, grads, calls), (group_loss, group_grads, group_calls) = results
    assert calls == (["chunked loss"] if fusion else ["vocab-parallel loss"])
    assert "mapping" in group_calls and "all_reduce" in group_calls          # what the group path paid
    assert ("chunked loss" if fusion else "vocab-parallel loss") in group_calls
    torch.testing.assert_close(loss, group_loss, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, group_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_on_cpu_keeps_the_lean_backward(dtype):
    """The CPU decision: torch's composite rms_norm keeps fp32 copies (8 bytes per element); RMSNorm keeps the
    input and an fp32 1/rms per row, with the same values and gradients."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 128, generator=g).to(dtype).requires_grad_()
    norm = RMSNorm(128, 1e-5, dtype)
    grad = torch.randn(64, 2, 128, generator=g).to(dtype)
    with count_saved(norm) as ours:
        out = norm(x)
    with count_saved(norm) as torchs:
        ref = F.rms_norm(x, (128,), norm.weight, 1e-5)
    assert ours.bytes() == x.numel() * x.element_size() + 64 * 2 * 4
    assert torchs.bytes() >= 8 * x.numel()
    assert torch.equal(out, ref)
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for a, b in zip(torch.autograd.grad(out, (x, norm.weight), grad), torch.autograd.grad(ref, (x, norm.weight), grad)):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sdpa_runs_fused_agrees_with_torchs_dispatch_on_cpu(dtype):
    q = torch.randn(2, 4, 16, 8).to(dtype)
    grouped = torch.randn(2, 2, 16, 8).to(dtype)
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    for k in (q, grouped):
        gqa = k is grouped
        for m in (None, mask):
            for dropout in (0.0, 0.1):
                choice = torch._fused_sdp_choice(q, k, k, m, dropout, m is None, enable_gqa=gqa)
                assert sdpa_runs_fused(q, k, k, m, dropout, m is None, gqa) == (choice != 0)     # 0: math


def _layer_run(shape: Shape, monkeypatch, **overrides):
    """(bytes the last layer keeps, loss, gradients, core_attention calls) of a 2-layer model's forward and
    backward."""
    calls = []
    real = core.core_attention
    monkeypatch.setattr(core, "core_attention", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    model = GPTModel(dataclasses.replace(model_config(shape), **overrides), seed=1)
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(5)
    with count_saved(model, {"layer": model.decoder.layers[-1]}) as record:
        loss = model(tokens, labels=tokens).float().mean()
    loss.backward()
    monkeypatch.undo()
    return record.bytes("layer"), loss.detach(), [p.grad for p in model.parameters()], len(calls)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_selective_recompute_leaves_the_fused_kernel_alone_and_recomputes_the_math_path(monkeypatch, dtype):
    """No attention dropout (CPU flash kernel): selective keeps what no recomputation keeps and runs attention
    once per layer. Attention dropout (the math path): the recomputed region keeps its q, k, v and drops
    the scores and the log-sum-exp, as the planner counts; attention runs again in backward. Losses and
    gradients are the same either way."""
    shape = Shape(dtype=dtype, seq=64, hidden=128, heads=4, kv_heads=2, ffn=256)
    fused = _layer_run(shape, monkeypatch)
    fused_selective = _layer_run(shape, monkeypatch, recompute_granularity="selective")
    math = _layer_run(shape, monkeypatch, attention_dropout=0.1)
    math_selective = _layer_run(shape, monkeypatch, attention_dropout=0.1, recompute_granularity="selective")
    assert fused_selective[0] == fused[0] and fused_selective[3] == fused[3] == 2
    lse = shape.seq * shape.batch * shape.heads * 4
    assert math_selective[0] == fused[0] - lse < math[0] and math_selective[3] == 4
    for plain, selective in ((fused, fused_selective), (math, math_selective)):
        assert torch.equal(plain[1], selective[1])
        for a, b in zip(plain[2], selective[2]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)

    config = model_config(shape)
    workload = inputs.Workload(config, 8, precision="fp32" if dtype == "float32" else "bf16")
    mb = shape.batch
    selective, none = inputs.Layout(micro_batch_size=mb, recompute="selective"), inputs.Layout(micro_batch_size=mb)
    estimate = memory.layer_activation_bytes(workload, selective, inputs.CPU_KERNELS)
    assert estimate == memory.layer_activation_bytes(workload, none, inputs.CPU_KERNELS)
    math_workload = dataclasses.replace(workload, model=dataclasses.replace(config, attention_dropout=0.1))
    assert memory.layer_activation_bytes(math_workload, selective, inputs.CPU_KERNELS) == estimate - lse
    with pytest.raises(ValueError, match="math attention"):
        memory.layer_activation_bytes(math_workload, none, inputs.CPU_KERNELS)
