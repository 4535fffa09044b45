"""Multi-token prediction on one GPU: fp32 (--no-tf32) training with two MTP depths, full recomputation
included, logs the CPU run's lm and MTP losses, and bf16 trains (see test_cuda_tier.py for how runs are
launched)."""
import re

import pytest

from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from test_cuda_tier import assert_close, losses, pretrain

pytestmark = pytest.mark.cuda

ARGV = with_flags(TINY_LLAMA_ARGS, train_iters=6, global_batch_size=8, lr_decay_style="constant", mtp_num_layers=2,
                  recompute_granularity="full", recompute_method="uniform")


def mtp_losses(stdout: str, depth: int) -> list[float]:
    return [float(v) for v in re.findall(rf"\| mtp_{depth} loss:\s*([-+0-9.eE]+|nan|inf) \|", stdout)]


def test_fp32_mtp_on_the_gpu_equals_the_cpu_run():
    argv = with_flags(ARGV, no_tf32=True)
    gpu, cpu = pretrain(argv), pretrain(argv, cpu=True)
    assert_close(losses(gpu), losses(cpu), rtol=1e-4)
    for depth in (1, 2):
        assert_close(mtp_losses(gpu, depth), mtp_losses(cpu, depth), rtol=1e-4)


def test_bf16_mtp_trains_on_the_gpu():
    stdout = pretrain(with_flags(ARGV, bf16=True))
    lm, mtp = losses(stdout), mtp_losses(stdout, 2)
    assert len(mtp) == len(lm) == 6 and lm[-1] < lm[0] and mtp[-1] < mtp[0]
