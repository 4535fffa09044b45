"""Expert parallelism through pretrain_gpt.py: a tiny Llama-MoE (8 experts, top-2, shared expert, aux loss,
fp32, dropless) logs the serial run's losses and gradient norms at every layout that splits its experts,
with both token dispatchers, under the NCCL-semantics tier too, and a checkpoint saved at EP=4 resumes at
EP=2 x TP=2 and serially. GPT-OSS's experts (router and expert biases, the clamped quick GEGLU) do too."""
import pytest

from harness import run_pretrain
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

ARGV = with_flags(TINY_LLAMA_ARGS, num_layers=4, global_batch_size=8, train_iters=4, num_experts=8,
                  moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48,
                  moe_aux_loss_coeff="1e-2", moe_token_dispatcher_type="alltoall")
SP = {"sequence_parallel": True}
# GPT-OSS's expert shape: biases on the router and on both expert GEMMs, the clamped quick GEGLU
GPT_OSS_ARGV = with_flags(ARGV, disable_bias_linear=None, swiglu=None, quick_geglu=True, glu_linear_offset=1,
                          activation_func_clamp_value=7)

# the default suite; the NCCL-semantics runs below add EP2 x TP2 (ETP 2) with ZeRO-3 for both dispatchers and
# the checkpoint test EP4 and EP2 x TP2
LAYOUTS = {
    "ep2-tp2-etp1": (4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, expert_tensor_parallel_size=1,
                             **SP)),
    "ep2-pp2-interleaved": (4, dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2,
                                    num_layers_per_virtual_pipeline_stage=1)),
    "ep2-dp2-zero1": (4, dict(expert_model_parallel_size=2, use_distributed_optimizer=True)),
    "ep2-cp2": (4, dict(expert_model_parallel_size=2, context_parallel_size=2)),
    "ep4-allgather": (4, dict(expert_model_parallel_size=4, moe_token_dispatcher_type="allgather")),
}
SLOW_LAYOUTS = {
    "ep2": (2, dict(expert_model_parallel_size=2)),
    "ep4": (4, dict(expert_model_parallel_size=4)),
    "ep2-tp2-etp2": (4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, **SP)),
    "ep2-tp2-allgather": (4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2,
                                  moe_token_dispatcher_type="allgather", **SP)),
    "ep2-pp2-1f1b": (4, dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2)),
    "ep2-pp2-zb-h1": (4, dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2, pipeline_schedule="zb-h1")),
    "ep2-pp2-zbv": (4, dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2, pipeline_schedule="zbv")),
    "ep2-pp2-gpipe": (4, dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2, pipeline_schedule="gpipe")),
    "ep2-dp2-zero2": (4, dict(expert_model_parallel_size=2, data_parallel_sharding_strategy="optim_grads",
                              overlap_grad_reduce=True)),
    "ep2-dp2-zero3": (4, dict(expert_model_parallel_size=2, data_parallel_sharding_strategy="optim_grads_params",
                              overlap_grad_reduce=True, overlap_param_gather=True, ddp_bucket_size=3000)),
    "ep2-recompute-full": (2, dict(expert_model_parallel_size=2, recompute_granularity="full",
                                   recompute_method="uniform", recompute_num_layers=1)),
    "ep2-recompute-selective": (2, dict(expert_model_parallel_size=2, recompute_granularity="selective")),
    "ep1-etp2": (2, dict(expert_tensor_parallel_size=2)),
    "ep2-etp2-zero1": (4, dict(expert_model_parallel_size=2, expert_tensor_parallel_size=2,
                               use_distributed_optimizer=True)),
}


def logged(stdout: str) -> dict[int, tuple[float, float]]:
    """iteration -> (lm loss, grad norm) from the training log lines."""
    import re
    out = {}
    for line in stdout.splitlines():
        m = re.search(r"iteration\s+(\d+)\s*/.*lm loss:\s*([-+0-9.eE]+).*grad norm:\s*([-+0-9.eE]+)", line)
        if m:
            out[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    return out


def train(nproc: int, flags: dict, nccl: bool = False, base=ARGV) -> dict:
    proc = run_pretrain(nproc, with_flags(base, **flags), nccl=nccl)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return logged(proc.stdout)


@pytest.fixture(scope="module")
def serial():
    return train(1, {})


def assert_equal_runs(reference: dict, run: dict, iterations=range(1, 5)) -> None:
    assert sorted(run) == list(iterations), run
    for it in iterations:
        assert run[it][0] == pytest.approx(reference[it][0], rel=1e-5, abs=1e-5), f"loss at iteration {it}"
        assert run[it][1] == pytest.approx(reference[it][1], rel=1e-4), f"grad norm at iteration {it}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_layouts_equal_serial(serial, layout):
    nproc, flags = LAYOUTS[layout]
    assert_equal_runs(serial, train(nproc, flags))


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW_LAYOUTS)
def test_more_expert_parallel_layouts_equal_serial(serial, layout):
    nproc, flags = SLOW_LAYOUTS[layout]
    assert_equal_runs(serial, train(nproc, flags))


@pytest.fixture(scope="module")
def gpt_oss_serial():
    return train(1, {}, base=GPT_OSS_ARGV)


