"""tools/plan_parallelism.py --verify (megalite/planning/verify.py): the planner's estimate beside a
--no-storage dry run of one rank of each distinct role.

The dry runs' own accuracy is tests/distributed/test_fake_process_group.py's (a real run's ranks and
both dry-run modes agree); here: the dry runs get the planner's model and layout exactly (the flags
round-trip), the roles cover every kind of pipeline stage, the shortened step keeps the peak, and a
small layout verifies end to end. The published layouts at scale are in the slow tier
(tests/distributed/test_layouts_at_scale.py)."""
import os
import re
import sys
from dataclasses import fields, replace

import pytest

from megalite.train.command_line import parse_args
from megalite.config.fields import FLAG
from megalite.config.schema import ModelConfig
from megalite.config.pipeline_split import SplitFlags
from megalite.planning import flags as plan_flags
from megalite.planning import verify
from megalite.planning.inputs import Layout, Workload
from megalite_test_utils import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))

LLAMA = plan_flags.model_from_flags(8, 512, 8, 32000, 1024, ffn_hidden_size=1408, num_query_groups=2, swiglu=True,
                                    position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False,
                                    untie_embeddings_and_output_weights=True, attention_dropout=0.0,
                                    hidden_dropout=0.0)
GPT2 = plan_flags.model_from_flags(4, 256, 4, 50257, 512, max_position_embeddings=1024, add_qkv_bias=True)
MOE = replace(LLAMA, num_experts=8, moe_router_topk=2, moe_layer_freq=[0, 1] * 4, moe_ffn_hidden_size=256,
              moe_shared_expert_intermediate_size=512, moe_token_dispatcher_type="alltoall")
RUN = ["--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-4", "--train-iters", "1"]


@pytest.mark.parametrize("model", [LLAMA, GPT2, MOE], ids=["llama", "gpt2", "moe"])
def test_the_dry_run_gets_the_planners_model(model):
    workload = Workload(model, 8, "bf16")
    config = parse_args(verify.model_flags(workload) + verify.mock_data_flags(workload) + RUN, world_size=1)
    for f in fields(ModelConfig):
        if FLAG in f.metadata and f.name not in verify.NOT_MODEL_FLAGS:
            assert vars(config.model)[f.name] == vars(model)[f.name], f.name
    assert (config.model.num_query_groups, config.model.vocab_size) == (model.num_query_groups, model.vocab_size)


def layout(pp: int, vpp: int = 1, split: SplitFlags = SplitFlags(), schedule: str = "1f1b", dp: int = 2) -> Layout:
    return Layout(8, pp, dp, vpp, 1, "none", "optim", schedule=schedule, split=split)


def test_roles_cover_every_kind_of_stage():
    llama_405b = replace(LLAMA, num_layers=126)
    uneven = layout(16, split=SplitFlags(layout="Et*7|(t*8|)*14t*7,L"))
    names = {r.pp_rank: r.name for r in verify.roles(Workload(llama_405b, 512, "bf16"), uneven)}
    assert names == {0: "pipeline rank 0: embedding + 7 layers", 1: "pipeline rank 1: 8 layers",
                     8: "pipeline rank 8: 8 layers", 15: "pipeline rank 15: 7 layers + head"}
    even = verify.roles(Workload(LLAMA, 64, "bf16"), layout(4, vpp=2))
    assert [(r.pp_rank, r.rank) for r in even] == [(0, 0), (1, 16), (2, 32), (3, 48)]      # 16 ranks a stage
    assert even[0].name == "pipeline rank 0: embedding + 2 layers in 2 chunks"
    moe = verify.roles(Workload(MOE, 64, "bf16"), layout(4))     # MoE every other layer: every stage alike
    assert [r.pp_rank for r in moe] == [0, 1, 2, 3] and "(1 MoE)" in moe[1].name


def test_a_shortened_step_keeps_the_schedules_peak():
    assert verify.peak_microbatches(layout(4, vpp=4), 512) == 32      # interleaved: 2(p-1) + (v-1)p + 1 <= 2pv
    assert verify.peak_microbatches(layout(16), 16) == 16
    assert verify.peak_microbatches(layout(1), 64) == 2
    assert verify.peak_microbatches(layout(4, schedule="gpipe"), 512) == 512      # GPipe holds them all
    from megalite.planning.memory import chunks_in_flight
    for lay in (layout(4, vpp=4), layout(8, vpp=2), layout(16), layout(4, schedule="zbv")):
        short = verify.peak_microbatches(lay, 4096)
        assert all(chunks_in_flight(lay, r, short) == chunks_in_flight(lay, r, 4096) for r in range(lay.pp))


TINY = ["--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "704", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--position-embedding-type", "rope",
        "--normalization", "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--vocab-size", "1024", "--attention-dropout", "0", "--hidden-dropout", "0", "--seq-length", "256",
        "--global-batch-size", "8", "--num-gpus", "8", "--gpu-memory-gb", "80"]


def test_a_small_layout_verifies_within_ten_percent(capsys):
    import plan_parallelism
    code = plan_parallelism.main(TINY + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                         "--micro-batch-size", "1", "--recompute-granularity", "none",
                                         "--use-distributed-optimizer", "--top", "1", "--verify"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+(\d+) pipeline rank (\d+):.* ([+-]\d+\.\d)%  yes", out, re.M)
    assert code == 0 and [(int(a), int(b)) for a, b, _ in rows] == [(0, 0), (4, 1)], out
    assert all(abs(float(error)) <= 10 for _, _, error in rows), out


def test_verify_on_a_layout_the_planner_rejects_is_one_line(capsys):
    import plan_parallelism
    code = plan_parallelism.main(TINY + ["--tensor-model-parallel-size", "3", "--verify"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("error: --verify dry-runs the layouts the planner accepts, and it accepts none: ")
