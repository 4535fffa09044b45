"""The meaning of each Megatron flag added for issue 18 (Megatron-LM's own launch scripts).

- --rampup-batch-size / --step-batch-size-schedule: batch sizes by consumed samples equal Megatron's
  calculator (with data parallelism and micro-batches), the run's logged batch sizes, learning rates
  (Megatron steps its schedule by samples) and an exact resume from a mid-ramp checkpoint; DP=2 with
  overlapped reduction gives the single-process losses.
- --calculate-per-token-loss: loss and gradients equal a hand computation, sum over every token / the
  token count, with unequal counts across micro-batches and data-parallel ranks (and pipeline stages).
- --apply-layernorm-1p and --rotary-percent: logits equal transformers' after conversion both ways.
- --grad-reduce-in-bf16: DP=2 gradients equal the fp32 reduction within bf16 tolerance.
- --cross-entropy-loss-fusion: the chunked loss equals the unfused one (TP=1 and TP=2) and its peak
  memory is far below it.
- --log-params-norm / --log-num-zeros-in-grad / --log-timers-to-tensorboard: values, and fields in the
  stdout line, JSONL, tensorboard and wandb.
- --no-mmap-bin-files, --manual-gc(-interval), --empty-unused-memory-level, and the flags accepted
  with a start-up line (kernel choices, --ckpt-format, fp8, --tiktoken-pattern).
"""
import copy
import glob
import json
import os
import pickle
import sys

import numpy as np
import pytest
import torch

from harness import run_ranks
from megalite.config.arguments import parse_args, startup_notes
from megalite.errors import UserError
from megalite.train.training import build_trainer, optional_norms, pretrain, train_step
from megalite_test_utils import ROOT, TINY_LLAMA_ARGS, wandb_offline_history, with_flags

transformers = pytest.importorskip("transformers")


def run(argv: list[str], world_size: int = 1) -> tuple[object, str]:
    """pretrain in this process; (TrainState, its log)."""
    lines = []
    state = pretrain(parse_args(argv, world_size=world_size), print_fn=lines.append)
    return state, "\n".join(lines)


def field(log: str, iteration: int, name: str) -> float:
    for line in log.splitlines():
        if f" iteration {iteration:8d}/" in line:
            return float(line.split(f" {name}: ")[1].split(" |")[0])
    raise AssertionError(f"no line for iteration {iteration}")