@pytest.mark.parametrize("layout", ["ep2", "ep2-tp2-etp1"])
def test_gpt_oss_experts_at_expert_parallel_layouts_equal_serial(gpt_oss_serial, layout):
    """Four steps at a non-zero learning rate equal serial only if the expert biases' gradients are summed
    over the experts' data-parallel group and the router bias's over every rank that routes tokens (DP at
    EP=2 alone, TP x SP at EP=2 x TP=2)."""
    nproc, flags = {**LAYOUTS, **SLOW_LAYOUTS}[layout]
    assert_equal_runs(gpt_oss_serial, train(nproc, flags, base=GPT_OSS_ARGV))


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_dispatchers_under_nccl_semantics(serial, dispatcher):
    """One stream per rank pair, ops in posting order, blocking receives: both dispatchers' exchanges
    are collectives every rank issues in the same order (the tier compares the ranks' logs)."""
    flags = dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, moe_token_dispatcher_type=dispatcher,
                 data_parallel_sharding_strategy="optim_grads_params", **SP)
    assert_equal_runs(serial, train(4, flags, nccl=True))


def test_checkpoint_saved_at_ep4_resumes_at_ep2_tp2_and_serially(serial, tmp_path):
    save = str(tmp_path / "ckpt")
    first = train(4, dict(expert_model_parallel_size=4, save=save, save_interval=2, exit_interval=2))
    assert sorted(first) == [1, 2]
    resumed = train(4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, load=save, **SP))
    assert_equal_runs(serial, resumed, iterations=range(3, 5))
    alone = train(1, dict(load=save))
    assert_equal_runs(serial, alone, iterations=range(3, 5))


def test_an_moe_checkpoint_into_a_dense_model_is_one_line(tmp_path):
    save = str(tmp_path / "ckpt")
    train(2, dict(expert_model_parallel_size=2, save=save, save_interval=2, exit_interval=2))
    dense = {flag: None for flag in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                                     "moe_shared_expert_intermediate_size", "moe_aux_loss_coeff",
                                     "moe_token_dispatcher_type")}
    proc = run_pretrain(1, with_flags(ARGV, load=save, **dense))
    assert proc.returncode != 0
    error = [line for line in proc.stderr.splitlines() + proc.stdout.splitlines() if "checkpoint" in line]
    assert error and "--num-experts" in error[-1], proc.stderr[-2000:]


@pytest.mark.slow
def test_sharded_checkpoint_with_expert_bias_reshards_over_pp_etp_and_zero(tmp_path):
    """Saved at EP=2 x PP=2 with ZeRO-1 (experts' optimizer state sharded over EDP), resumed at ETP=2 with
    ZeRO-3 on 2 ranks; the sigmoid router's expert bias (a buffer, moved every step) comes back too."""
    base = with_flags(ARGV, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                      moe_router_bias_update_rate="0.05")
    reference = train(1, {}, base=base)
    save = str(tmp_path / "ckpt")
    first = train(4, dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2, use_distributed_optimizer=True,
                          save=save, save_interval=2, exit_interval=2), base=base)
    assert_equal_runs(reference, first, iterations=range(1, 3))
    resumed = train(2, dict(expert_tensor_parallel_size=2, data_parallel_sharding_strategy="optim_grads_params",
                            load=save), base=base)
    assert_equal_runs(reference, resumed, iterations=range(3, 5))


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("capacity", [dict(moe_pad_expert_input_to_capacity=True), dict(moe_token_drop_policy="position")])
def test_capacity_at_ep2_data_parallel_equals_serial(dispatcher, capacity):
    """Capacity counts a rank's own tokens: at EP=2 over data-parallel ranks each rank routes whole
    micro-batches, as the single process does, so the same assignments drop."""
    base = with_flags(ARGV, moe_expert_capacity_factor="1.0", moe_token_dispatcher_type=dispatcher, **capacity)
    assert_equal_runs(train(1, {}, base=base), train(2, dict(expert_model_parallel_size=2), base=base))


def test_what_the_user_sees_at_ep2_with_default_loader_workers(serial, tmp_path):
    """pretrain_gpt.py as a user runs it (loader worker processes included): the log line carries the MoE
    figures, the JSONL has them per iteration, and tools/plot_metrics.py draws them."""
    import json
    import subprocess
    import sys
    from harness import ROOT
    metrics = tmp_path / "metrics.jsonl"
    proc = run_pretrain(2, with_flags(ARGV, num_workers=None, expert_model_parallel_size=2, metrics_file=str(metrics)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_equal_runs(serial, logged(proc.stdout))
    last = [line for line in proc.stdout.splitlines() if "iteration        4/" in line][0]
    assert "load_balancing_loss:" in last and "max/mean tokens per expert:" in last
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert all({"load_balancing_loss", "moe/layer0/load_max_over_mean", "moe/layer3/load_max_over_mean"} <= set(r)
               for r in records if "lm loss" in r)
    plots = tmp_path / "plots"
    done = subprocess.run([sys.executable, f"{ROOT}/tools/plot_metrics.py", str(metrics), "--output-dir", str(plots)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (plots / "moe_loss.png").stat().st_size > 0 and (plots / "moe_load.png").stat().st_size > 0
