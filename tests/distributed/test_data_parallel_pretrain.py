"""Data parallelism through the real entry point: pretrain_gpt.py under torchrun, 10 iterations of the
same global batch at DP=1, DP=2 (distributed optimizer, both overlaps) and DP=4 (ZeRO-3, both
overlaps) log the same losses; rank 0 prints the start-up memory line of every rank.

Each run is launched on first use: the default tier runs DP=1 and DP=4 (ZeRO-3; ZeRO-1 at DP=2 is also
test_data_parallel.py's in-process default case), the slow tier adds DP=2."""
import re

import pytest

from harness import logged_losses, run_pretrain
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

ARGV = with_flags(TINY_LLAMA_ARGS, global_batch_size=16, train_iters=10, weight_decay=0.1, clip_grad=1.0,
                  lr_warmup_iters=2, lr_decay_style="cosine", ddp_bucket_size=30000)
MEMORY_LINE = re.compile(r"^memory rank (\d+): parameters (\d+) bytes \| gradients (\d+) bytes \| "
                         r"optimizer state (\d+) bytes \| theoretical (\d+) bytes$", re.M)
LAYOUTS = {
    1: [],
    2: ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
    4: ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce",
        "--overlap-param-gather"],
}


class Runs(dict):
    """nproc -> stdout of pretrain_gpt.py at that data-parallel size, launched on first use."""

    def __missing__(self, nproc):
        proc = run_pretrain(nproc, ARGV + LAYOUTS[nproc])
        assert proc.returncode == 0, proc.stderr[-3000:]
        self[nproc] = proc.stdout
        return proc.stdout


@pytest.fixture(scope="module")
def runs():
    return Runs()


@pytest.mark.parametrize("nproc", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_losses_equal_the_single_process_run(runs, nproc):
    reference, losses = logged_losses(runs[1]), logged_losses(runs[nproc])
    assert sorted(reference) == list(range(1, 11)) and sorted(losses) == sorted(reference)
    for it in reference:
        assert losses[it] == pytest.approx(reference[it], rel=1e-5), f"iteration {it}"


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow), 4])
def test_rank_zero_prints_every_ranks_memory_line(runs, nproc):
    lines = MEMORY_LINE.findall(runs[nproc])
    assert [int(m[0]) for m in lines] == list(range(nproc)), runs[nproc][:2000]
    if nproc != 4:
        return
    one = [int(x) for x in MEMORY_LINE.findall(runs[1])[0][1:]]
    for rank_line in lines:
        params, grads, opt, theory = (int(x) for x in rank_line[1:])
        assert opt == pytest.approx(one[2] / 4, rel=0.02)      # ZeRO-3 at DP=4: a quarter of everything
        assert grads == pytest.approx(one[1] / 4, rel=0.02)
        assert params == pytest.approx(one[0] / 4, rel=0.02)
        assert opt == pytest.approx(theory, rel=0.02)
