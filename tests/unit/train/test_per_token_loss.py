"""One DP=2 spawn checks what data parallelism must not change: ramp-up with overlapped reduction gives
the single-process losses; --calculate-per-token-loss equals a hand computation, sum over every token /
the token count, with unequal counts across micro-batches, data-parallel ranks and pipeline stages;
--grad-reduce-in-bf16 equals the fp32 reduction within bf16 tolerance; the chunked cross-entropy over
TP=2 equals the unfused one."""

import pytest
import torch

from harness import run_ranks
from megalite.train.command_line import parse_args
from megalite.train.trainer import build_trainer, pretrain
from megalite.train.step import train_step
from megalite_test_utils import RAMPUP_ARGS, TINY_LLAMA_ARGS, log_field, masked_micro_batches, run_pretrain, with_flags


PER_TOKEN = with_flags(TINY_LLAMA_ARGS, micro_batch_size=2, global_batch_size=8, clip_grad=0.0, weight_decay=0.0,
                       calculate_per_token_loss=True)


def grads_by_name(trainer) -> dict[str, torch.Tensor]:
    """The reduced gradient of every parameter this rank holds, by global name (no_shard buffers)."""
    out = {}
    for chunk in trainer.chunks:
        for name, param in chunk.named_parameters():
            view = trainer.ddp.grad_views(param)[0][0]
            out[chunk.global_name(name)] = view.view(param.shape).clone()
    return out


def hand_per_token(argv: list[str]) -> tuple[float, dict]:
    """sum over all tokens of the 4 micro-batches of mask * loss / sum of masks, and its gradient."""
    from megalite.model.gpt import GPTModel
    config = parse_args(argv, world_size=1)
    model = GPTModel(config.model, seed=config.training.seed)
    total, count = 0.0, 0.0
    for b in masked_micro_batches():
        per_token = model(b["tokens"], b["position_ids"], labels=b["labels"])
        total = total + (per_token * b["loss_mask"]).sum()
        count += float(b["loss_mask"].sum())
    loss = total / count
    loss.backward()
    return loss.item(), {model.global_name(n): p.grad.clone() for n, p in model.named_parameters()}


def _dp2_checks(rank: int, world: int, ramp_argv: list[str], tmp: str) -> dict:
    out = {}
    # ramp-up at DP 2 with overlapped reduction: the DDP hooks must count each step's micro-batches
    lines = []
    state = pretrain(parse_args(ramp_argv, world_size=2), print_fn=lines.append)
    out["ramp_losses"], out["ramp_log"] = state.history, "\n".join(lines)

    # per-token loss: rank r trains on micro-batches 2r, 2r+1 (token counts 64, 9 | 40, 3)
    trainer = build_trainer(parse_args(PER_TOKEN, world_size=2))
    loss = float(train_step(trainer, iter(masked_micro_batches()[2 * rank:2 * rank + 2]))[0])
    out["per_token"] = (loss, grads_by_name(trainer))

    # the same global batch through 2 pipeline stages (4 micro-batches on one pipeline)
    trainer = build_trainer(parse_args(with_flags(PER_TOKEN, pipeline_model_parallel_size=2), world_size=2))
    loss = float(train_step(trainer, iter(masked_micro_batches()))[0])
    out["per_token_pp"] = (loss, grads_by_name(trainer))

    # --grad-reduce-in-bf16 against the fp32 reduction (bf16 model), replicated and ZeRO-1 optimizer
    for name, extra in (("no_shard", {}), ("optim", {"use_distributed_optimizer": True})):
        reduced = {}
        for bf16_reduce in (False, True):
            argv = with_flags(TINY_LLAMA_ARGS, micro_batch_size=2, global_batch_size=8, bf16=True, clip_grad=0.0,
                              grad_reduce_in_bf16=bf16_reduce, **extra)
            trainer = build_trainer(parse_args(argv, world_size=2))
            train_step(trainer, iter(masked_micro_batches()[2 * rank:2 * rank + 2]))
            reduced[bf16_reduce] = torch.cat([p.grad.clone() for p in trainer.optimizer.pieces])
        out[f"bf16_{name}"] = reduced

    # vocabulary-parallel cross-entropy over TP 2: chunked vs unfused, loss and gradient
    from megalite.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
    g = torch.Generator().manual_seed(5)
    full = (3 * torch.randn(6, 3, 64, generator=g)).to(torch.bfloat16)
    target = torch.randint(0, 64, (6, 3), generator=g)
    weights = torch.randn(6, 3, generator=g)
    group = torch.distributed.new_group([0, 1])
    results = []
    for fused in (False, True):
        shard = full[..., 32 * rank:32 * (rank + 1)].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, target, group, 32 * rank, fused=fused, chunk_tokens=4)
        (loss * weights).sum().backward()
        results.append((loss.detach(), shard.grad.float()))
    out["tp_cross_entropy"] = results
    return out


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    ramp = with_flags(RAMPUP_ARGS, micro_batch_size=2, global_batch_size=16, overlap_grad_reduce=True,
                      ddp_bucket_size=5000, train_iters=5)
    i = ramp.index("--rampup-batch-size")
    ramp[i + 1:i + 4] = ["4", "4", "24"]
    results = run_ranks(2, _dp2_checks, ramp, str(tmp_path_factory.mktemp("dp2")))
    single_state, single_log = run_pretrain(ramp)
    return results, ramp, single_state, single_log


