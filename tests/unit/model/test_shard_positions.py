"""shard_positions: the full-tensor rows/columns of a TP shard equal take_shard of the full tensor, for every
parameter kind (column/row parallel, fused grouped QKV incl. replicated KV heads, SwiGLU, vocabulary, the
learnable softmax sink)."""
import pytest
import torch

from megalite.train.command_line import parse_args
from megalite.model.gpt import GPTModel
from megalite.parallel.param_meta import full_shape, param_meta
from megalite.parallel.tensor.layers import TensorParallel, shard_positions
from megalite_test_utils import TINY_GPT2_ARGS, TINY_LLAMA_ARGS, with_flags


@pytest.mark.parametrize("base, tp", [(TINY_LLAMA_ARGS, 2), (TINY_LLAMA_ARGS, 4), (TINY_GPT2_ARGS, 2),
                                      (with_flags(TINY_LLAMA_ARGS, softmax_type="learnable"), 4)])
def test_shard_positions_match_take_shard(base, tp):
    config = parse_args(with_flags(base, tensor_model_parallel_size=tp), world_size=tp).model
    for rank in range(tp):
        model = GPTModel(config, tp=TensorParallel(rank=rank, size=tp))
        for name, param in model.named_parameters():
            shape = full_shape(param)
            full = torch.arange(torch.Size(shape).numel()).view(shape)
            take_shard = param_meta(param).take_shard
            expected = take_shard(full) if take_shard is not None else full
            rows, cols, full_cols = shard_positions(param)
            got = (rows[:, None] * full_cols + cols[None, :]).view(param.shape)
            assert torch.equal(got, expected), name
