"""``input_grads_to_compute`` lives in split_backward.py; this name stays for the model's imports."""
from megalite.parallel.pipeline.split_backward import input_grads_to_compute  # noqa: F401
