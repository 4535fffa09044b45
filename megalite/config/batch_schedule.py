"""Megatron's batch-size schedules (--rampup-batch-size, --step-batch-size-schedule) and the iteration count
of a --train-samples run, as [(consumed samples from which it applies, global batch size), ...]."""
from __future__ import annotations

from megalite.errors import UserError

_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def rampup_schedule(rampup: list[int], global_batch_size: int) -> list[tuple[int, int]]:
    """Megatron's ramp-up: the batch is START + k * INCREMENT once int(consumed / (SAMPLES / n)) >= k, for
    n = (global batch - START) / INCREMENT increments; the smallest such consumed count is ceil(k * SAMPLES / n)
    (exact integer arithmetic)."""
    start, increment, samples = rampup
    gbs = global_batch_size
    if start < 1 or increment < 1:
        raise UserError(f"--rampup-batch-size {start} {increment} {samples}: the start size and the increment must "
                        "be >= 1")
    if start > gbs or (gbs - start) % increment:
        raise UserError(f"--rampup-batch-size {start} {increment} {samples}: --global-batch-size {gbs} must be START "
                        "plus a whole number of INCREMENTs")
    n = (gbs - start) // increment
    if n == 0:
        return [(0, gbs)]
    return [(-(-k * samples // n), start + k * increment) for k in range(n + 1)]


def parse_step_schedule(text: str, seq_length: int) -> list[tuple[int, int]]:
    """Megatron's "THRESHOLD:BATCH ..." (thresholds in tokens, converted to samples by seq_length)."""
    def number(part: str) -> int:
        part = part.strip().upper()
        scale = _SUFFIXES.get(part[-1:], 1)
        return int(float(part[:-1] if scale > 1 else part) * scale)

    schedule = []
    for entry in text.replace(",", " ").split():
        try:
            threshold, batch = entry.split(":", 1)
            schedule.append((number(threshold) // seq_length, number(batch)))
        except ValueError:
            raise UserError(f"--step-batch-size-schedule: {entry!r} is not THRESHOLD:BATCH (e.g. 2.4B:320)") from None
    schedule.sort()
    if not schedule or schedule[0][0] != 0:
        raise UserError("--step-batch-size-schedule must start with a batch size at threshold 0 (e.g. \"0:16 ...\")")
    if any(b[0] == a[0] for a, b in zip(schedule, schedule[1:])) or any(batch < 1 for _, batch in schedule):
        raise UserError(f"--step-batch-size-schedule {text!r}: thresholds must be distinct (in samples of "
                        f"--seq-length {seq_length} tokens) and batch sizes >= 1")
    return schedule


def train_iters_for_samples(train_samples: int, global_batch_size: int, schedule: list[tuple[int, int]]) -> int:
    """The whole global batches that fit in ``train_samples`` (following the batch-size schedule; a last
    partial batch is dropped, as Megatron does at constant batch size)."""
    if not schedule:
        return train_samples // global_batch_size
    iterations = consumed = 0
    for i, (_, batch) in enumerate(schedule):
        end = schedule[i + 1][0] if i + 1 < len(schedule) else train_samples
        while consumed < end and consumed + batch <= train_samples:
            consumed += batch
            iterations += 1
    return iterations
