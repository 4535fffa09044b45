"""The rank grid in Megatron's order and the groups built from it."""
import pytest

from harness import run_ranks
from megalite.config.schema import ParallelConfig
from megalite.config.validate import check_world_size
from megalite.errors import UserError
from megalite.parallel.launch_env import first_host, read_launch_env
from megalite.parallel.mesh import ParallelState, rank_grid_groups


def test_rank_grid_matches_megatron_order():
    # world 16 = tp 2 x cp 1 x dp 4 x pp 2: tp fastest, pp slowest
    assert rank_grid_groups(16, 2, 1, 2, "t")[:3] == [[0, 1], [2, 3], [4, 5]]
    assert rank_grid_groups(16, 2, 1, 2, "d")[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert rank_grid_groups(16, 2, 1, 2, "p")[:2] == [[0, 8], [1, 9]]
    assert rank_grid_groups(16, 2, 1, 2, "tp")[0] == [0, 1, 8, 9]         # model-parallel group
    assert rank_grid_groups(8, 2, 2, 1, "cd")[0] == [0, 2, 4, 6]         # dp x cp
    s = ParallelState(world_size=16, rank=11, tp_size=2, cp_size=1, pp_size=2)
    assert (s.tp_rank, s.dp_rank, s.pp_rank, s.dp_size) == (1, 1, 1, 4)


def test_sizes_that_do_not_divide_the_world_are_refused():
    with pytest.raises(UserError, match="world size 6 is not divisible by --tensor-model-parallel-size 4"):
        check_world_size(6, ParallelConfig(world_size=6, tensor_model_parallel_size=4))


def test_launch_env_from_torchrun_and_slurm():
    env = read_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (3, 8, 1, "n1", 1234)
    env = read_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
                           "SLURM_JOB_NODELIST": "gpu[07-09,12],cpu1"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (5, 16, 5, "gpu07")
    assert first_host("node1,node2") == "node1"


def _groups(rank, world):
    import torch
    import torch.distributed as dist
    state = ParallelState.build(world, rank, tp=2, pp=2)
    out = {}
    for name in ("tp", "dp", "pp", "mp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=state.group(name))
        out[name] = t.item()
    return out


def test_groups_reduce_over_the_right_ranks():
    results = run_ranks(4, _groups)                  # tp 2 x pp 2, dp 1
    assert [r["tp"] for r in results] == [1, 1, 5, 5]
    assert [r["pp"] for r in results] == [2, 4, 2, 4]
    assert [r["dp"] for r in results] == [0, 1, 2, 3]
    assert [r["mp"] for r in results] == [6, 6, 6, 6]
