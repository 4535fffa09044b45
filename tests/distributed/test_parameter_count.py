"""The start-up parameter count is the whole model's at any layout, not one rank's shard.

The default tier builds the 8 ranks' trainers (TP=2 x PP=2 x VPP x DP=2 with ZeRO-1) in one forkserver
spawn and reads the line that report_parameters prints on the logging rank; the slow tier also launches pretrain_gpt.py
under torchrun at that layout, as a user does."""
import re

import pytest

from harness import run_pretrain, run_ranks
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.model.gpt import GPTModel

ARGV = with_flags(TINY_LLAMA_ARGS, num_layers=4, train_iters=1, global_batch_size=8)
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--num-layers-per-virtual-pipeline-stage", "1", "--use-distributed-optimizer"]


def expected_count() -> int:
    return sum(p.numel() for p in GPTModel(parse_args(ARGV, world_size=1).model).parameters())


def _start_up_lines(rank, world, argv):
    """The lines this rank prints at start-up: report_parameters, as Trainer.train calls it (no step taken)."""
    from megalite.train.trainer import build_trainer, report_parameters
    lines = []
    report_parameters(build_trainer(parse_args(argv, world_size=world), print_fn=lines.append))
    return lines


def test_parameter_count_is_the_whole_models_under_tp_pp_vpp_and_zero():
    lines = [line for rank in run_ranks(8, _start_up_lines, ARGV + LAYOUT) for line in rank]
    counts = re.findall(r"number of parameters: (\d+)", "\n".join(lines))
    assert counts == [str(expected_count())], lines


@pytest.mark.slow
def test_pretrain_gpt_prints_the_whole_models_count_under_tp_pp_vpp_and_zero():
    result = run_pretrain(8, ARGV + LAYOUT)
    assert result.returncode == 0, result.stderr[-2000:]
    counts = re.findall(r"number of parameters: (\d+)", result.stdout)
    assert counts == [str(expected_count())], result.stdout[-2000:]
