"""QK-clip (--qk-clip) through pretrain_gpt.py: a tiny Llama (GQA: 4 heads in 2 groups) whose attention
logits exceed a low --qk-clip-threshold from the first step logs other losses than without the clip, while
--log-max-attention-logit alone leaves them bit-identical; and the clipped run at TP=2, DP=2 ZeRO-1
(equal slices that cut rows) and CP=2 (under the NCCL-semantics tier: the key all-gather and the max
all-reduce are collectives every rank issues in the same order) logs the serial run's losses, gradient
norms and max attention logits. A steady step with --qk-clip, serial and at CP=2 x DP=2 ZeRO-1, still reads
only the gradient norm on the host (the recorded maxima, their all-reduce and the rescale stay on the
device; the max logit is read at log iterations only)."""
import re

import pytest

from harness import run_pretrain, run_ranks
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from test_host_syncs import ARGS as SYNC_ARGS, assert_reads, steady_reads

ARGV = with_flags(TINY_LLAMA_ARGS, lr="1e-2", global_batch_size=8, micro_batch_size=2)
CLIP = dict(qk_clip=True, qk_clip_threshold="0.05")          # the tiny model's logits start near 0.1
LAYOUTS = {"tp2": (2, dict(tensor_model_parallel_size=2), False),
           "dp2-zero1": (2, dict(use_distributed_optimizer=True), False),
           "cp2-nccl": (2, dict(context_parallel_size=2), True)}
SLOW_LAYOUTS = {"pp2": (2, dict(pipeline_model_parallel_size=2), False),
                "dp2-zero1-bucketed": (2, dict(use_distributed_optimizer=True, ddp_bucket_size=500), False),
                "dp2-zero3": (2, dict(data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True,
                                      overlap_param_gather=True, ddp_bucket_size=3000), False),
                "dp2-fsdp2": (2, dict(use_torch_fsdp2=True), False),
                "recompute-full": (1, dict(recompute_granularity="full", recompute_method="uniform",
                                           recompute_num_layers=1), False),
                "compile": (1, dict(compile=True), False)}      # the max-logit pass stays eager in the graph
MUON = dict(optimizer="muon", lr="2e-2", muon_fp32_matmul_prec="high")
MLA = dict(multi_latent_attention=True, group_query_attention=None, num_query_groups=None, q_lora_rank=16,
           kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8)


def train(nproc: int, flags: dict, nccl: bool = False, base=ARGV) -> dict[int, tuple[float, float, float | None]]:
    """iteration -> (lm loss, grad norm, max attention logit or None)."""
    proc = run_pretrain(nproc, with_flags(base, **flags), nccl=nccl)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for line in proc.stdout.splitlines():
        m = re.search(r"iteration\s+(\d+)\s*/.*lm loss:\s*([-+0-9.eE]+).*grad norm:\s*([-+0-9.eE]+)", line)
        if m:
            logit = re.search(r"max attention logit:\s*([-+0-9.eE]+)", line)
            out[int(m.group(1))] = (float(m.group(2)), float(m.group(3)), logit and float(logit.group(1)))
    assert sorted(out) == [1, 2, 3, 4], proc.stdout[-3000:]
    return out


@pytest.fixture(scope="module")
def serial():
    return train(1, CLIP)


def test_clip_changes_the_run_and_logging_alone_does_not(serial):
    plain, logged = train(1, {}), train(1, dict(log_max_attention_logit=True))
    assert all(plain[i][:2] == logged[i][:2] for i in plain), (plain, logged)       # bit-identical
    assert plain[1][2] is None and all(logged[i][2] > 0.05 for i in logged), logged
    assert serial[1][0] == plain[1][0]                  # the clip acts after the first step's update
    assert max(abs(serial[i][0] - plain[i][0]) for i in (2, 3, 4)) > 1e-4, (serial, plain)
    assert all(serial[i][2] < logged[i][2] for i in (2, 3, 4)), (serial, logged)


def assert_equal_runs(reference: dict, run: dict) -> None:
    for it in range(1, 5):
        assert run[it][0] == pytest.approx(reference[it][0], rel=1e-5, abs=1e-5), f"loss at iteration {it}"
        # the line prints both with three decimals: equal up to the last digit's rounding
        assert run[it][1] == pytest.approx(reference[it][1], abs=1.1e-3), f"grad norm at iteration {it}"
        assert run[it][2] == pytest.approx(reference[it][2], abs=1.1e-3), f"max logit at iteration {it}"


@pytest.mark.parametrize("layout", list(LAYOUTS) + [pytest.param(name, marks=pytest.mark.slow)
                                                      for name in SLOW_LAYOUTS])
def test_clipped_run_at_a_layout_equals_serial(serial, layout):
    nproc, flags, nccl = {**LAYOUTS, **SLOW_LAYOUTS}[layout]
    assert_equal_runs(serial, train(nproc, {**CLIP, **flags}, nccl=nccl))


def test_muon_clip_at_dp2_zero1_equals_serial():
    """MuonClip: Muon's whole-matrix ZeRO layout, QK-clip on its masters."""
    reference = train(1, {**CLIP, **MUON})
    assert max(abs(reference[i][0] - train(1, MUON)[i][0]) for i in (2, 3, 4)) > 1e-4
    assert_equal_runs(reference, train(2, {**CLIP, **MUON, "use_distributed_optimizer": True}))


def test_clip_with_more_tp_ranks_than_key_heads_equals_serial():
    """One key head (MQA) at TP=2: each rank holds two query heads and a copy of the key, whose clip the
    largest logit of all four heads decides."""
    mqa = dict(num_query_groups=1)
    assert_equal_runs(train(1, {**CLIP, **mqa}), train(2, {**CLIP, **mqa, "tensor_model_parallel_size": 2}))


@pytest.mark.slow
def test_mla_clip_at_tp2_and_cp2_equals_serial():
    reference = train(1, {**CLIP, **MLA})
    assert_equal_runs(reference, train(2, {**CLIP, **MLA, "tensor_model_parallel_size": 2, "sequence_parallel": True}))
    assert_equal_runs(reference, train(2, {**CLIP, **MLA, "context_parallel_size": 2}))


def test_a_clipped_step_reads_only_the_gradient_norm():
    argv = with_flags(SYNC_ARGS, bf16=True, **CLIP)
    assert_reads(steady_reads(0, 1, argv), 1)
    for per_iteration in run_ranks(4, steady_reads, with_flags(argv, context_parallel_size=2,
                                                               use_distributed_optimizer=True)):
        assert_reads(per_iteration, 1)
