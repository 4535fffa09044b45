"""Multi-token prediction through pretrain_gpt.py (fp32): a Llama with two MTP depths on packed documents
(--reset-attention-mask: the depths' targets stay within each document) logs the single-process run's lm
loss and MTP losses, iteration after iteration (the MTP term moves the weights), at TP=2 with sequence
parallelism, PP=2 (the depths and a copy of the word embedding on the last stage, untied and tied), EP=2
(MoE layers and an MoE depth), CP=2
(targets shifted on whole sequences before the split), DP=2 with ZeRO-1, ZeRO-3 and FSDP2 (with full
recomputation); the metrics file carries the MTP losses as the log line does; and a checkpoint
saved at PP=2 resumes at TP=2 as the uninterrupted run goes on."""
import json
import re

import pytest

from harness import run_pretrain
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite_test_utils import run_pretrain as run_in_process

ITERS = 3
ARGV = with_flags(TINY_LLAMA_ARGS, train_iters=ITERS, mtp_num_layers=2, mtp_loss_scaling_factor=0.5, seed=2) + \
    ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
TIED = [a for a in ARGV if a != "--untie-embeddings-and-output-weights"]
MOE = with_flags(ARGV, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff="1e-2",
                 moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)   # the depths: MoE too
REFERENCE = {id(ARGV): "untied", id(TIED): "tied", id(MOE): "moe"}
# the default suite; tests/distributed/test_deepseek_layouts.py runs MTP at TP2+SP, PP2, CP2 and ZeRO-3 too
LAYOUTS = {"pp2-tied": (TIED, ["--pipeline-model-parallel-size", "2"]),
           "cp2": (ARGV, ["--context-parallel-size", "2"]),
           "ep2-moe": (MOE, ["--expert-model-parallel-size", "2"]),
           "dp2-fsdp2-recompute": (ARGV, ["--use-torch-fsdp2", "--recompute-granularity", "full",
                                          "--recompute-method", "uniform"])}
SLOW_LAYOUTS = {"tp2-sp": (ARGV, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                "pp2": (ARGV, ["--pipeline-model-parallel-size", "2"]),
                "dp2-zero1": (ARGV, ["--use-distributed-optimizer"]),
                "dp2-zero3": (ARGV, ["--data-parallel-sharding-strategy", "optim_grads_params"])}
NAMES = ("lm loss", "mtp_1 loss", "mtp_2 loss")


def logged(stdout: str) -> dict[int, tuple[float, ...]]:
    """iteration -> (lm loss, mtp_1 loss, mtp_2 loss) from the log lines."""
    out = {}
    for line in stdout.splitlines():
        it = re.search(r"iteration\s+(\d+)\s*/", line)
        if it and "lm loss:" in line:
            out[int(it.group(1))] = tuple(float(line.split(f" {name}: ")[1].split(" |")[0]) for name in NAMES)
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The single-process runs' losses; the untied one's metrics file holds the same MTP losses."""
    metrics = tmp_path_factory.mktemp("metrics") / "metrics.jsonl"
    untied = logged(run_in_process(ARGV + ["--metrics-file", str(metrics)])[1])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == sorted(untied)
    for record in records:                  # the log line prints 7 significant digits
        assert tuple(record[name] for name in NAMES) == pytest.approx(untied[record["iteration"]], rel=1e-6)
    return {"untied": untied, "tied": logged(run_in_process(TIED)[1]), "moe": logged(run_in_process(MOE)[1])}


def assert_same(losses: dict, reference: dict, what: str) -> None:
    assert sorted(losses) == sorted(reference), (what, losses)
    for it, values in reference.items():
        assert losses[it] == pytest.approx(values, rel=1e-5), (what, it)


def test_the_mtp_term_moves_the_weights(references):
    plain = logged(run_in_process(with_flags(ARGV, mtp_loss_scaling_factor=0.0))[1])
    reference = references["untied"]
    assert plain[1] == reference[1]                  # iteration 1: the same forward, the lm loss reported
    assert abs(plain[ITERS][0] - reference[ITERS][0]) > 1e-5


@pytest.mark.parametrize("layout", sorted(LAYOUTS) + [pytest.param(name, marks=pytest.mark.slow)
                                                        for name in sorted(SLOW_LAYOUTS)])
def test_mtp_losses_equal_the_single_process_run(references, layout):
    argv, flags = {**LAYOUTS, **SLOW_LAYOUTS}[layout]
    proc = run_pretrain(2, argv + flags, timeout=300)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    assert_same(logged(proc.stdout), references[REFERENCE[id(argv)]], layout)


@pytest.mark.slow            # test_deepseek_layouts.py resumes an MTP model at another layout by default
def test_checkpoint_at_pp2_resumes_at_tp2(references, tmp_path):
    save = ["--save", str(tmp_path), "--exit-interval", "2"]       # stops (and saves) after iteration 2
    first = run_pretrain(2, ARGV + save + ["--pipeline-model-parallel-size", "2"], timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_pretrain(2, ARGV + ["--load", str(tmp_path), "--tensor-model-parallel-size", "2"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = logged(resumed.stdout)
    assert sorted(losses) == [ITERS]
    assert losses[ITERS] == pytest.approx(references["untied"][ITERS], rel=1e-5)
