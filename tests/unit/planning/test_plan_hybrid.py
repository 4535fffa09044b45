"""The planner with hybrid sharding (--num-distributed-optimizer-instances K): the state divides by DP/K,
ZeRO's collectives run within an instance and the reduced shards are all-reduced across instances, the
search offers K where the data-parallel ranks span nodes, and K goes to pretrain_gpt.py's flags and back."""
import dataclasses

import pytest

from megalite.train.command_line import parse_args
from megalite.errors import UserError
from megalite.planning import flags as plan_flags
from megalite.planning import inputs, memory, search
from megalite.planning import time as timing
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from test_plan_parallelism import _llama_workload          # Llama-3 8B's shape, seq 4096, global batch 64


@pytest.mark.parametrize("sharding", ["optim", "optim_grads", "optim_grads_params"])
def test_state_divides_by_one_instance_share(sharding):
    workload = _llama_workload()
    one = inputs.Layout(tp=1, dp=16, sharding=sharding)
    two = dataclasses.replace(one, instances=2)
    assert (two.zero_shards, two.shards) == (8, 16)
    params = inputs.stage_parameters(workload, one, 0)
    w1, g1, o1 = memory.state_bytes(workload, one, params)
    w2, g2, o2 = memory.state_bytes(workload, two, params)
    psi = params.total
    assert o2 == pytest.approx(12 * psi / 8) and o1 == pytest.approx(12 * psi / 16)    # bf16: master + m + v
    assert g2 == pytest.approx(g1 * (2 if sharding != "optim" else 1))
    assert w2 == pytest.approx(w1 * (2 if sharding == "optim_grads_params" else 1))


def test_data_parallel_time_is_intra_instance_collectives_plus_the_replica_all_reduce():
    """DP=16 on two 8-GPU nodes, ZeRO-1: K=1 reduce-scatters and gathers 4Ψ and 2Ψ over InfiniBand; K=2 does
    it within a node over NVLink and all-reduces the 4Ψ/8 shard between the 2 instances over InfiniBand."""
    workload, hardware = _llama_workload(), inputs.Hardware(num_gpus=16, gpu_memory_gb=80, gpus_per_node=8)
    one = inputs.Layout(tp=1, dp=16, sharding="optim", micro_batch_size=4)
    two = dataclasses.replace(one, instances=2)
    psi = inputs.stage_parameters(workload, one, 0).total
    nvlink, ib = hardware.intra_node_gbps * 1e9, hardware.inter_node_gbps * 1e9
    within = (7 / 8 * 4 * psi + 7 / 8 * 2 * psi) / nvlink
    across = 2 * (2 - 1) / 2 * 4 * psi / 8 / ib
    assert timing.replica_all_reduce_bytes("optim", psi, 8, 2, 1) == pytest.approx(4 * psi / 8)
    assert timing.replica_all_reduce_bytes("optim_grads", psi, 8, 2, 3) == pytest.approx(3 * 4 * psi / 8)
    assert timing.exposed_data_parallel_time(workload, two, hardware, 0.0) == pytest.approx(within + across)
    flat = (15 / 16 * 4 * psi + 15 / 16 * 2 * psi) / ib
    assert timing.exposed_data_parallel_time(workload, one, hardware, 0.0) == pytest.approx(flat)


def test_search_offers_the_instances_whose_shard_group_fills_a_node():
    workload = _llama_workload()
    hardware = inputs.Hardware(num_gpus=32, gpu_memory_gb=80, gpus_per_node=8)
    pins = search.Pins(tp=2, pp=1, micro_batch_size=1, recompute="full")
    layouts = search.candidate_layouts(workload, hardware, pins)
    sharded = {lay.instances for lay in layouts if lay.sharding != "no_shard"}
    assert sharded == {1, 4}                        # TP 2 x DP 16 over 4 nodes: 4 instances of DP 4
    assert {lay.instances for lay in layouts if lay.sharding == "no_shard"} == {1}
    pinned = search.candidate_layouts(workload, hardware, dataclasses.replace(pins, instances=2))
    assert {lay.instances for lay in pinned} == {2} and all(lay.sharding != "no_shard" for lay in pinned)
    with pytest.raises(UserError, match="--num-distributed-optimizer-instances 3 must divide"):
        search.candidate_layouts(workload, hardware, dataclasses.replace(pins, instances=3, sharding="optim"))


def test_the_flags_of_a_hybrid_layout_parse_back_into_it():
    small = with_flags(TINY_LLAMA_ARGS, num_layers=4, num_attention_heads=8, num_query_groups=2, hidden_size=64,
                       ffn_hidden_size=128, seq_length=64, max_position_embeddings=64, global_batch_size=8)
    model = parse_args(small, world_size=1).model
    workload = inputs.Workload(model, 8, "bf16")
    layout = inputs.Layout(tp=1, dp=8, sharding="optim_grads_params", instances=2)
    argv = with_flags(small, global_batch_size=None, micro_batch_size=None) + plan_flags.pretrain_flags(workload, layout)
    assert "--num-distributed-optimizer-instances" in argv
    assert plan_flags.workload_and_layout(parse_args(argv, world_size=8))[1] == layout
    assert "instances=2" in layout.describe()
