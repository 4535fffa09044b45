"""A steady-state training step reads one value from the device on the host: the global gradient norm
(fp16 adds the overflow flag). On a GPU every such read waits for the queued kernels, so the host stops
feeding the device; the losses stay on the device until the log interval, the exit agreement runs every
min(--log-interval, 10) iterations, and --calculate-per-token-loss counts tokens on the device.

On the CPU a read is a call of one of ``READS`` on a tensor: each is counted, with the line of megalite
that made it, per iteration (from StepProfiler.before_step to the next). Steady-state iterations are
those that neither log nor agree on an exit, after the first and before the last. The CUDA tier counts
the same steps' synchronising CUDA calls with ``torch.cuda.set_sync_debug_mode`` (CudaSyncs,
tests/cuda/test_cuda_tier.py)."""
import os
import traceback
import warnings
from collections import defaultdict

import pytest
import torch

from harness import run_ranks
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args

READS = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy")
LOG_INTERVAL, ITERS = 4, 7
STEADY = [i for i in range(1, ITERS - 1) if (i + 1) % LOG_INTERVAL]       # 0-based iterations
ARGS = with_flags(TINY_LLAMA_ARGS, log_interval=LOG_INTERVAL, train_iters=ITERS, global_batch_size=8,
                  exit_signal_handler=True, exit_duration_in_mins=1000, calculate_per_token_loss=True,
                  clip_grad=1.0)
MEGALITE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + "/megalite/"


class HostReads:
    """Counts host reads of tensor values per training iteration while active."""

    def __init__(self):
        self.iteration = None
        self.reads = defaultdict(list)          # 0-based iteration -> [(read, megalite file:line)]
        self._saved = {}

    def __enter__(self):
        from megalite.train.profiler import StepProfiler
        self._patch_reads()
        before_step = StepProfiler.before_step
        self._saved[(StepProfiler, "before_step")] = before_step

        def at_iteration(profiler, iteration):
            self.iteration = iteration
            return before_step(profiler, iteration)
        StepProfiler.before_step = at_iteration
        return self

    def __exit__(self, *_):
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)

    def _patch_reads(self):
        for name in READS:
            self._saved[(torch.Tensor, name)] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(name, getattr(torch.Tensor, name)))

    def _counting(self, name, original):
        def read(tensor, *args, **kwargs):
            if self.iteration is not None:
                self.reads[self.iteration].append((name, caller()))
            return original(tensor, *args, **kwargs)
        return read


class CudaSyncs(HostReads):
    """Counts, per iteration, the synchronising CUDA calls that torch.cuda.set_sync_debug_mode("warn")
    reports (a GPU's own record of every host wait, whatever Python call made it)."""

    def _patch_reads(self):
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        self._saved[(warnings, "showwarning")] = warnings.showwarning
        warnings.showwarning = self._on_warning
        torch.cuda.set_sync_debug_mode("warn")

    def _on_warning(self, message, *args, **kwargs):
        if "synchronizing CUDA operation" in str(message) and self.iteration is not None:
            self.reads[self.iteration].append(("sync", caller()))

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(0)
        super().__exit__(*exc)
        self._warnings.__exit__(*exc)


def caller() -> str:
    """The innermost megalite line on the stack (where the read was asked for)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(MEGALITE):
            return f"{frame.filename[len(MEGALITE):]}:{frame.lineno}"
    return "outside megalite"


def steady_reads(rank, world, argv, counter_type=HostReads) -> dict:
    from megalite.train.trainer import pretrain
    with counter_type() as counter:
        state = pretrain(parse_args(argv, world_size=world), print_fn=lambda *_: None)
    assert len(state.history) == ITERS
    return {i: counter.reads[i] for i in STEADY}


def assert_reads(per_iteration: dict, expected: int) -> None:
    for i, reads in per_iteration.items():
        assert len(reads) == expected, f"iteration {i + 1}: {reads}"


@pytest.mark.parametrize("precision, expected", [("bf16", 1), ("fp16", 2)])
def test_a_steady_step_reads_only_the_gradient_norm(precision, expected):
    # fp16: a loss scale that does not overflow, so the steps compute the norm
    assert_reads(steady_reads(0, 1, ARGS + [f"--{precision}", "--initial-loss-scale", "1024"]), expected)


def test_pipeline_and_zero_steps_read_only_the_gradient_norm():
    """pp 2 x dp 2 with the overlapped distributed optimizer: the loss's data-parallel average, the
    pipeline's transfers and the parameter all-gather read nothing."""
    argv = with_flags(ARGS, pipeline_model_parallel_size=2, use_distributed_optimizer=True,
                      overlap_grad_reduce=True, overlap_param_gather=True)
    for per_iteration in run_ranks(4, steady_reads, argv):
        assert_reads(per_iteration, 1)
