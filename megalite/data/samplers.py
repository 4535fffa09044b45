"""Which samples each data-parallel rank reads, from ``consumed_samples`` onwards.

A global batch is ``global_batch_size`` consecutive sample indices; it is cut into micro-batches of
``micro_batch_size * dp_size`` and rank r takes the r-th ``micro_batch_size`` slice of each. The set of
micro-batches in a global batch is therefore the same at every DP size, and resuming only needs
``consumed_samples``.
"""
from __future__ import annotations


class MegatronPretrainingSampler:
    """Yields lists of sample indices, one micro-batch of this rank at a time."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int = 0, data_parallel_size: int = 1, drop_last: bool = True):
        if total_samples <= 0:
            raise ValueError(f"no samples to draw from (total_samples={total_samples})")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} outside [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = data_parallel_rank
        self.dp_size = data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def _my_slice(self, batch: list[int]) -> list[int]:
        start = self.dp_rank * self.micro_batch_size
        return batch[start:start + self.micro_batch_size]

    def __iter__(self):
        stride = self.micro_batch_size * self.dp_size
        batch: list[int] = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == stride:
                yield self._my_slice(batch)
                batch = []
        if batch and not self.drop_last:
            yield self._my_slice(batch)