# ==================================================================================================
# --rampup-batch-size
# ==================================================================================================
class MegatronRampup:
    """Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator.update and update_train_iters, as written
    there (float division included), for reference."""

    def __init__(self, start, increment, samples, global_batch_size, micro_batch_size, dp):
        self.start, self.increment, self.samples, self.gbs = start, increment, samples, global_batch_size
        self.unit = micro_batch_size * dp
        self.per_increment = samples / ((global_batch_size - start) // increment)

    def batch(self, consumed: int) -> int:
        if consumed > self.samples:
            return self.gbs
        return self.start + int(consumed / self.per_increment) * self.increment

    def train_iters(self, train_samples: int) -> int:
        iterations = consumed = 0
        while consumed <= self.samples and consumed <= train_samples:
            consumed += self.batch(consumed)
            iterations += 1
        return iterations + max(0, train_samples - consumed) // self.gbs


@pytest.mark.parametrize("start, increment, samples, gbs, mbs, world", [
    (16, 16, 5859375, 1536, 1, 1),         # GPT-3 175B's
    (2, 2, 12, 8, 1, 1),
    (4, 4, 100, 32, 2, 2),                 # micro-batches of 2 on 2 data-parallel ranks
    (6, 12, 50, 42, 3, 2),
])
def test_rampup_batch_sizes_and_iterations_equal_megatrons(start, increment, samples, gbs, mbs, world):
    argv = with_flags(TINY_LLAMA_ARGS, micro_batch_size=mbs, global_batch_size=gbs, train_iters=None,
                      train_samples=samples * 3 + 5)
    argv += ["--rampup-batch-size", str(start), str(increment), str(samples)]
    config = parse_args(argv, world_size=world)
    megatron = MegatronRampup(start, increment, samples, gbs, mbs, world)
    consumed = 0
    while consumed <= samples + gbs:
        assert config.global_batch_size_at(consumed) == megatron.batch(consumed), consumed
        assert config.num_microbatches_at(consumed) == megatron.batch(consumed) // (mbs * world)
        consumed += megatron.batch(consumed)
    # every sample count next to a step of the ramp, not only those a run reaches
    for threshold, _ in config.training.batch_size_schedule:
        for count in (threshold - 1, threshold, threshold + 1):
            if count >= 0:
                assert config.global_batch_size_at(count) == megatron.batch(count), count
    assert config.training.train_iters == megatron.train_iters(samples * 3 + 5)


@pytest.mark.parametrize("rampup, world, fragment", [
    (("2", "3", "12"), 2, "--rampup-batch-size: the global batch size 5 (from sample 6) is not divisible by "
                          "--micro-batch-size 1 x data-parallel size 2"),
    (("2", "4", "12"), 1, "--global-batch-size 8 must be START plus a whole number of INCREMENTs"),
    (("0", "2", "12"), 1, "the start size and the increment must be >= 1"),
])
def test_rampup_mistakes_are_one_line_errors(rampup, world, fragment):
    argv = with_flags(TINY_LLAMA_ARGS, micro_batch_size=1, global_batch_size=8) + ["--rampup-batch-size", *rampup]
    with pytest.raises(UserError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        parse_args(argv, world_size=world)


def test_step_batch_size_schedule_mistakes():
    base = with_flags(TINY_LLAMA_ARGS, micro_batch_size=1, global_batch_size=None)
    with pytest.raises(UserError, match="must start with a batch size at threshold 0"):
        parse_args(base + ["--step-batch-size-schedule", "32:2 64:4"], world_size=1)
    with pytest.raises(UserError, match="differs from the last batch size 4"):
        parse_args(with_flags(base, global_batch_size=8) + ["--step-batch-size-schedule", "0:2 64:4"], world_size=1)
    config = parse_args(base + ["--step-batch-size-schedule", "0:2 3.2K:4"], world_size=1)   # tokens: 100 samples
    assert config.training.batch_size_schedule == [(0, 2), (100, 4)] and config.training.global_batch_size == 4


RAMPUP = with_flags(TINY_LLAMA_ARGS, micro_batch_size=1, global_batch_size=8, train_iters=8, lr_warmup_iters=2,
                    lr_decay_iters=6, lr_decay_style="linear", lr="1e-3", min_lr="1e-4") + \
    ["--rampup-batch-size", "2", "2", "12"]


def megatron_lr(samples: float) -> float:
    """Megatron's schedule for RAMPUP, counted in samples: warm-up 2 x 8, decay 6 x 8 samples."""
    warmup, decay, peak, low = 16, 48, 1e-3, 1e-4
    if samples <= warmup:
        return peak * samples / warmup
    if samples > decay:
        return low
    return low + (peak - low) * (1 - (samples - warmup) / (decay - warmup))


def test_rampup_run_batch_sizes_learning_rates_and_exact_resume(tmp_path):
    """Batches 2, 2, 4, 6, 8...; each logged learning rate is Megatron's at the samples consumed (the
    schedule advances by batch / global batch per update); a run stopped after iteration 2 (half a full
    batch into the schedule) and resumed repeats the uninterrupted run's losses and learning rates."""
    full_state, full = run(RAMPUP)
    assert [field(full, i, "global batch size") for i in range(1, 9)] == [2, 2, 4, 6, 8, 8, 8, 8]
    consumed = [field(full, i, "consumed samples") for i in range(1, 9)]
    assert consumed == [2, 4, 8, 14, 22, 30, 38, 46]
    for i, samples in enumerate(consumed, start=1):
        assert field(full, i, "learning rate") == pytest.approx(megatron_lr(samples), rel=1e-5), i

    ckpt = str(tmp_path / "ckpt")
    run(with_flags(RAMPUP, train_iters=2, save=ckpt))
    resumed_state, resumed = run(with_flags(RAMPUP, load=ckpt))
    assert resumed_state.history == full_state.history[2:]            # bit for bit (same layout, RNG restored)
    for i in range(3, 9):
        assert field(resumed, i, "learning rate") == field(full, i, "learning rate")
        assert field(resumed, i, "global batch size") == field(full, i, "global batch size")


# ==================================================================================================
# DP = 2 (one spawn): ramp-up with overlapped reduction, per-token loss, bf16 reduction, TP=2 loss
# ==================================================================================================
SEQ, VOCAB = 32, 200
TOKEN_COUNTS = [64, 9, 40, 3]          # of 2 x 32 tokens in each of the 4 micro-batches


def micro_batches() -> list[dict]:
    """4 micro-batches of 2 sequences whose loss masks keep TOKEN_COUNTS tokens."""
    g = torch.Generator().manual_seed(3)
    out = []
    for count in TOKEN_COUNTS:
        mask = torch.zeros(2 * SEQ)
        mask[torch.randperm(2 * SEQ, generator=g)[:count]] = 1.0
        out.append({"tokens": torch.randint(0, VOCAB, (2, SEQ), generator=g),
                    "labels": torch.randint(0, VOCAB, (2, SEQ), generator=g),
                    "loss_mask": mask.view(2, SEQ), "position_ids": torch.arange(SEQ).expand(2, SEQ)})
    return out


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
    for b in micro_batches():
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
    loss, _ = train_step(trainer, iter(micro_batches()[2 * rank:2 * rank + 2]))
    out["per_token"] = (loss, grads_by_name(trainer))

    # the same global batch through 2 pipeline stages (4 micro-batches on one pipeline)
    trainer = build_trainer(parse_args(with_flags(PER_TOKEN, pipeline_model_parallel_size=2), world_size=2))
    loss, _ = train_step(trainer, iter(micro_batches()))
    out["per_token_pp"] = (loss, grads_by_name(trainer))

    # --grad-reduce-in-bf16 against the fp32 reduction (bf16 model), replicated and ZeRO-1 optimizer
    for name, extra in (("no_shard", {}), ("optim", {"use_distributed_optimizer": True})):
        reduced = {}
        for bf16_reduce in (False, True):
            argv = with_flags(TINY_LLAMA_ARGS, micro_batch_size=2, global_batch_size=8, bf16=True, clip_grad=0.0,
                              grad_reduce_in_bf16=bf16_reduce, **extra)
            trainer = build_trainer(parse_args(argv, world_size=2))
            train_step(trainer, iter(micro_batches()[2 * rank:2 * rank + 2]))
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
    ramp = with_flags(RAMPUP, micro_batch_size=2, global_batch_size=16, overlap_grad_reduce=True,
                      ddp_bucket_size=5000, train_iters=5)
    i = ramp.index("--rampup-batch-size")
    ramp[i + 1:i + 4] = ["4", "4", "24"]
    results = run_ranks(2, _dp2_checks, ramp, str(tmp_path_factory.mktemp("dp2")))
    single_state, single_log = run(ramp)
    return results, ramp, single_state, single_log


def test_rampup_with_data_parallel_micro_batches_and_overlapped_reduction(dp2):
    """Global batches 4, 4, 8, 12, 16 over 2 ranks in micro-batches of 2 (1, 1, 2, 3, 4 per rank): the
    losses equal one process's, which runs 2, 2, 4, 6, 8 micro-batches."""
    results, _, single_state, single_log = dp2
    log = results[1]["ramp_log"]                       # the last rank logs
    assert [field(log, i, "global batch size") for i in range(1, 6)] == [4, 4, 8, 12, 16]
    assert [field(single_log, i, "global batch size") for i in range(1, 6)] == [4, 4, 8, 12, 16]
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
                       / b["loss_mask"].sum()) for b in micro_batches()]
    return sum(means) / len(means)


