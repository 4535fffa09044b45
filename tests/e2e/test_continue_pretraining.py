"""The user story: convert a Hugging Face model, continue pretraining it with pretrain_gpt.py (no model
flags: --use-checkpoint-args), and export the result back to Hugging Face; a dense Llama, and a
Qwen3-MoE (QK-norm, a dense first layer) in one process and with its experts split over 2 ranks."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers

from harness import logged_losses, run_pretrain
from megalite.checkpoint.hf import hf_to_megalite, megalite_to_hf
from megalite_test_utils import ROOT
from safetensors.torch import load_file
from unit.checkpoint.test_convert_checkpoint import make_hf, randomise_biases_and_norms, save_tokenizer

TRAIN_FLAGS = ["--use-checkpoint-args", "--finetune", "--mock-data", "--micro-batch-size", "2",
               "--global-batch-size", "4", "--lr", "1e-3", "--seq-length", "16", "--eval-iters", "0",
               "--num-workers", "0", "--log-interval", "1", "--attention-dropout", "0", "--hidden-dropout", "0"]


def first_batch(argv):
    """The global batch iteration 1 trains on, built by megalite's own data pipeline."""
    from megalite.train.command_line import parse_args
    from megalite.data.builder import build_train_valid_test_datasets
    from megalite.data.tokenizers import build_tokenizer
    config = parse_args(argv, world_size=1)
    train, _, _ = build_train_valid_test_datasets(config.data, build_tokenizer(config.data), (4, 0, 0),
                                                  config.training.seed)
    return [train[i] for i in range(4)]


def test_continue_pretraining_a_converted_model_and_export_it_back(tmp_path):
    hf_dir, ckpt, out, hf_out = (str(tmp_path / n) for n in ("hf", "ckpt", "out", "hf_out"))
    hf_model = make_hf(hf_dir, "llama_gqa_tied")
    hf_to_megalite(hf_dir, ckpt)
    argv = TRAIN_FLAGS + ["--load", ckpt, "--train-iters", "2", "--save", out]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    first_loss = float(proc.stdout.split("lm loss:")[1].split("|")[0])

    # iteration 1's loss is computed before any update: it must be the HF model's loss on that batch
    samples = first_batch(argv)
    tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long()
    labels = torch.stack([torch.as_tensor(s["labels"]) for s in samples]).long()
    with torch.no_grad():
        expected = F.cross_entropy(hf_model(tokens).logits.flatten(0, 1), labels.flatten()).item()
    assert abs(first_loss - expected) <= 1e-5 * expected, (first_loss, expected)

    megalite_to_hf(out, hf_out)
    trained = transformers.AutoModelForCausalLM.from_pretrained(hf_out).eval()
    assert type(trained) is type(hf_model) and trained.config.tie_word_embeddings
    assert os.path.exists(os.path.join(hf_out, "tokenizer.json"))
    with torch.no_grad():
        moved = (trained.model.embed_tokens.weight - hf_model.model.embed_tokens.weight).abs().max()
    assert 0 < moved < 0.1                  # two small steps away from the original weights


def make_qwen3_moe(directory):
    """A tiny Qwen3-MoE: 4 experts, top-2, layer 0 dense (mlp_only_layers), QK-norm, with a tokenizer."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    randomise_biases_and_norms(model)
    model.save_pretrained(directory)
    save_tokenizer(directory)
    return model


def test_continue_pretraining_a_converted_moe_model_with_and_without_expert_parallelism(tmp_path):
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    hf_model = make_qwen3_moe(hf_dir)
    hf_to_megalite(hf_dir, ckpt)
    argv = TRAIN_FLAGS + ["--load", ckpt, "--train-iters", "2"]
    samples = first_batch(argv)
    tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long()
    labels = torch.stack([torch.as_tensor(s["labels"]) for s in samples]).long()
    with torch.no_grad():
        expected = F.cross_entropy(hf_model(tokens).logits.flatten(0, 1), labels.flatten()).item()
    exported = {}
    for ranks, extra in ((1, []), (2, ["--expert-model-parallel-size", "2"])):    # EP=2: 2 experts per rank
        out, hf_out = str(tmp_path / f"out{ranks}"), str(tmp_path / f"hf_out{ranks}")
        proc = run_pretrain(ranks, argv + ["--save", out] + extra, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        first_loss = logged_losses(proc.stdout)[1]      # before any update: the HF model's loss on that batch
        assert abs(first_loss - expected) <= 1e-5 * expected, (ranks, first_loss, expected)
        megalite_to_hf(out, hf_out)
        trained = transformers.AutoModelForCausalLM.from_pretrained(hf_out).eval()
        assert type(trained) is type(hf_model)
        exported[ranks] = load_file(os.path.join(hf_out, "model.safetensors"))
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    single, expert_parallel = exported[1], exported[2]
    assert sorted(single) == sorted(original) == sorted(expert_parallel)
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.3.down_proj.weight",
                 "model.layers.1.self_attn.q_norm.weight", "model.layers.0.mlp.up_proj.weight"):
        assert 0 < (single[name] - original[name]).abs().max() < 0.1, name     # two small steps
    # the same global batches: the expert-parallel run trains the same weights
    assert all(torch.allclose(single[n], expert_parallel[n], atol=1e-5, rtol=0) for n in single), \
        [n for n in single if not torch.allclose(single[n], expert_parallel[n], atol=1e-5, rtol=0)][:3]
