"""The Trainer owns its lifecycle: leaving its ``with`` block, normally or by an exception, closes the
data-parallel backend and destroys the process group the Trainer started (here torch's fake one, so one
process plays rank 0 of two); a broken process group (CollectiveFailure) is left as it is, for the
caller's exit without teardown. A group the caller started is the caller's to destroy."""
import pytest
import torch.distributed as dist

from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

from megalite.train.command_line import parse_args
from megalite.train.faults import CollectiveFailure
from megalite.train.trainer import Trainer

FAKE_DP2 = with_flags(TINY_LLAMA_ARGS, fake_process_group=True, fake_world_size=2, fake_rank=0,
                      use_distributed_optimizer=True)


def quiet(*_):
    pass


def closed(trainer: Trainer) -> bool:
    return trainer.closed and trainer.ddp._hooks == []


@pytest.fixture
def no_group():
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():          # a failed check must not leak the group into other tests
        dist.destroy_process_group()


def test_leaving_the_block_closes_ddp_and_destroys_the_group(no_group):
    with Trainer(parse_args(FAKE_DP2), quiet) as trainer:
        assert dist.is_initialized() and trainer.owns_process_group and not trainer.closed
    assert closed(trainer) and not dist.is_initialized()


def test_an_exception_in_the_block_still_tears_down(no_group):
    with pytest.raises(ValueError, match="stop here"):
        with Trainer(parse_args(FAKE_DP2), quiet) as trainer:
            raise ValueError("stop here")
    assert closed(trainer) and not dist.is_initialized()


def test_a_collective_failure_leaves_the_broken_group_alone(no_group):
    with pytest.raises(CollectiveFailure):
        with Trainer(parse_args(FAKE_DP2), quiet) as trainer:
            raise CollectiveFailure("a peer is gone")
    assert not trainer.closed and dist.is_initialized()


def test_a_group_started_by_the_caller_stays(no_group):
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    with Trainer(parse_args(TINY_LLAMA_ARGS, world_size=1), quiet) as trainer:
        assert not trainer.owns_process_group
    assert closed(trainer) and dist.is_initialized()