def test_per_token_loss_single_process_equals_hand_computation():
    trainer = build_trainer(parse_args(PER_TOKEN, world_size=1))
    loss, _ = train_step(trainer, iter(micro_batches()))
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


# ==================================================================================================
# --cross-entropy-loss-fusion
# ==================================================================================================
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_chunked_cross_entropy_equals_unfused(dtype, chunk):
    from megalite.model.gpt import mask_padded_vocabulary
    from megalite.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(7, 3, 96, generator=g)).to(dtype)
    mask_padded_vocabulary(logits, 0, 90)                  # padding ids at -inf, as the model does
    target = torch.randint(0, 90, (7, 3), generator=g)
    weights = torch.randn(7, 3, generator=g)
    outs = []
    for fused in (False, True):
        x = logits.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(x, target, None, 0, fused=fused, chunk_tokens=chunk)
        (loss * weights).sum().backward()
        assert loss.dtype == torch.float32 and x.grad.dtype == dtype
        outs.append((loss, x.grad.float()))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)


def test_model_with_cross_entropy_loss_fusion_gives_the_same_loss_and_gradients():
    from megalite.model.gpt import GPTModel
    batch = micro_batches()[0]
    results = []
    for fusion in (False, True):
        config = parse_args(with_flags(TINY_LLAMA_ARGS, cross_entropy_loss_fusion=fusion), world_size=1)
        model = GPTModel(config.model, seed=1)
        loss = model(batch["tokens"], batch["position_ids"], labels=batch["labels"]).mean()
        loss.backward()
        results.append((loss, [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0])
    for fused, plain in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-7)


