"""The training step: optimizer equals torch's AdamW, a fixed batch is memorised, fp16 skips overflows."""
import itertools
import os
import subprocess
import sys

import pytest
import torch

from megalite_test_utils import ROOT, TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.train.trainer import build_trainer, pretrain
from megalite.train.step import train_step


def trainer_for(argv):
    return build_trainer(parse_args(argv, world_size=1))


def fixed_batches(vocab=201, batch=2, seq=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    batch_dict = {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(batch, seq),
                  "position_ids": torch.arange(seq).expand(batch, seq)}
    return itertools.repeat(batch_dict)


def test_optimizer_step_equals_torch_adamw_with_megatron_param_groups():
    argv = with_flags(TINY_LLAMA_ARGS, lr_decay_style="constant", weight_decay=0.1, clip_grad=0.05,
                      adam_beta2=0.95, global_batch_size=2)
    trainer = trainer_for(argv)
    reference = trainer_for(argv).model                 # same seed -> same weights
    decay = [p for n, p in reference.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in reference.named_parameters() if p.dim() == 1 or n.endswith(".bias")]
    assert no_decay, "norm weights must be excluded from weight decay"
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    batches = fixed_batches()
    for _ in range(3):
        _, result = train_step(trainer, batches)
        batch = next(fixed_batches())
        ref_opt.zero_grad()
        losses = reference(batch["tokens"], labels=batch["labels"])
        losses.mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ref_opt.step()
        assert result.grad_norm == pytest.approx(norm.item(), rel=1e-5)
    for (name, p), (_, r) in zip(trainer.model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, r, atol=1e-6, rtol=1e-5, msg=name)


def test_overfits_a_fixed_batch():
    argv = with_flags(TINY_LLAMA_ARGS, lr=3e-3, lr_decay_style="constant", weight_decay=0.0, global_batch_size=2,
                      train_iters=150)
    trainer = trainer_for(argv)
    batches = fixed_batches()
    losses = [float(train_step(trainer, batches)[0]) for _ in range(150)]
    assert losses[0] > 4.5
    assert losses[-1] < 0.05, losses[-10:]


def test_gradient_accumulation_equals_one_big_micro_batch():
    """4 micro-batches of 1 == 1 micro-batch of 4 (same global batch): loss, gradients, then weights."""
    from megalite.parallel.pipeline.schedules import forward_backward_no_pipelining
    big = trainer_for(with_flags(TINY_LLAMA_ARGS, micro_batch_size=4, global_batch_size=4))
    small = trainer_for(with_flags(TINY_LLAMA_ARGS, micro_batch_size=1, global_batch_size=4))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 201, (4, 33), generator=g)
    full = {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(4, 32),
            "position_ids": torch.arange(32).expand(4, 32)}
    singles = [{k: v[i:i + 1] for k, v in full.items()} for i in range(4)]
    # gradients: Adam would hide a wrong 1/num_microbatches scale, so compare them directly
    for trainer, batches, n in ((big, [full], 1), (small, singles, 4)):
        trainer.optimizer.zero_grad()
        forward_backward_no_pipelining(trainer.model, batches, trainer.device)
    torch.testing.assert_close(small.buffer.grad_data, big.buffer.grad_data, atol=1e-7, rtol=1e-5)
    for _ in range(2):
        loss_big = float(train_step(big, iter([full]))[0])
        loss_small = float(train_step(small, iter(singles))[0])
        assert loss_small == pytest.approx(loss_big, rel=1e-5)
    torch.testing.assert_close(small.buffer.param_data, big.buffer.param_data, atol=1e-5, rtol=0)


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    argv = with_flags(TINY_LLAMA_ARGS, fp16=True, initial_loss_scale=2.0 ** 40, hysteresis=1,
                      lr_decay_style="constant", global_batch_size=2)
    trainer = trainer_for(argv)
    before = trainer.buffer.param_data.clone()
    master_before = trainer.optimizer.master.clone()
    _, result = train_step(trainer, fixed_batches())
    assert not result.update_successful and result.grad_norm is None
    assert trainer.optimizer.loss_scale == 2.0 ** 39
    assert torch.equal(trainer.buffer.param_data, before)         # the bad step never reached the weights
    assert torch.equal(trainer.optimizer.master, master_before)
    assert trainer.scheduler.num_steps == 0                       # LR schedule does not advance
    # keep training: the scale backs off until steps succeed, then updates happen
    results = [train_step(trainer, fixed_batches())[1] for _ in range(40)]
    assert any(r.update_successful for r in results)
    assert trainer.optimizer.loss_scale < 2.0 ** 30
    assert not torch.equal(trainer.buffer.param_data, before)


def test_bf16_keeps_fp32_master_weights_and_trains():
    argv = with_flags(TINY_LLAMA_ARGS, bf16=True, lr=3e-3, lr_decay_style="constant", global_batch_size=2)
    trainer = trainer_for(argv)
    assert trainer.buffer.param_data.dtype == torch.bfloat16
    assert trainer.optimizer.master.dtype == torch.float32
    batches = fixed_batches()
    losses = [float(train_step(trainer, batches)[0]) for _ in range(30)]
    assert losses[-1] < losses[0] - 1.0
    torch.testing.assert_close(trainer.buffer.param_data.float(), trainer.optimizer.master, atol=1e-2, rtol=1e-2)


def test_pretrain_on_mock_data_reduces_the_loss(capsys):
    argv = with_flags(TINY_LLAMA_ARGS, train_iters=30, lr=3e-3, lr_warmup_iters=3, lr_decay_style="cosine",
                      eval_iters=2, eval_interval=15, log_interval=5)
    state = pretrain(parse_args(argv, world_size=1))
    assert state.iteration == 30 and state.consumed_train_samples == 120
    assert state.history[-1] < 0.7 * state.history[0]
    out = capsys.readouterr().out
    assert out.count("validation loss at iteration") == 2
    assert "validation loss at the end of training for val data" in out


CRASH_WITH_LIVE_LOADERS = """
import sys
sys.path.insert(0, {tests!r})
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.data.tokenizers import build_tokenizer
from megalite.train.trainer import build_data_iterators, build_trainer
if __name__ == "__main__":       # spawned loader workers import this script
    config = parse_args(with_flags(TINY_LLAMA_ARGS, num_workers=2), world_size=1)
    trainer = build_trainer(config, print_fn=lambda *_: None)
    iterators = build_data_iterators(trainer, build_tokenizer(config.data))
    next(iterators[0])
    raise RuntimeError("boom")  # uncaught: the traceback keeps the iterators and their workers alive
"""


def test_a_crash_with_live_data_workers_exits_instead_of_hanging(tmp_path):
    """Data-loader workers ignore SIGTERM (so a torchrun/SLURM signal cannot kill them before the rank
    saves); multiprocessing's exit hook would SIGTERM and then join them forever. The rank must shut
    them down itself and exit with the error."""
    tests = os.path.join(ROOT, "tests")
    script = tmp_path / "crash.py"
    script.write_text(CRASH_WITH_LIVE_LOADERS.format(tests=tests))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(tests))
    assert result.returncode == 1 and "RuntimeError: boom" in result.stderr
