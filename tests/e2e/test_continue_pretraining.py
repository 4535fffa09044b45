"""The user story: convert a Hugging Face model, continue pretraining it with pretrain_gpt.py (no model
flags: --use-checkpoint-args), and export the result back to Hugging Face."""
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
import transformers

from megalite.checkpoint.hf import hf_to_megalite, megalite_to_hf
from megalite_test_utils import ROOT
from unit.checkpoint.test_convert_checkpoint import make_hf

TRAIN_FLAGS = ["--use-checkpoint-args", "--finetune", "--mock-data", "--micro-batch-size", "2",
               "--global-batch-size", "4", "--lr", "1e-3", "--seq-length", "16", "--eval-iters", "0",
               "--num-workers", "0", "--log-interval", "1", "--attention-dropout", "0", "--hidden-dropout", "0"]


def first_batch(argv):
    """The global batch iteration 1 trains on, built by megalite's own data pipeline."""
    from megalite.config.megatron_cli import parse_args
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