def test_chunked_cross_entropy_peak_memory_is_a_fraction_of_unfused():
    """bf16 logits [tokens, V]: unfused holds fp32 copies of the whole (upcast, log-softmax, gradient),
    at least 4x the logits' bytes; chunked holds the bf16 gradient and a few fp32 chunks."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from cross_entropy_memory import cross_entropy_memory
    tokens, vocab, chunk = 256, 4096, 32
    r = cross_entropy_memory(tokens, vocab, torch.bfloat16, chunk_tokens=chunk)
    chunk_fp32 = chunk * vocab * 4
    assert r["unfused peak bytes"] >= 4 * r["logits bytes"]
    assert r["fused peak bytes"] <= r["logits bytes"] + 4 * chunk_fp32 + 64 * tokens
    assert r["saved bytes"] > 0.5 * r["unfused peak bytes"]


# ==================================================================================================
# --apply-layernorm-1p and --rotary-percent (against transformers)
# ==================================================================================================
def test_zero_centred_norms_scale_by_weight_plus_one():
    from megalite.model.transformer import LayerNorm, RMSNorm
    x = torch.randn(5, 2, 16)
    w = torch.randn(16)
    for cls in (RMSNorm, LayerNorm):
        plain, one_p = cls(16, 1e-5, torch.float32), cls(16, 1e-5, torch.float32, zero_centered=True)
        assert torch.equal(one_p.weight, torch.zeros(16))
        with torch.no_grad():
            plain.weight.copy_(w + 1)
            one_p.weight.copy_(w)
        for p in (plain, one_p):
            p.requires_grad_(True)
        torch.testing.assert_close(one_p(x), plain(x))
        one_p(x).sum().backward()
        plain(x).sum().backward()
        torch.testing.assert_close(one_p.weight.grad, plain.weight.grad)
    # a whole model: the 1p norms start at 0 and compute as the plain model's 1s
    from megalite.model.gpt import GPTModel
    b = micro_batches()[0]
    logits = []
    for one_p in (False, True):
        model = GPTModel(parse_args(with_flags(TINY_LLAMA_ARGS, apply_layernorm_1p=one_p), world_size=1).model, seed=2)
        norms = [p for n, p in model.named_parameters() if "layernorm.weight" in n]
        assert all(torch.all(p == (0.0 if one_p else 1.0)) for p in norms)
        logits.append(model(b["tokens"], b["position_ids"]))
    torch.testing.assert_close(logits[1], logits[0])


def _hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(ids).logits


def _randomise_norms(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((0.0 if name.endswith("bias") else 1.0) + 0.3 * torch.randn(p.shape, generator=g))


def _as_layernorm_1p(ckpt: str, out: str) -> None:
    """A copy of a megalite checkpoint stored the --apply-layernorm-1p way: norm weights - 1, flag set."""
    from megalite.checkpoint.files import CheckpointReader, write_checkpoint
    reader = CheckpointReader(ckpt)
    tensors = {n: reader.tensor(n) for n in reader.names()}
    for name in tensors:
        if "layernorm.weight" in name:
            tensors[name] = tensors[name] - 1.0
    meta = copy.deepcopy(reader.metadata)
    meta["model"]["apply_layernorm_1p"] = True
    meta.pop("tensors")
    write_checkpoint(out, 0, {"model-00000.safetensors": tensors}, meta)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_layernorm_1p_logits_match_transformers_and_export_folds_the_one(tmp_path, family):
    """An HF model whose norms megalite stores zero-centred (--apply-layernorm-1p) gives HF's logits, and
    exports (folding + 1 back into the weights) to the same HF model, tensor for tensor."""
    from safetensors.torch import load_file
    from megalite.checkpoint.sharded import load_model
    from megalite.checkpoint.hf import hf_to_megalite, megalite_to_hf
    if family == "llama":
        cls, config = transformers.LlamaForCausalLM, transformers.LlamaConfig(
            vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    else:
        cls, config = transformers.GPT2LMHeadModel, transformers.GPT2Config(
            vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    hf = cls(config).eval()
    _randomise_norms(hf)
    hf.save_pretrained(tmp_path / "hf")
    hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "plain"))
    _as_layernorm_1p(str(tmp_path / "plain"), str(tmp_path / "one_p"))
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))

    model = load_model(str(tmp_path / "one_p"))
    assert model.config.apply_layernorm_1p
    torch.testing.assert_close(model(ids), _hf_logits(hf, ids), rtol=1e-4, atol=1e-4)
    megalite_to_hf(str(tmp_path / "one_p"), str(tmp_path / "hf_out"))
    exported = load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for name in original:
        if name in exported and ("norm" in name or ".ln_" in name):
            torch.testing.assert_close(exported[name], original[name], rtol=0, atol=1e-6, msg=name)
    again = cls.from_pretrained(str(tmp_path / "hf_out")).eval()
    torch.testing.assert_close(_hf_logits(again, ids), _hf_logits(hf, ids), rtol=1e-4, atol=1e-4)


PHI3 = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)


def test_partial_rotary_logits_match_transformers_both_ways(tmp_path):
    """--rotary-percent 0.5 is Phi-3's partial_rotary_factor 0.5 (transformers' Llama ignores the factor):
    HF -> megalite gives HF's logits with rotary_percent 0.5, and megalite -> HF gives back the model."""
    from megalite.checkpoint.sharded import load_model
    from megalite.checkpoint.hf import hf_to_megalite, megalite_to_hf
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(**PHI3, partial_rotary_factor=0.5)).eval()
    _randomise_norms(hf)
    hf.save_pretrained(tmp_path / "hf")
    hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    model = load_model(str(tmp_path / "ckpt"))
    assert model.config.rotary_percent == 0.5
    torch.testing.assert_close(model(ids), _hf_logits(hf, ids), rtol=1e-4, atol=1e-4)

    # the factor matters: the same weights with full rotary give other logits
    full = transformers.Phi3ForCausalLM(transformers.Phi3Config(**PHI3, partial_rotary_factor=1.0)).eval()
    full.load_state_dict(hf.state_dict())
    assert (_hf_logits(full, ids) - _hf_logits(hf, ids)).abs().max() > 1e-3

    megalite_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf_out"))          # default family: phi3
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_out")).eval()
    assert again.config.model_type == "phi3" and again.config.rope_parameters["partial_rotary_factor"] == 0.5
    torch.testing.assert_close(_hf_logits(again, ids), _hf_logits(hf, ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(UserError, match="use --model-type phi3"):
        megalite_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "as_llama"), model_type="llama")


