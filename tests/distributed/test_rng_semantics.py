"""Dropout RNG as Megatron-LM draws it: per-stage seeds (--seed + 100 x pipeline rank), the model-parallel
stream (that seed + 2718 + TP rank), hidden dropout the same on TP ranks without sequence parallelism
and different per rank with it (the layer stack runs under the model-parallel fork), recomputation that
replays the masks under sequence parallelism, and checkpoints with dropout that resume at another layout."""
import math
import os

import torch

from harness import logged_losses, run_pretrain, run_ranks
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.parallel.tensor.random import MODEL_PARALLEL_RNG, RNGTracker

SEED = 1234
# TP2 x PP2 on 4 ranks; 2 layers (one per stage), hidden dropout only (masks recorded per layer)
ARGV = with_flags(TINY_LLAMA_ARGS, seed=SEED, hidden_dropout=0.5, attention_dropout=0.0,
                  tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
RECOMPUTE = [{"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
             {"recompute_granularity": "selective"}]


def _recording_dropout(masks: list):
    def dropout(x, p, training):
        if not training or p == 0:
            return x
        out, mask = torch.native_dropout(x, p, True)
        masks.append(mask)
        return out
    return dropout


def _whole_model(argv, parallel, sequence_parallel: bool):
    """The whole model (both layers) at this rank's TP rank, seeded as its pipeline stage seeds."""
    from megalite.parallel.initialize import set_seed
    from megalite.model.gpt import GPTModel
    from megalite.parallel.tensor.setup import build_tensor_parallel
    cfg = parse_args(with_flags(argv, pipeline_model_parallel_size=None), world_size=2).model
    seed = set_seed(SEED, parallel.pp_rank)
    tp = build_tensor_parallel(parallel, sequence_parallel, seed, torch.device("cpu"), cfg.num_query_groups)
    return GPTModel(cfg, seed=5, tp=tp).train()


def _hidden_masks(argv, parallel, sequence_parallel: bool):
    import megalite.model.transformer as transformer
    model = _whole_model(argv, parallel, sequence_parallel)
    masks, original = [], transformer.dropout
    transformer.dropout = _recording_dropout(masks)
    try:
        tokens = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(3))
        model(tokens, labels=tokens).sum().backward()
    finally:
        transformer.dropout = original
    return masks, torch.get_rng_state()


def _loss_and_grads(argv, parallel):
    model = _whole_model(argv, parallel, sequence_parallel=True)
    tokens = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(3))
    loss = model(tokens, labels=tokens).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rng_checks(rank, world):
    from megalite.train.trainer import build_trainer
    config = parse_args(with_flags(ARGV, sequence_parallel=True), world_size=world)
    trainer = build_trainer(config, print_fn=lambda *_: None)
    p = trainer.parallel
    out = {"tp": p.tp_rank, "pp": p.pp_rank, "initial_seed": torch.initial_seed(),
           "stream": trainer.model.tp.rng.states[MODEL_PARALLEL_RNG].clone()}
    out["sp"] = _hidden_masks(ARGV, p, sequence_parallel=True)
    out["no_sp"] = _hidden_masks(ARGV, p, sequence_parallel=False)
    base = with_flags(ARGV, attention_dropout=0.2, hidden_dropout=0.2)
    out["recompute"] = []
    for flags in RECOMPUTE:
        (loss_a, grads_a), (loss_b, grads_b) = _loss_and_grads(base, p), _loss_and_grads(with_flags(base, **flags), p)
        out["recompute"].append((flags, torch.equal(loss_a, loss_b),
                                 max((grads_a[n] - grads_b[n]).abs().max().item() for n in grads_a)))
    return out


