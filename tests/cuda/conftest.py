"""The CUDA tier (`pytest -m cuda tests`, or `make test-cuda`): skipped where torch sees no GPU.

MEGALITE_CUDA_TIER_ON_CPU=1 runs the tier's own code on a CPU machine instead (the "GPU" runs are then
CPU runs with gloo): a check of the tests themselves, not of the GPU path."""
import os

import pytest
import torch

ON_CPU = os.environ.get("MEGALITE_CUDA_TIER_ON_CPU") == "1"


def pytest_runtest_setup(item):
    if item.get_closest_marker("cuda") and not torch.cuda.is_available() and not ON_CPU:
        pytest.skip("no CUDA GPU here (the CUDA tier runs with: make test-cuda)")
