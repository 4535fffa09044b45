"""Parallelism: the rank grid and process start-up, tensor, context, pipeline and data parallelism."""
