"""Expert parallelism saves what it exists to save: at EP=4 a rank's expert state (weights, gradients, Adam)
is a quarter of the whole model's, in the memory report and in the processes' peak RSS.

The peak RSS of a rank holds more than the experts (the interpreter, torch, activations), so the expert
state is measured as the RSS a run gains when the model's expert count doubles (16 -> 32 experts of
3 x 256 x 512 weights in 4 layers: 384 MiB more state in one process). That gain at EP=4 must be a
quarter of the single process's, within 5%."""
import re

import pytest

from harness import run_pretrain
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

ARGV = with_flags(TINY_LLAMA_ARGS, num_layers=4, hidden_size=256, ffn_hidden_size=512, moe_ffn_hidden_size=512,
                  moe_router_topk=2, global_batch_size=8, train_iters=2, moe_token_dispatcher_type="alltoall")
EXPERT_LINE = re.compile(r"^memory rank (\d+) expert weights: parameters (\d+) bytes \| gradients (\d+) bytes \| "
                         r"optimizer state (\d+) bytes", re.M)


def run(nproc: int, experts: int) -> tuple[float, list[int]]:
    """(the logging rank's peak RSS in MiB, [expert bytes of each rank: parameters + gradients + optimizer])."""
    proc = run_pretrain(nproc, with_flags(ARGV, num_experts=experts, expert_model_parallel_size=nproc))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rss = [float(m) for m in re.findall(r"max rss \(MB\):\s*([0-9.]+)", proc.stdout)]
    state = [int(p) + int(g) + int(o) for _, p, g, o in EXPERT_LINE.findall(proc.stdout)]
    assert rss and len(state) == nproc, proc.stdout[-2000:]
    return max(rss), state


@pytest.mark.slow
def test_expert_state_per_rank_is_one_over_ep():
    serial_16, serial_32 = run(1, 16), run(1, 32)
    ep4_16, ep4_32 = run(4, 16), run(4, 32)
    # the memory report: each of the 4 ranks holds a quarter of the expert state
    assert all(s == pytest.approx(serial_32[1][0] / 4, rel=0.01) for s in ep4_32[1])
    # the peak RSS: what 16 more experts cost a rank at EP=4 is a quarter of what they cost one process
    serial_gain, ep4_gain = serial_32[0] - serial_16[0], ep4_32[0] - ep4_16[0]
    assert serial_gain == pytest.approx((serial_32[1][0] - serial_16[1][0]) / 2 ** 20, rel=0.10)
    assert ep4_gain / serial_gain == pytest.approx(0.25, rel=0.05)