def test_rampup_with_data_parallel_micro_batches_and_overlapped_reduction(dp2):
    """Global batches 4, 4, 8, 12, 16 over 2 ranks in micro-batches of 2 (1, 1, 2, 3, 4 per rank): the
    losses equal one process's, which runs 2, 2, 4, 6, 8 micro-batches."""
    results, _, single_state, single_log = dp2
    log = results[1]["ramp_log"]                       # the last rank logs
    assert [log_field(log, i, "global batch size") for i in range(1, 6)] == [4, 4, 8, 12, 16]
    assert [log_field(single_log, i, "global batch size") for i in range(1, 6)] == [4, 4, 8, 12, 16]
    assert results[0]["ramp_losses"] == pytest.approx(single_state.history, rel=1e-5)


def test_per_token_loss_equals_hand_computation_across_micro_batches_and_dp_ranks(dp2):
    results = dp2[0]
    expected_loss, expected_grads = hand_per_token(PER_TOKEN)
    # the mean of micro-batch means would be far off with token counts 64, 9, 40, 3
    assert abs(expected_loss - _mean_of_means(PER_TOKEN)) > 1e-3
    for key in ("per_token", "per_token_pp"):
        losses = [r[key][0] for r in results]
        grads = {name: g for r in results for name, g in r[key][1].items()}
        assert max(losses) == pytest.approx(expected_loss, rel=1e-5), key      # the last pipeline stage logs
        assert set(grads) == set(expected_grads)
        for name, grad in expected_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=f"{key} {name}")


def _mean_of_means(argv) -> float:
    from megalite.model.gpt import GPTModel
    config = parse_args(argv, world_size=1)
    model = GPTModel(config.model, seed=config.training.seed)
    with torch.no_grad():
        means = [float((model(b["tokens"], b["position_ids"], labels=b["labels"]) * b["loss_mask"]).sum()
                       / b["loss_mask"].sum()) for b in masked_micro_batches()]
    return sum(means) / len(means)


def test_per_token_loss_single_process_equals_hand_computation():
    trainer = build_trainer(parse_args(PER_TOKEN, world_size=1))
    loss = float(train_step(trainer, iter(masked_micro_batches()))[0])
    expected_loss, expected_grads = hand_per_token(PER_TOKEN)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    grads = grads_by_name(trainer)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_grad_reduce_in_bf16_equals_fp32_reduction_within_bf16_tolerance(dp2, strategy):
    """At DP 2 the reduced gradients the optimizer reads agree with the fp32 reduction to bf16 precision
    (as a whole: where the two ranks' gradients cancel, an element's relative error is unbounded), and
    were reduced in bf16: each is (a bf16 sum) / 2, itself a bf16 number."""
    for rank_result in dp2[0]:
        fp32, bf16 = rank_result[f"bf16_{strategy}"][False], rank_result[f"bf16_{strategy}"][True]
        assert float((bf16 - fp32).norm() / fp32.norm()) < 2 ** -7         # bf16 keeps 8 significant bits
        assert torch.equal(bf16, bf16.bfloat16().float()), "the reduction did not run in bf16"
        assert not torch.equal(fp32, fp32.bfloat16().float())          # the fp32 reduction is finer


def test_chunked_cross_entropy_over_tensor_parallel_ranks_equals_unfused(dp2):
    for (loss, grad), (fused_loss, fused_grad) in (r["tp_cross_entropy"] for r in dp2[0]):
        torch.testing.assert_close(fused_loss, loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused_grad, grad, rtol=1e-2, atol=1e-6)   # both rounded to bf16 once