def test_dropout_streams_follow_megatron_at_tp2_pp2():
    results = run_ranks(4, _rng_checks)
    by_place = {(r["pp"], r["tp"]): r for r in results}
    assert sorted(by_place) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for (pp, tp), r in by_place.items():
        # the stage's seed drives Python/NumPy/torch; its model-parallel stream is that + 2718 + tp
        assert r["initial_seed"] == SEED + 100 * pp
        assert torch.equal(r["stream"], torch.Generator().manual_seed(SEED + 100 * pp + 2718 + tp).get_state())
    for pp in (0, 1):
        (sp0, default0), (sp1, default1) = by_place[pp, 0]["sp"], by_place[pp, 1]["sp"]
        assert len(sp0) == 4 and sp0[0].shape == (16, 2, 64)           # 2 layers x 2 dropouts, [s/tp, b, h]
        # sequence parallelism: each TP rank draws its own mask for its own sequence shard ...
        assert all(not torch.equal(a, b) for a, b in zip(sp0, sp1))
        # ... from the model-parallel stream: the default stream the TP ranks share stays in step
        assert torch.equal(default0, default1)
        no_sp0, no_sp1 = by_place[pp, 0]["no_sp"][0], by_place[pp, 1]["no_sp"][0]
        assert no_sp0[0].shape == (32, 2, 64)
        # without it the activations are replicated, and so is the mask
        assert all(torch.equal(a, b) for a, b in zip(no_sp0, no_sp1))
    # pipeline stages draw from different seeds
    assert not torch.equal(by_place[0, 0]["no_sp"][0][0], by_place[1, 0]["no_sp"][0][0])
    for r in results:
        for flags, same_loss, worst in r["recompute"]:
            assert same_loss and worst <= 1e-6, (flags, worst)


def test_a_nested_fork_of_the_same_stream_continues_it():
    tracker = RNGTracker()
    tracker.add("s", 7)
    with tracker.fork("s"):
        first = torch.rand(3)
        with tracker.fork("s"):
            second = torch.rand(3)
        third = torch.rand(3)
    reference = torch.Generator().manual_seed(7)
    assert torch.equal(torch.cat([first, second, third]), torch.rand(9, generator=reference))
    assert tracker.active is None


def test_rng_states_saved_on_another_kind_of_device_are_skipped():
    from types import SimpleNamespace
    from megalite.checkpoint.sharded import layout_of, saved_rng
    tracker = RNGTracker()
    tracker.add(MODEL_PARALLEL_RNG, 1)
    parallel = SimpleNamespace(rank=0, world_size=1, tp_size=1, pp_size=1, cp_size=1, dp_size=1)
    run = SimpleNamespace(parallel=parallel, chunks=[None], rng=tracker,        # what a CheckpointState holds
                          config=SimpleNamespace(parallel=SimpleNamespace(data_parallel_sharding_strategy="no_shard")))
    cuda_state = torch.zeros(16, dtype=torch.uint8)               # a CUDA generator's (seed, offset)
    saved = {"cpu": torch.get_rng_state(), f"tracker.{MODEL_PARALLEL_RNG}": cuda_state}
    reader = SimpleNamespace(metadata={"layout": layout_of(run)}, rng_tensors=lambda name: saved)
    assert saved_rng(reader, run) == (None, "it was saved on another kind of device")
    saved[f"tracker.{MODEL_PARALLEL_RNG}"] = tracker.states[MODEL_PARALLEL_RNG].clone()
    assert saved_rng(reader, run)[0] is saved
    reader.metadata = {"layout": {**layout_of(run), "tensor_model_parallel_size": 2}}
    assert saved_rng(reader, run) == (None, "the layout differs")


def test_a_checkpoint_with_dropout_resumes_at_its_own_and_at_another_layout(tmp_path):
    """Saved at TP2 x PP2 with --sequence-parallel and dropout: at the same layout the RNG states come
    back and the losses repeat bitwise; at TP1 x PP1 the run loads, says the RNG state was not restored,
    and trains on."""
    save = str(tmp_path / "ck")
    argv = with_flags(ARGV, sequence_parallel=True, attention_dropout=0.1, hidden_dropout=0.1, train_iters=4)
    full = run_pretrain(4, argv + ["--save", save, "--save-interval", "2"])
    assert full.returncode == 0, full.stderr[-3000:]
    start = ["--load", os.path.join(save, "iter_0000002")]
    same = run_pretrain(4, argv + start)
    assert same.returncode == 0, same.stderr[-3000:]
    assert "loaded checkpoint" in same.stdout and "RNG state not restored" not in same.stdout
    full_losses, same_losses = logged_losses(full.stdout), logged_losses(same.stdout)
    assert sorted(same_losses) == [3, 4] and all(same_losses[i] == full_losses[i] for i in same_losses)
    serial = with_flags(argv, tensor_model_parallel_size=None, pipeline_model_parallel_size=None,
                        sequence_parallel=None)
    other = run_pretrain(1, serial + start)
    assert other.returncode == 0, other.stderr[-3000:]
    assert ("RNG state not restored: the layout differs; dropout masks start again from --seed"
            in other.stdout), other.stdout[-2000:]
    losses = logged_losses(other.stdout)
    assert sorted(losses) == [3, 4] and all(math.isfinite(v) for v in losses.values())