def test_trained_partial_rotary_model_exports_to_phi3_with_its_logits(tmp_path):
    """A model trained by pretrain_gpt.py with --rotary-percent 0.5 --apply-layernorm-1p exports to an HF
    Phi-3 whose logits are megalite's."""
    from megalite.checkpoint.sharded import load_model
    from megalite.checkpoint.hf import megalite_to_hf
    ckpt = str(tmp_path / "ckpt")
    run(with_flags(TINY_LLAMA_ARGS, rotary_percent=0.5, apply_layernorm_1p=True, train_iters=3, save=ckpt))
    megalite_to_hf(ckpt, str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(1))
    ours = load_model(ckpt)(ids)
    torch.testing.assert_close(_hf_logits(hf, ids), ours, rtol=1e-4, atol=1e-4)


def test_partial_rotary_rotates_only_the_leading_dimensions():
    from megalite.model.transformer import RotaryEmbedding, apply_rotary
    x = torch.randn(10, 1, 2, 16)
    half = RotaryEmbedding(16, 10000.0, 10, rotary_percent=0.5)
    whole8 = RotaryEmbedding(8, 10000.0, 10)                   # RoPE over 8 dimensions
    out = apply_rotary(x, *half.tables(None, 10, x.dtype))
    assert torch.equal(out[..., 8:], x[..., 8:])
    torch.testing.assert_close(out[..., :8], apply_rotary(x[..., :8], *whole8.tables(None, 10, x.dtype)))


