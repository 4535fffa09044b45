"""--rampup-batch-size / --step-batch-size-schedule: batch sizes by consumed samples equal Megatron's
calculator (with data parallelism and micro-batches), the run's logged batch sizes, learning rates
(Megatron steps its schedule by samples) and an exact resume from a mid-ramp checkpoint."""

import pytest

from megalite.train.command_line import parse_args
from megalite.errors import UserError
from megalite_test_utils import RAMPUP_ARGS, TINY_LLAMA_ARGS, log_field, run_pretrain, with_flags


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


def megatron_lr(samples: float) -> float:
    """Megatron's schedule for RAMPUP_ARGS, counted in samples: warm-up 2 x 8, decay 6 x 8 samples."""
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
    full_state, full = run_pretrain(RAMPUP_ARGS)
    assert [log_field(full, i, "global batch size") for i in range(1, 9)] == [2, 2, 4, 6, 8, 8, 8, 8]
    consumed = [log_field(full, i, "consumed samples") for i in range(1, 9)]
    assert consumed == [2, 4, 8, 14, 22, 30, 38, 46]
    for i, samples in enumerate(consumed, start=1):
        assert log_field(full, i, "learning rate") == pytest.approx(megatron_lr(samples), rel=1e-5), i

    ckpt = str(tmp_path / "ckpt")
    run_pretrain(with_flags(RAMPUP_ARGS, train_iters=2, save=ckpt))
    resumed_state, resumed = run_pretrain(with_flags(RAMPUP_ARGS, load=ckpt))
    assert resumed_state.history == full_state.history[2:]            # bit for bit (same layout, RNG restored)
    for i in range(3, 9):
        assert log_field(resumed, i, "learning rate") == log_field(full, i, "learning rate")
        assert log_field(resumed, i, "global batch size") == log_field(full, i, "global batch size")


# ==================================================================================================
