"""The training run: the trainer, the step, the loop, logging, profiling and fault handling."""
