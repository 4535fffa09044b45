"""A tiny DeepSeek-V3 through pretrain_gpt.py (multi-latent attention with q-LoRA and YaRN, one MTP layer,
group-limited sigmoid routing with the expert bias and scaling, a shared expert, a dense first layer; fp32,
dropless) logs the serial run's losses, MTP losses and gradient norms at every layout, and a checkpoint
saved at EP=4 resumes at EP=2 x PP=2 (the MTP layer and its embedding copy on the last stage)."""
import re

import pytest

from harness import run_pretrain
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

ARGV = with_flags(
    TINY_LLAMA_ARGS, num_layers=4, global_batch_size=8, train_iters=4, group_query_attention=None,
    num_query_groups=None, multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16,
    qk_pos_emb_head_dim=8, v_head_dim=12, qk_layernorm=True, rotary_scaling_factor=4, mscale=1, mscale_all_dim=1,
    mtp_num_layers=1, mtp_loss_scaling_factor="0.3", num_experts=8, moe_layer_freq="([0]+[1]*3)", moe_router_topk=2,
    moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, moe_router_num_groups=4,
    moe_router_group_topk=2, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate="0.01", moe_router_topk_scaling_factor="2.5", moe_aux_loss_coeff="1e-2",
    moe_router_load_balancing_type="seq_aux_loss", moe_token_dispatcher_type="alltoall")
SP = {"sequence_parallel": True}
LAYOUTS = {
    "tp2-sp": (2, dict(tensor_model_parallel_size=2, **SP)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "cp2": (2, dict(context_parallel_size=2)),
    "dp2-zero3": (2, dict(data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True,
                          overlap_param_gather=True)),
}
SLOW_LAYOUTS = {
    "ep2-tp2-etp1": (4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2,
                             expert_tensor_parallel_size=1, **SP)),
    "cp2-a2a": (2, dict(context_parallel_size=2, cp_comm_type="a2a")),
    "dp2-zero1": (2, dict(use_distributed_optimizer=True)),
}


def logged(stdout: str) -> dict[int, tuple[float, float, float]]:
    """iteration -> (lm loss, mtp_1 loss, grad norm) from the training log lines."""
    out = {}
    for line in stdout.splitlines():
        it = re.search(r"iteration\s+(\d+)\s*/", line)
        values = [re.search(rf"{name}:\s*([-+0-9.eE]+)", line) for name in ("lm loss", "mtp_1 loss", "grad norm")]
        if it and all(values):
            out[int(it.group(1))] = tuple(float(v.group(1)) for v in values)
    return out


def train(nproc: int, flags: dict, nccl: bool = False) -> dict:
    proc = run_pretrain(nproc, with_flags(ARGV, **flags), nccl=nccl)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return logged(proc.stdout)


@pytest.fixture(scope="module")
def serial():
    return train(1, {})


def assert_equal_runs(reference: dict, run: dict, iterations=range(1, 5)) -> None:
    assert sorted(run) == list(iterations), run
    for it in iterations:
        for what, got, expected in zip(("lm loss", "mtp_1 loss", "grad norm"), run[it], reference[it]):
            assert got == pytest.approx(expected, rel=1e-5, abs=1e-5), f"{what} at iteration {it}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deepseek_v3_layouts_equal_serial(serial, layout):
    nproc, flags = LAYOUTS[layout]
    assert_equal_runs(serial, train(nproc, flags))


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW_LAYOUTS)
def test_more_deepseek_v3_layouts_equal_serial(serial, layout):
    nproc, flags = SLOW_LAYOUTS[layout]
    assert_equal_runs(serial, train(nproc, flags))


def test_checkpoint_saved_at_ep4_resumes_at_ep2_pp2(serial, tmp_path):
    save = str(tmp_path / "ckpt")
    first = train(4, dict(expert_model_parallel_size=4, save=save, save_interval=2, exit_interval=2))
    assert_equal_runs(serial, first, iterations=range(1, 3))
    resumed = train(4, dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2, load=save))
    assert_equal_runs(serial, resumed, iterations=range(3, 5))


@pytest.mark.parametrize("flags", [
    dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, expert_tensor_parallel_size=1,
         data_parallel_sharding_strategy="optim_grads_params", **SP),
    dict(pipeline_model_parallel_size=2, context_parallel_size=2)], ids=["ep2-tp2-sp-zero3", "pp2-cp2"])
def test_deepseek_v3_under_nccl_semantics(serial, flags):
    """One stream per rank pair, posting order, blocking receives: MLA's latent gathers, the ring with
    unequal K/V head dims, the MTP stage's embedding copy and the grouped dispatch are all issued in the
    same order on every rank (the tier compares the ranks' collective logs)."""
    assert_equal_runs(serial, train(4, flags, nccl=True))