@pytest.mark.parametrize("percent, extra, fragment", [
    ("0", {}, "--rotary-percent must be in (0, 1]"),
    ("1.5", {}, "--rotary-percent must be in (0, 1]"),
    ("0.2", {}, "rotates 3 of the head's 16 dimensions"),          # int(16 * 0.2): odd
    ("0.5", {"position_embedding_type": "learned_absolute"}, "needs --position-embedding-type rope"),
])
def test_rotary_percent_mistakes(percent, extra, fragment):
    argv = with_flags(TINY_LLAMA_ARGS, rotary_percent=percent, **extra)
    with pytest.raises(UserError, match=fragment.replace("(", r"\(").replace("]", r"\]")):
        parse_args(argv, world_size=1)


# ==================================================================================================
# --log-params-norm, --log-num-zeros-in-grad, --log-timers-to-tensorboard
# ==================================================================================================
def test_params_norm_and_num_zeros_values():
    """The whole model's parameter L2 norm and count of zero gradient elements (the padded vocabulary
    rows of the embedding and output layer, 56 x 64 each, get no gradient)."""
    argv = with_flags(TINY_LLAMA_ARGS, log_params_norm=True, log_num_zeros_in_grad=True)
    trainer = build_trainer(parse_args(argv, world_size=1))
    train_step(trainer, iter(micro_batches()[:2]))
    norms = optional_norms(trainer)
    params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    assert norms["params norm"] == pytest.approx(float(params.norm()), rel=1e-6)
    assert norms["num zeros"] == float((trainer.buffer.grad_data == 0).sum())
    assert norms["num zeros"] >= 2 * 56 * 64


