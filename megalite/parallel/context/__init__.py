"""Context parallelism: the sequence split over --context-parallel-size ranks (ring, Ulysses, all-gather K/V)."""
from megalite.parallel.context.ring_attention import (ContextParallel, build_context_parallel, context_parallel_loss,
                                                      local_positions, ring_attention, slice_for_context_parallel)

__all__ = ["ContextParallel", "build_context_parallel", "context_parallel_loss", "local_positions",
           "ring_attention", "slice_for_context_parallel"]
