"""Tensor and sequence parallelism: layers vs their single-device versions, whole-model training
equivalence at TP=2/4 (± SP) for GPT-2 and Llama styles, RNG streams, and recomputation."""
import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from megalite_test_utils import TINY_GPT2_ARGS, TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.parallel.mesh import ParallelState
from megalite.parallel.param_meta import param_meta
from megalite.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from megalite.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear, TensorParallel,
                                             VocabParallelEmbedding, parallel_logits)
from megalite.parallel.tensor.mappings import reduce_from_tp_region, scatter_to_sp_region
from megalite.parallel.tensor.random import RNGTracker, build_rng_tracker
from megalite.precision.gemm import GemmPrecision

S, B, H, OUT, V = 8, 2, 16, 24, 32


def _full_tensors():
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(*shape, generator=g) for name, shape in
            {"x": (S, B, H), "w_col": (OUT, H), "b_col": (OUT,), "w_row": (H, OUT), "b_row": (H,),
             "emb": (V, H), "logits": (S, B, V), "grad_out": (S, B, OUT), "grad_h": (S, B, H)}.items()} | {
        "ids": torch.randint(0, V, (B, S), generator=g), "target": torch.randint(0, V, (S, B), generator=g)}


def _load(layer_param, full):
    with torch.no_grad():
        layer_param.copy_(param_meta(layer_param).take_shard(full))


