"""The MoE figures of the log (train/metrics.py's MoEStats) against a hand computation, and the memory
report's expert share (train/performance.py).

Forward hooks on the routers record each training forward's input; the test recomputes from it, in
float64 and with the formulas of the papers (Switch / GShard auxiliary loss, ST-MoE z-loss, DeepSeek-V3
expert-bias update), each layer's losses, its tokens per expert and its bias, and averages them the way
the log promises: per micro-batch and MoE layer over the interval's steps."""
import json
import re

import pytest
import torch

from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.parallel.param_meta import param_meta
from megalite.train.performance import gather_memory
from megalite.train.trainer import build_trainer

MOE_ARGS = with_flags(TINY_LLAMA_ARGS, num_layers=3, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32,
                      moe_layer_freq="[1,0,1]", train_iters=4, log_interval=2)
AUX, Z = 1e-2, 1e-3


@pytest.fixture(autouse=True)
def one_thread():
    """The matmuls are tiny: a second thread only adds synchronisation (and the suite runs two workers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hand_routing(router, x: torch.Tensor, bias: torch.Tensor | None):
    """(tokens per expert [E], auxiliary loss, z-loss) of one forward on x [T, h], in float64."""
    c, E, k = router.config, router.num_experts, router.topk
    logits = x.detach().double() @ router.weight.detach().double().t()
    if c.moe_router_score_function == "sigmoid":
        sig = torch.sigmoid(logits)
        experts = torch.topk(sig if bias is None else sig + bias.double(), k).indices
        scores = sig / sig.sum(-1, keepdim=True)
    else:
        experts = torch.topk(logits, k).indices
        scores = torch.softmax(logits, -1)
    counts = torch.zeros(E, dtype=torch.float64).index_add_(0, experts.flatten(), torch.ones(experts.numel(),
                                                                                             dtype=torch.float64))
    T = logits.shape[0]
    aux = (scores.sum(0) * counts).sum() * (c.moe_aux_loss_coeff or 0.0) * E / (k * T * T)
    z = torch.logsumexp(logits, -1).square().mean() * (c.moe_z_loss_coeff or 0.0)
    return counts, float(aux), float(z)


def run_recorded(argv: list[str], tmp_path):
    """Train with every router watched: (log lines, JSONL records, per step {layer: [(counts, aux, z) per
    micro-batch]}, {layer: its bias after each step})."""
    metrics = tmp_path / "metrics.jsonl"
    lines = []
    trainer = build_trainer(parse_args(argv + ["--metrics-file", str(metrics)], world_size=1), lines.append)
    per_layer, biases = {}, {}
    for chunk in trainer.chunks:
        moe_layers = [l for l in chunk.decoder.layers if chunk.config.is_moe_layer(l.layer_number)]
        for layer, router in zip(moe_layers, chunk.moe_routers()):
            watch(router, layer.layer_number - 1, per_layer, biases)
    trainer.train()
    records = [json.loads(line) for line in open(metrics)]
    steps = [{index: forwards[i] for index, forwards in per_layer.items()} for i in range(len(per_layer[0]) - 1)]
    return [l for l in lines if " iteration " in l], records, steps, biases


def watch(router, index: int, per_layer: dict, biases: dict) -> None:
    """Record each training forward's hand computation, and the bias after each step's update."""
    per_layer[index] = [[]]

    def record(module, args, _output):
        if module.training:
            bias = None if module.expert_bias is None else module.expert_bias.clone()
            per_layer[index][-1].append(hand_routing(module, args[0], bias))
    router.register_forward_hook(record)
    finish = router.finish_step

    def finish_step(load):
        finish(load)
        per_layer[index].append([])
        if router.expert_bias is not None:
            biases.setdefault(index, []).append(router.expert_bias.clone())
    router.finish_step = finish_step


def interval_loss(steps: list[dict], column: int) -> float:
    """Per MoE layer the mean over the steps' micro-batches, then the mean over the layers."""
    layers = sorted(steps[0])
    per_layer = [sum(mb[column] for step in steps for mb in step[i]) / sum(len(step[i]) for step in steps)
                 for i in layers]
    return sum(per_layer) / len(per_layer)


def spread(step: dict, layer: int) -> float:
    counts = sum(mb[0] for mb in step[layer])
    return float(counts.max() / counts.mean())


