"""The MoE figures of the log under parallelism: pretrain_gpt.py at 2 ranks logs the same auxiliary
losses, tokens-per-expert spreads and expert-bias ranges as the single-process run of the same global
batch. Each layout reduces differently: data parallel (each rank holds other micro-batches, its layers'
loads summed over the stage), tensor parallel with sequence parallelism (each rank holds a share of every
sequence's loss), pipeline parallel (each rank holds other layers), expert parallel (the router is
replicated, the experts split). --log-params-norm and --log-num-zeros-in-grad count the expert weights
alike in every layout. The memory report's expert share follows the layout (halved by EP, the
optimizer's by the distributed optimizer over the expert-data-parallel ranks)."""
import json
import re

import pytest

from harness import run_pretrain
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

ARGV = with_flags(TINY_LLAMA_ARGS, num_layers=4, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32,
                  moe_layer_freq="[1,0,1,1]", train_iters=4, log_interval=2, global_batch_size=8,
                  moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
                  moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, log_params_norm=True,
                  log_num_zeros_in_grad=True)
LAYOUTS = {
    "single": (1, {}),
    "dp": (2, {"use_distributed_optimizer": True}),
    "tp": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "pp": (2, {"pipeline_model_parallel_size": 2}),
    "ep": (2, {"expert_model_parallel_size": 2}),
    "ep-zero": (2, {"expert_model_parallel_size": 2, "use_distributed_optimizer": True}),
}
# the part of the expert weights each rank holds: TP splits each expert's hidden size (ETP = TP), EP the
# experts, PP the layers (stage 0: MoE layer 0 of 3; stage 1: layers 2 and 3); and over how many ranks the
# distributed optimizer shards their state (the expert-data-parallel ranks: 2 at DP=2, 1 at EP=2)
EXPERT_FRACTION = {"dp": (1, 1), "tp": (1 / 2, 1 / 2), "pp": (1 / 3, 2 / 3), "ep": (1 / 2, 1 / 2),
                   "ep-zero": (1 / 2, 1 / 2)}
OPTIMIZER_SHARDS = {"dp": 2}
EXPERT_LINE = re.compile(r"^memory rank (\d+) expert weights: parameters (\d+) bytes \| gradients (\d+) bytes \| "
                         r"optimizer state (\d+) bytes \| theoretical (\d+) bytes$", re.M)
LINE_FIELDS = re.compile(r" (load_balancing_loss|z_loss): (\S+) \|")


def launch(name: str, tmp_path_factory) -> tuple[list[dict], str]:
    nproc, flags = LAYOUTS[name]
    path = tmp_path_factory.mktemp(name) / "metrics.jsonl"
    proc = run_pretrain(nproc, with_flags(ARGV, metrics_file=str(path), **flags))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in open(path)], proc.stdout


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return launch("single", tmp_path_factory)


def moe_figures(record: dict) -> dict:
    """The MoE figures, and the norms that count the expert weights as a class of their own."""
    return {key: value for key, value in record.items()
            if key.startswith("moe/") or key in ("load_balancing_loss", "z_loss", "params norm", "num zeros")}


@pytest.mark.parametrize("name", ["dp", "tp", "pp", "ep", pytest.param("ep-zero", marks=pytest.mark.slow)])
def test_moe_figures_equal_the_single_process_run(single, tmp_path_factory, name):
    reference, reference_out = single
    records, stdout = launch(name, tmp_path_factory)
    assert [r["iteration"] for r in records] == [r["iteration"] for r in reference] == [2, 4]
    for record, expected in zip(records, reference):
        figures = moe_figures(record)
        assert figures.keys() == moe_figures(expected).keys()
        assert {"load_balancing_loss", "z_loss", "moe/layer3/expert_bias_range", "params norm", "num zeros"} \
            <= figures.keys()
        assert "moe/layer1/load_max_over_mean" not in figures                  # a dense layer
        for key, value in figures.items():
            assert value == pytest.approx(expected[key], rel=1e-5, abs=1e-7), (key, record["iteration"])
    printed = [dict(LINE_FIELDS.findall(line)) for line in stdout.splitlines() if " iteration " in line]
    assert [float(p["load_balancing_loss"]) for p in printed] == \
        pytest.approx([r["load_balancing_loss"] for r in reference], rel=1e-5)

    one = [int(x) for x in EXPERT_LINE.findall(reference_out)[0][1:]]
    lines = EXPERT_LINE.findall(stdout)
    assert [int(line[0]) for line in lines] == [0, 1]
    for rank, line in enumerate(lines):
        params, grads, optimizer, theoretical = (int(x) for x in line[1:])
        held = EXPERT_FRACTION[name][rank]
        assert (params, grads) == (one[0] * held, one[1] * held)
        shards = OPTIMIZER_SHARDS.get(name, 1)
        assert optimizer == pytest.approx(one[2] * held / shards, abs=64)
        assert theoretical == one[3] * held / shards