def _layer_checks(rank, world):
    """Each parallel layer's output and input/weight gradients vs the full computation (returned)."""
    t = _full_tensors()
    state = ParallelState.build(world, rank, tp=world)
    results = {}
    for sp in (False, True):
        tp = TensorParallel(state.group("tp"), state.tp_rank, state.tp_size, sequence_parallel=sp)
        # column-parallel: output rows of the weight; input replicated (or sequence-sharded with SP)
        col = ColumnParallelLinear(H, OUT, True, torch.float32, tp, gather_output=not sp)
        _load(col.weight, t["w_col"]); _load(col.bias, t["b_col"])
        x = t["x"].clone().requires_grad_()
        x_in = scatter_to_sp_region(x, tp.group) if sp and world > 1 else x
        y = col(x_in)
        grad = t["grad_out"] if not sp else tp.chunk(t["grad_out"], dim=-1)
        y.backward(grad)
        results[f"col{sp}"] = (y.detach(), x.grad, col.weight.grad, col.bias.grad)
        # row-parallel: input columns of the weight; output all-reduced (or reduce-scattered with SP)
        row = RowParallelLinear(OUT, H, True, torch.float32, tp)
        _load(row.weight, t["w_row"]); _load(row.bias, t["b_row"])
        xr = tp.chunk(t["grad_out"], dim=-1).clone().requires_grad_()      # any [S, B, OUT/tp] input
        yr = row(xr)
        yr.backward(tp.chunk(t["grad_h"], dim=0) if sp else t["grad_h"])
        results[f"row{sp}"] = (yr.detach(), xr.grad, row.weight.grad, row.bias.grad)
    tp = TensorParallel(state.group("tp"), state.tp_rank, state.tp_size)
    emb = VocabParallelEmbedding(V, H, torch.float32, tp)
    _load(emb.weight, t["emb"])
    e = reduce_from_tp_region(emb(t["ids"]), tp.group)
    e.backward(t["grad_h"].transpose(0, 1))
    results["emb"] = (e.detach(), emb.weight.grad)
    logits = tp.chunk(t["logits"], dim=-1).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, t["target"], tp.group, tp.rank * (V // world))
    (loss * torch.arange(S * B, dtype=torch.float32).view(S, B)).sum().backward()
    results["ce"] = (loss.detach(), logits.grad)
    w = tp.chunk(t["emb"], dim=0).clone().requires_grad_()
    lg = parallel_logits(t["x"], w, tp, GemmPrecision())
    lg.sum().backward()
    results["logits"] = (lg.detach(), w.grad)
    return results


def _reference():
    t = _full_tensors()
    ref = {}
    x = t["x"].clone().requires_grad_()
    w, b = t["w_col"].clone().requires_grad_(), t["b_col"].clone().requires_grad_()
    y = F.linear(x, w, b)
    y.backward(t["grad_out"])
    ref["col"] = (y.detach(), x.grad, w.grad, b.grad)
    xr = t["grad_out"].clone().requires_grad_()
    w, b = t["w_row"].clone().requires_grad_(), t["b_row"].clone().requires_grad_()
    yr = F.linear(xr, w, b)
    yr.backward(t["grad_h"])
    ref["row"] = (yr.detach(), xr.grad, w.grad, b.grad)
    emb = t["emb"].clone().requires_grad_()
    e = F.embedding(t["ids"], emb)
    e.backward(t["grad_h"].transpose(0, 1))
    ref["emb"] = (e.detach(), emb.grad)
    logits = t["logits"].clone().requires_grad_()
    loss = F.cross_entropy(logits.view(-1, V), t["target"].view(-1), reduction="none").view(S, B)
    (loss * torch.arange(S * B, dtype=torch.float32).view(S, B)).sum().backward()
    ref["ce"] = (loss.detach(), logits.grad)
    w = t["emb"].clone().requires_grad_()
    lg = F.linear(t["x"], w)
    lg.sum().backward()
    ref["logits"] = (lg.detach(), w.grad)
    return ref


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parallel_layers_equal_single_device_layers(tp):
    ref = _reference()
    results = _layer_checks(0, 1) if tp == 1 else None
    all_ranks = [results] if tp == 1 else run_ranks(tp, _layer_checks)
    for r, res in enumerate(all_ranks):
        def chunk(x, dim):
            return x.chunk(tp, dim=dim)[r]
        for sp in (False, True):
            y, gx, gw, gb = res[f"col{sp}"]
            ry, rgx, rgw, rgb = ref["col"]
            _close(y, chunk(ry, -1) if sp else ry)            # SP keeps the output split (gather_output off)
            _close(gx, rgx)                                   # full input gradient on every rank
            _close(gw, chunk(rgw, 0)); _close(gb, chunk(rgb, 0))
            y, gx, gw, gb = res[f"row{sp}"]
            ry, rgx, rgw, rgb = ref["row"]
            _close(y, chunk(ry, 0) if sp else ry)
            _close(gx, chunk(rgx, -1)); _close(gw, chunk(rgw, 1))
            if not sp:
                _close(gb, rgb)                               # with SP the bias grad is partial per rank
        _close(res["emb"][0], ref["emb"][0]); _close(res["emb"][1], chunk(ref["emb"][1], 0))
        _close(res["ce"][0], ref["ce"][0]); _close(res["ce"][1], chunk(ref["ce"][1], -1))
        _close(res["logits"][0], chunk(ref["logits"][0], -1)); _close(res["logits"][1], chunk(ref["logits"][1], 0))
    if tp > 1:   # row-parallel bias under SP: the per-rank partial gradients sum to the full one
        _close(sum(res["rowTrue"][3] for res in all_ranks), ref["row"][3])


# ---- whole model through the real training loop --------------------------------------------------
STYLES = {
    "llama": with_flags(TINY_LLAMA_ARGS, num_layers=2, train_iters=10, global_batch_size=4,
                        make_vocab_size_divisible_by=32, lr_warmup_iters=2, lr_decay_style="cosine",
                        clip_grad=0.5, weight_decay=0.1),
    "gpt2": with_flags(TINY_GPT2_ARGS, train_iters=10, global_batch_size=4, lr_warmup_iters=2, clip_grad=0.5,
                       weight_decay=0.1),
}


def _train_losses(rank, world, layouts):
    from megalite.train.trainer import pretrain
    out = []
    for argv in layouts:
        state = pretrain(parse_args(argv, world_size=world), print_fn=lambda *_: None)
        out.append(state.history)
    return out


def _layouts(tp):
    return [with_flags(STYLES[style], tensor_model_parallel_size=tp, sequence_parallel=sp)
            for style in ("llama", "gpt2") for sp in (False, True)]


# TP=4 (slow): TP=4 layers are checked in the default suite by test_parallel_layers_equal_single_device_layers[4]
@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_training_at_tp_equals_single_process(tp):
    reference = _train_losses(0, 1, [STYLES["llama"], STYLES["gpt2"]])
    results = run_ranks(tp, _train_losses, _layouts(tp))
    for rank_losses in results:                               # every TP rank computes the same loss
        for i, losses in enumerate(rank_losses):
            ref = reference[i // 2]
            assert len(losses) == 10
            for a, b in zip(losses, ref):
                assert abs(a - b) <= 1e-5 * abs(b), (i, losses, ref)


def _dropout_losses(rank, world, argv):
    from megalite.train.trainer import pretrain
    return [pretrain(parse_args(argv, world_size=world), print_fn=lambda *_: None).history for _ in range(2)]


def test_dropout_runs_are_deterministic_with_tensor_parallelism():
    argv = with_flags(STYLES["llama"], tensor_model_parallel_size=2, sequence_parallel=True, attention_dropout=0.1,
                      hidden_dropout=0.1, train_iters=4)
    first, second = run_ranks(2, _dropout_losses, argv)[0]
    assert first == second


def _rng_streams(rank, world):
    state = ParallelState.build(world, rank, tp=world)
    tracker = build_rng_tracker(1234, state.tp_rank, torch.device("cpu"))
    outside = F.dropout(torch.ones(1000), 0.5)
    with tracker.fork():
        inside = F.dropout(torch.ones(1000), 0.5)
    after = F.dropout(torch.ones(1000), 0.5)                 # the default stream resumes where it was
    return outside, inside, after


def test_rng_tracker_streams_differ_inside_tp_regions_and_match_outside():
    (o0, i0, a0), (o1, i1, a1) = run_ranks(2, _rng_streams)
    assert torch.equal(o0, o1) and torch.equal(a0, a1)
    assert not torch.equal(i0, i1)
    assert not torch.equal(o0, a0)


# ---- recomputation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("recompute", [
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
    {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
    {"recompute_granularity": "selective"},
])
def test_recompute_gives_the_same_losses_and_gradients_with_dropout(recompute):
    from megalite.model.gpt import GPTModel
    from megalite.parallel.tensor.random import build_rng_tracker
    base = with_flags(STYLES["llama"], attention_dropout=0.2, hidden_dropout=0.2, num_layers=3)
    grads = []
    for argv in (base, with_flags(base, **recompute)):
        cfg = parse_args(argv, world_size=1).model
        model = GPTModel(cfg, seed=5, tp=TensorParallel(rng=build_rng_tracker(99, 0, torch.device("cpu"))))
        tokens = torch.randint(0, 201, (2, 32), generator=torch.Generator().manual_seed(3))
        loss = model(tokens, labels=tokens).mean()
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = grads
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=1e-6, rtol=1e-5, msg=name)


def test_rng_tracker_state_round_trip():
    tracker = RNGTracker()
    tracker.add("s", 7)
    snap = tracker.snapshot()
    with tracker.fork("s"):
        first = torch.rand(3)
    tracker.restore(snap)
    with tracker.fork("s"):
        again = torch.rand(3)
    assert torch.equal(first, again)


def test_pretrain_gpt_under_torchrun_with_tp_and_sp():
    from harness import logged_losses, run_pretrain
    argv = with_flags(STYLES["llama"], train_iters=4, num_workers=0)
    serial = run_pretrain(1, argv)
    parallel = run_pretrain(2, with_flags(argv, tensor_model_parallel_size=2, sequence_parallel=True))
    assert serial.returncode == 0 and parallel.returncode == 0, parallel.stderr[-2000:]
    a, b = logged_losses(serial.stdout), logged_losses(parallel.stdout)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert all(abs(a[i] - b[i]) <= 1e-5 * abs(a[i]) for i in a), (a, b)
