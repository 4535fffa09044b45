"""Hybrid sharding's groups (parallel/mesh.py): instances of consecutive data-parallel ranks, replicas across them."""
from megalite.parallel.mesh import ParallelState, hybrid_groups, rank_grid_groups


def test_instances_are_consecutive_ranks_and_replicas_stride_across_them():
    # world 16 = tp 2 x cp 2 x dp 4: the dp x cp group of rank 0 is [0, 2, ..., 14] (cp fastest)
    members = rank_grid_groups(16, 2, 2, 1, "cd")[0]
    shards, replicas = hybrid_groups(members, 2)
    assert shards == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert replicas == [[0, 8], [2, 10], [4, 12], [6, 14]]
    # every member in exactly one shard group and one replica group
    assert sorted(sum(shards, [])) == sorted(sum(replicas, [])) == members


def test_a_rank_knows_its_instance_and_place_in_it():
    # rank 13 = tp 1, cp 0, dp 3 (dp x cp place 6 of 8); 2 instances of 4
    s = ParallelState(world_size=16, rank=13, tp_size=2, cp_size=2, instances=2)
    assert (s.dp_cp_rank, s.dp_shard_size, s.dp_shard_rank, s.instance) == (6, 4, 2, 1)
    assert s.edp_shard_size == s.edp_size // 2
    one = ParallelState(world_size=16, rank=13, tp_size=2, cp_size=2)
    assert (one.dp_shard_size, one.dp_shard_rank, one.instance) == (8, 6, 0)
