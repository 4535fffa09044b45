"""Tensor parallelism: autograd collectives, parallel layers, vocab-parallel loss, RNG and recompute."""
from megalite.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear, TensorParallel,
                                             VocabParallelEmbedding, parallel_logits)
from megalite.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TensorParallel", "VocabParallelEmbedding",
           "parallel_logits", "vocab_parallel_cross_entropy"]