def test_log_fields_in_stdout_jsonl_tensorboard_and_wandb(tmp_path):
    pytest.importorskip("wandb")
    os.environ["WANDB_MODE"] = "offline"
    argv = with_flags(TINY_LLAMA_ARGS, train_iters=4, log_interval=2, log_params_norm=True, log_num_zeros_in_grad=True,
                      log_timers_to_tensorboard=True, timing_log_level=1, tensorboard_dir=str(tmp_path / "tb"),
                      wandb_project="megalite-test", wandb_save_dir=str(tmp_path / "wandb"))
    _, log = run(argv)
    line = [l for l in log.splitlines() if f" iteration {4:8d}/" in l][0]
    # Megatron's order: ... grad norm | num zeros | params norm | number of skipped iterations ...
    assert line.index("| grad norm: ") < line.index("| num zeros: ") < line.index("| params norm: ") \
        < line.index("| number of skipped iterations:")
    records = [json.loads(l) for l in open(tmp_path / "tb" / "metrics.jsonl")]
    assert [r["iteration"] for r in records] == [2, 4]
    for r in records:
        assert r["params norm"] > 0 and r["num zeros"] >= 0 and r["iteration-time"] > 0
        assert r["time forward-backward (ms)"] > 0
    assert records[-1]["params norm"] == pytest.approx(field(log, 4, "params norm"), abs=1e-3)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    scalars = EventAccumulator(glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))[0])
    scalars.Reload()
    for key in ("params norm", "num zeros", "iteration-time", "time forward-backward (ms)"):
        assert [e.step for e in scalars.Scalars(key)] == [2, 4], key
    content = wandb_offline_history(str(tmp_path / "wandb"))
    for r in records:       # values are stored as JSON text (a whole float as an integer)
        assert repr(r["params norm"]).encode() in content and b"%d" % r["num zeros"] in content
    assert b"num zeros" in content and b"iteration-time" in content


# ==================================================================================================
# --no-mmap-bin-files, --manual-gc, --empty-unused-memory-level, accepted flags
# ==================================================================================================
def test_no_mmap_bin_files_reads_the_same_tokens_without_mapping(tmp_path):
    from megalite.config.schema import DataConfig
    from megalite.data.builder import _Builder
    from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix, dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(20):
        builder.add_document(rng.integers(0, 500, size=int(rng.integers(1, 50))))
    builder.finalize()
    mapped, read = IndexedDataset(prefix), IndexedDataset(prefix, mmap=False)
    assert read._bin is None and isinstance(mapped._bin, np.memmap)
    for i in range(len(mapped)):
        assert np.array_equal(read[i], mapped[i])
        assert np.array_equal(read.get(i, 1, max(0, len(mapped[i]) - 2)), mapped.get(i, 1, max(0, len(mapped[i]) - 2)))
    assert all(np.array_equal(a, b) for a, b in zip(read[3:9], mapped[3:9]))
    assert (read.max_token(), read.max_token(64), read.min_token()) == \
        (mapped.max_token(), mapped.max_token(64), mapped.min_token())
    assert pickle.loads(pickle.dumps(read)).mmap is False           # DataLoader workers keep the choice
    data = DataConfig(data_path=[prefix], mmap_bin_files=False)
    tok = type("Tok", (), {"vocab_size": 600, "eod": 599})()
    assert _Builder(data, tok, 1, verbose=False).indexed(prefix).mmap is False


class RecordingGC:
    def __init__(self):
        self.calls = []
        self.iteration = lambda: None

    def disable(self):
        self.calls.append("disable")

    def enable(self):
        self.calls.append("enable")

    def collect(self):
        self.calls.append(f"collect@{self.iteration()}")


def test_manual_gc_collects_only_at_the_interval_and_around_evaluation(monkeypatch):
    import megalite.train.training as training
    recorder = RecordingGC()
    monkeypatch.setattr(training, "gc", recorder)
    seen = []
    original = training.train_step

    def step(trainer, data):
        recorder.iteration = lambda: trainer.state.iteration
        seen.append(trainer.state.iteration)
        return original(trainer, data)
    monkeypatch.setattr(training, "train_step", step)
    run(with_flags(TINY_LLAMA_ARGS, train_iters=4, manual_gc=True, manual_gc_interval=2, eval_interval=3,
                   eval_iters=1))
    # start: disable + collect; iterations 2 and 4; evaluation at 3 and at the end: before and after
    assert recorder.calls == ["disable", "collect@None", "collect@2", "collect@3", "collect@3", "collect@4",
                              "enable", "collect@4", "collect@4", "collect@4", "collect@4"]
    recorder.calls.clear()
    recorder.iteration = lambda: None
    run(with_flags(TINY_LLAMA_ARGS, train_iters=2, manual_gc=True, no_manual_gc_eval=True, eval_iters=1))
    assert recorder.calls == ["disable", "collect@None", "enable"]
    with pytest.raises(UserError, match="--manual-gc-interval needs --manual-gc"):
        parse_args(with_flags(TINY_LLAMA_ARGS, manual_gc_interval=2), world_size=1)