def test_log_and_jsonl_carry_the_losses_and_load_of_a_hand_computation(tmp_path):
    argv = with_flags(MOE_ARGS, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=AUX,
                      moe_z_loss_coeff=Z)
    lines, records, steps, _ = run_recorded(argv, tmp_path)
    assert [r["iteration"] for r in records] == [2, 4] and len(lines) == 2 and len(steps) == 4
    assert all(sorted(step) == [0, 2] and all(len(mbs) == 2 for mbs in step.values()) for step in steps)
    for record, line, interval in zip(records, lines, (steps[:2], steps[2:])):
        assert record["load_balancing_loss"] == pytest.approx(interval_loss(interval, 1), rel=1e-5)
        assert record["z_loss"] == pytest.approx(interval_loss(interval, 2), rel=1e-5)
        assert f" load_balancing_loss: {record['load_balancing_loss']:.6E} |" in line
        assert f" z_loss: {record['z_loss']:.6E} |" in line
        figures = {key for key in record if key.startswith("moe/")}
        assert figures == {"moe/layer0/load_max_over_mean", "moe/layer2/load_max_over_mean"}   # layer 1 is dense
        for layer in (0, 2):
            assert record[f"moe/layer{layer}/load_max_over_mean"] == pytest.approx(spread(interval[-1], layer))
        worst = max((0, 2), key=lambda layer: record[f"moe/layer{layer}/load_max_over_mean"])
        assert f" max/mean tokens per expert: {record[f'moe/layer{worst}/load_max_over_mean']:.3f} (layer{worst}) |" \
            in line
    # the aux loss is near its balanced value coeff x 1 (it is coeff x E/k x sum_e f_e P_e >= coeff)
    assert 0.9 * AUX < records[0]["load_balancing_loss"] < 3 * AUX


def test_expert_bias_range_and_no_aux_loss_keys_without_coefficients(tmp_path):
    rate = 0.01
    argv = with_flags(MOE_ARGS, moe_router_score_function="sigmoid", moe_router_load_balancing_type="none",
                      moe_router_enable_expert_bias=True, moe_router_bias_update_rate=rate, train_iters=3,
                      log_interval=1)
    lines, records, steps, biases = run_recorded(argv, tmp_path)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert not any("load_balancing_loss" in key or key == "z_loss" for r in records for key in r)
    assert not any("load_balancing_loss" in line or "z_loss" in line for line in lines)
    for layer in (0, 2):
        bias = torch.zeros(8, dtype=torch.float64)
        for step, record, kept in zip(steps, records, biases[layer]):
            counts = sum(mb[0] for mb in step[layer])
            bias += rate * torch.sign(counts.mean() - counts)            # DeepSeek-V3's update
            assert torch.allclose(kept.double(), bias, atol=1e-6)
            assert record[f"moe/layer{layer}/expert_bias_range"] == pytest.approx(float(bias.max() - bias.min()),
                                                                                abs=1e-6)
            assert record[f"moe/layer{layer}/load_max_over_mean"] == pytest.approx(spread(step, layer))
    assert records[-1]["moe/layer0/expert_bias_range"] > 0


@pytest.mark.parametrize("flags", [{}, {"bf16": True, "use_distributed_optimizer": True}])
def test_memory_report_splits_expert_state(tmp_path, flags):
    lines = []
    trainer = build_trainer(parse_args(with_flags(MOE_ARGS, **flags), world_size=1), lines.append)
    [row] = gather_memory(trainer.ddp, trainer.optimizer)
    experts = [p for p in trainer.ddp.params if param_meta(p).expert]
    assert len(experts) == 4                                          # fc1, fc2 of layers 0 and 2
    numel = sum(p.numel() for p in experts)
    assert numel == 2 * 8 * (2 * 32 * 64 + 64 * 32)
    itemsize = 2 if flags else 4
    assert row["expert parameters"] == numel * itemsize == sum(p.numel() * p.element_size() for p in experts)
    assert row["expert gradients"] == numel * 4                       # fp32 main grads
    per_element = 12 if flags else 8                                   # Adam m, v (+ fp32 master for bf16)
    assert row["expert optimizer"] == pytest.approx(per_element * numel, abs=64)
    assert row["expert theoretical"] == per_element * numel
    dense = sum(p.numel() for p in trainer.ddp.params) - numel
    assert row["theoretical"] - row["expert theoretical"] == per_element * dense
    assert row["parameters"] - row["expert parameters"] >= dense * itemsize


def test_params_norm_and_num_zeros_count_the_expert_weights():
    """--log-params-norm / --log-num-zeros-in-grad count the expert weights (a norm class of their own);
    the norm against float64 (fp32 sums of squares differ in the last digits by summation order)."""
    from megalite.train.loop import optional_norms
    from megalite.train.step import train_step
    from megalite_test_utils import masked_micro_batches
    argv = with_flags(MOE_ARGS, log_params_norm=True, log_num_zeros_in_grad=True)
    trainer = build_trainer(parse_args(argv, world_size=1))
    train_step(trainer, iter(masked_micro_batches()[:2]))
    with torch.no_grad():                         # zeros the dense weights cannot have: two experts' fc2
        trainer.chunks[0].decoder.layers[0].mlp.experts.linear_fc2.weight.main_grad[:2] = 0.0
    norms = optional_norms(trainer)
    params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    assert norms["params norm"] == pytest.approx(float(params.double().norm()), rel=1e-6)
    assert norms["num zeros"] == float((trainer.buffer.grad_data == 0).sum())
    assert norms["num zeros"] >= 2 * 64 * 32
