"""validate.py's entries on typed configs, without a command line: the whole run (validate), one parallel
layout (check_layout, as the trainer and the planner call it), and ParallelConfig's one sharding rule."""
from dataclasses import replace

import pytest

from megalite.train.command_line import parse_args
from megalite.config.schema import ParallelConfig, default_kv_channels, rotary_dim
from megalite.config.validate import check_layout, validate
from megalite.errors import UserError
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags


def test_check_layout_returns_the_model_chunks_per_rank():
    assert check_layout(parse_args(TINY_LLAMA_ARGS, world_size=1)) == 1
    argv = with_flags(TINY_LLAMA_ARGS, num_layers=4, pipeline_model_parallel_size=2,
                      num_layers_per_virtual_pipeline_stage=1, global_batch_size=8)
    assert check_layout(parse_args(argv, world_size=2)) == 2
    zbv = with_flags(TINY_LLAMA_ARGS, num_layers=4, pipeline_model_parallel_size=2, pipeline_schedule="zbv",
                     global_batch_size=8)
    assert check_layout(parse_args(zbv, world_size=2)) == 2             # zbv places two chunks per rank itself


@pytest.mark.parametrize("section, change, message", [
    ("model", {"hidden_dropout": 1.5}, "--hidden-dropout must be in [0, 1)"),
    ("model", {"num_query_groups": 3}, "--num-attention-heads 4 must be divisible by --num-query-groups 3"),
    ("parallel", {"tensor_model_parallel_size": 3}, "--num-attention-heads 4 must be divisible by"),
    ("parallel", {"context_parallel_size": 2}, "--context-parallel-size 2 needs --attention-dropout 0"),
    ("optimizer", {"bf16": True, "fp16": True}, "--bf16 and --fp16 are exclusive"),
    ("training", {"global_batch_size": 3}, "--global-batch-size 3 must be divisible by --micro-batch-size 2"),
    ("data", {"split": "1,2,3,4"}, "--split '1,2,3,4' must be up to 3 non-negative weights"),
])
def test_validate_checks_typed_configs(section, change, message):
    config = parse_args(TINY_LLAMA_ARGS, world_size=1)
    if section == "parallel":
        config = replace(config, model=replace(config.model, attention_dropout=0.1))
    config = replace(config, **{section: replace(getattr(config, section), **change)})
    world = config.parallel.model_parallel_size if section == "parallel" else 1
    config = replace(config, parallel=replace(config.parallel, world_size=world))
    with pytest.raises(UserError) as err:
        validate(config, world)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_use_distributed_optimizer_and_the_sharding_strategy_agree():
    assert ParallelConfig(use_distributed_optimizer=True).data_parallel_sharding_strategy == "optim"
    assert ParallelConfig(data_parallel_sharding_strategy="optim_grads").use_distributed_optimizer
    assert not ParallelConfig().use_distributed_optimizer


def test_derived_sizes():
    assert default_kv_channels(4096, 32) == 128 and rotary_dim(128, 0.5) == 64
    with pytest.raises(UserError, match="--hidden-size 66 must be divisible by --num-attention-heads 4"):
        default_kv_channels(66, 4)
