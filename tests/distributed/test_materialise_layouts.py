"""Start-up materialisation (megalite/parallel/data/materialise.py) through the Trainer at DP=2: each backend
states the elements a rank keeps (``local_elements``), materialise fills them once, and they equal the
single-process model's initial values bit for bit; under ZeRO-3 and FSDP2 the ranks' elements are
disjoint and cover every parameter once, and a rank's parameter storage is its shard alone."""
import pytest
import torch

from dp_workloads import DP_ARGS
from harness import run_ranks
from megalite.model.gpt import GPTModel
from megalite.parallel.param_meta import param_meta
from megalite.train.command_line import parse_args
from megalite.train.trainer import build_trainer
from megalite_test_utils import with_flags

ZERO3 = with_flags(DP_ARGS, data_parallel_sharding_strategy="optim_grads_params")
LAYOUTS = {
    "no_shard": DP_ARGS,
    "zero1": with_flags(DP_ARGS, data_parallel_sharding_strategy="optim"),
    "zero2": with_flags(DP_ARGS, data_parallel_sharding_strategy="optim_grads"),
    "zero3": ZERO3,
    "zero1_whole_params": with_flags(DP_ARGS, data_parallel_sharding_strategy="optim",
                                     use_layer_wise_distributed_optimizer=True),
    "zero3_whole_params": with_flags(ZERO3, use_layer_wise_distributed_optimizer=True),
    "fsdp2": with_flags(DP_ARGS, use_torch_fsdp2=True),
}
SHARDED = ("zero3", "zero3_whole_params", "fsdp2")


def held(rank: int, world: int) -> dict:
    """Per layout: (parameter name, start, end, values) of every range this rank keeps, whether any
    record kept ``init_values``, and the bytes of parameter storage the rank holds."""
    out = {}
    for layout, argv in LAYOUTS.items():
        trainer = build_trainer(parse_args(argv, world_size=world))
        ddp = trainer.ddp
        name_of = {id(p): n for n, p in ddp.named_params}
        out[layout] = {
            "ranges": [(name_of[id(e.param)], e.start, e.end, e.target.detach().clone())
                       for e in ddp.local_elements()],
            "records_kept": any(param_meta(p).init_values is not None for p in ddp.params),
            "param_bytes": ddp.buffer.param_bytes(),
        }
        trainer.shut_down()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(2, held)


def test_every_layout_starts_from_the_single_process_values(ranks):
    config = parse_args(DP_ARGS, world_size=1)
    model = GPTModel(config.model, seed=config.training.seed)
    serial = {n: p.detach().reshape(-1) for n, p in model.named_parameters()}
    total = sum(p.numel() for p in serial.values())
    for layout in LAYOUTS:
        covered = {n: torch.zeros(p.numel(), dtype=torch.int32) for n, p in serial.items()}
        for rank in ranks:
            got = rank[layout]
            assert not got["records_kept"], layout
            for name, start, end, values in got["ranges"]:
                assert torch.equal(values, serial[name][start:end]), (layout, name, start, end)
                covered[name][start:end] += 1
            kept = sum(end - start for _, start, end, _ in got["ranges"])
            if layout in SHARDED:       # parameter storage: the shard alone (padding at most)
                assert kept < total and got["param_bytes"] <= (kept + 2 * len(serial)) * 4, (layout, got["param_bytes"])
            else:
                assert kept == total, layout
        copies = 1 if layout in SHARDED else len(ranks)
        assert all(bool((c == copies).all()) for c in covered.values()), layout