def test_empty_unused_memory_level(monkeypatch):
    import megalite.train.training as training
    calls = []
    monkeypatch.setattr(training, "release_cached_memory", lambda device: calls.append(device.type))
    for level, expected in ((0, 0), (1, 2), (2, 4)):
        calls.clear()
        run(with_flags(TINY_LLAMA_ARGS, train_iters=2, empty_unused_memory_level=level))
        assert len(calls) == expected, level               # after forward-backward (1), and after the step (2)
    monkeypatch.undo()

    def no_cuda():
        raise AssertionError("CUDA touched on a CPU run")
    monkeypatch.setattr(torch.cuda, "empty_cache", no_cuda)
    training.release_cached_memory(torch.device("cpu"))      # CPUs: nothing to release, CUDA untouched


def test_accepted_flags_say_once_what_megalite_does_instead():
    argv = with_flags(TINY_LLAMA_ARGS, attention_backend="flash", no_create_attention_mask_in_dataloader=True,
                      ckpt_format="torch_dist", fp8_format="hybrid", fp8_param_gather=True, tiktoken_pattern="v2",
                      decoupled_lr="5e-4")
    config = parse_args(argv, world_size=1)
    notes = startup_notes(argv)
    assert len(notes) == 4, notes
    assert any("scaled_dot_product_attention" in n and "never builds an attention mask" in n for n in notes)
    assert any(n.startswith("--ckpt-format torch_dist: megalite writes its own reshardable format") for n in notes)
    assert any(n.startswith("--fp8-format --fp8-param-gather: megalite has no FP8") for n in notes)
    assert any(n.startswith("--tiktoken-pattern v2: only Megatron's TikTokenizer") for n in notes)
    assert config.optimizer.decoupled_lr == 5e-4 and config.optimizer.decoupled_min_lr == 0.0   # --min-lr
    assert startup_notes(TINY_LLAMA_ARGS) == []
    with pytest.raises(UserError, match="--decoupled-min-lr needs --decoupled-lr"):
        parse_args(with_flags(TINY_LLAMA_ARGS, decoupled_min_lr="1e-5"), world_size=1)


def test_decoupled_lr_trains_the_embedding_and_output_layer_at_their_own_schedule():
    """Adam's first update moves every weight with a gradient by about its learning rate: the input
    embedding and the output layer by --decoupled-lr, everything else by --lr; the decoupled rate follows
    the same schedule between --decoupled-lr and --decoupled-min-lr."""
    from megalite.optim.lr_scheduler import LRScheduler
    from megalite.train.training import build_trainer, train_step
    from dp_workloads import batches
    argv = with_flags(TINY_LLAMA_ARGS, lr="1e-3", decoupled_lr="5e-3", weight_decay=0.0, clip_grad=0.0,
                      lr_decay_style="constant", lr_warmup_iters=0)
    trainer = build_trainer(parse_args(argv, world_size=1))
    model = trainer.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(trainer, batches(trainer, 1))
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters()}
    for name, step in moved.items():
        expected = 5e-3 if name in ("embedding.word_embeddings.weight", "output_layer.weight") else 1e-3
        assert step == pytest.approx(expected, rel=0.05), name
    cosine = parse_args(with_flags(TINY_LLAMA_ARGS, lr="1e-3", min_lr="1e-4", decoupled_lr="5e-3",
                                   decoupled_min_lr="5e-4", lr_decay_style="cosine", lr_warmup_iters=2,
                                   train_iters=10), world_size=1).optimizer
    schedule = LRScheduler(cosine, 10)
    for step in (0, 1, 2, 6, 10, 12):
        schedule.num_steps = step
        assert schedule.decoupled_lr == pytest.approx(schedule.lr_at(step, 5e-3, 5e-4))
    schedule.num_steps = 12
    assert schedule.decoupled_lr == pytest.approx(5e-4) and schedule.lr == pytest.approx(1e-4)
