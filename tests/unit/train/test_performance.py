"""Throughput, MFU and memory figures (megalite/train/performance.py)."""
import json
import subprocess
import sys
from unittest import mock

import pytest
import torch

from megalite_test_utils import ROOT, TINY_GPT2_ARGS, TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.model.gpt import GPTModel
from megalite.train.performance import (Throughput, matmul_parameters, model_flops_per_token,
                                  peak_flops_per_device)


def _matmul_weights_of(model: GPTModel, config) -> int:
    """Count the built model's 2-D weights, leaving out the input embeddings (PaLM's N)."""
    total = 0
    for name, p in model.named_parameters():
        if p.dim() == 2 and "embedding" not in name:
            total += p.numel()
    tied = not config.untie_embeddings_and_output_weights
    return total + (config.padded_vocab_size * config.hidden_size if tied else 0)


@pytest.mark.parametrize("base", [TINY_LLAMA_ARGS, TINY_GPT2_ARGS], ids=["llama-gqa-untied", "gpt2-tied"])
def test_matmul_parameters_match_the_built_model(base):
    config = parse_args(base, world_size=1).model
    model = GPTModel(config)
    assert matmul_parameters(config) == _matmul_weights_of(model, config)


def test_model_flops_per_token_is_palms_formula():
    config = parse_args(with_flags(TINY_LLAMA_ARGS, seq_length=64, max_position_embeddings=64), world_size=1).model
    N, L, h, s = matmul_parameters(config), config.num_layers, config.hidden_size, config.seq_length
    assert model_flops_per_token(config) == 6 * N + 12 * L * h * s


def test_throughput_rates_and_mfu():
    config = parse_args(TINY_LLAMA_ARGS, world_size=1).model
    rates = Throughput(config, global_batch_size=8, world_size=4, peak_flops=1e12).rates(seconds_per_iteration=0.5)
    tokens = 8 * config.seq_length / 0.5
    assert rates["tokens per second"] == tokens and rates["tokens per second per device"] == tokens / 4
    assert rates["MFU"] == pytest.approx(tokens / 4 * model_flops_per_token(config) / 1e12)
    assert "MFU" not in Throughput(config, 8, 4, None).rates(0.5)


def test_peak_flops_from_the_flag_the_gpu_table_or_none():
    cpu = torch.device("cpu")
    assert peak_flops_per_device(5e11, cpu) == (5e11, "--peak-flops")
    peak, why = peak_flops_per_device(None, cpu)
    assert peak is None and "--peak-flops" in why
    cuda = torch.device("cuda", 0)
    for name, expected in [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                           ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA H200", 989e12), ("NVIDIA A10G", 70e12)]:
        with mock.patch("torch.cuda.get_device_name", return_value=name):
            assert peak_flops_per_device(None, cuda)[0] == expected, name
    with mock.patch("torch.cuda.get_device_name", return_value="Mystery Accelerator 9000"):
        peak, why = peak_flops_per_device(None, cuda)
    assert peak is None and "--peak-flops" in why


def test_cpu_memory_is_rss_and_grows_with_a_big_allocation():
    """In a fresh process: in this one, earlier tests' freed memory may be reused without new pages."""
    script = """
import json, torch
from megalite.train.performance import memory_usage
before = memory_usage(torch.device("cpu"))
block = torch.ones(64 * 2**20 // 4)          # 64 MB, touched
print(json.dumps([before, memory_usage(torch.device("cpu"))]))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    before, after = json.loads(out)
    assert after["rss"] - before["rss"] > 60 and after["max rss"] >= after["rss"]


def test_moe_layers_count_the_flops_their_tokens_run():
    """k experts of ffn/k hidden units run what the dense MLP runs; the router adds 2 h E per token and MoE
    layer (--moe-layer-freq 2: layers 1 and 3 of 4), forward and backward."""
    from megalite.train.performance import flops_per_iteration
    dense = parse_args(with_flags(TINY_LLAMA_ARGS, num_layers=4), world_size=1).model
    moe = parse_args(with_flags(TINY_LLAMA_ARGS, num_layers=4, num_experts=8, moe_router_topk=2,
                                moe_ffn_hidden_size=dense.ffn_hidden_size // 2, moe_layer_freq=2), world_size=1).model
    tokens = 3 * moe.seq_length
    router = 3.0 * 2 * moe.hidden_size * 8 * 2 * tokens
    assert flops_per_iteration(moe, 3) == pytest.approx(flops_per_iteration(dense, 3) + router)
