"""The start-up parameter count is the whole model's at any layout, not one rank's shard."""
import re

from harness import run_pretrain
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.model.gpt import GPTModel


def test_parameter_count_is_the_whole_models_under_tp_pp_vpp_and_zero():
    argv = with_flags(TINY_LLAMA_ARGS, num_layers=4, train_iters=1, global_batch_size=8)
    expected = sum(p.numel() for p in GPTModel(parse_args(argv, world_size=1).model).parameters())
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--num-layers-per-virtual-pipeline-stage", "1", "--use-distributed-optimizer"]
    result = run_pretrain(8, argv + layout)
    assert result.returncode == 0, result.stderr[-2000:]
    counts = re.findall(r"number of parameters: (\d+)", result.stdout)
    assert counts == [str(expected)], result.stdout[-2000:]
