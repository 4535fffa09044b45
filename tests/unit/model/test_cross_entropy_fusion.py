"""--cross-entropy-loss-fusion: the chunked loss equals the unfused one, in the model too, and its peak
memory is far below it."""

import os
import sys

import pytest
import torch

from megalite.train.command_line import parse_args
from megalite_test_utils import ROOT, TINY_LLAMA_ARGS, masked_micro_batches, with_flags


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_chunked_cross_entropy_equals_unfused(dtype, chunk):
    from megalite.model.gpt import mask_padded_vocabulary
    from megalite.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(7, 3, 96, generator=g)).to(dtype)
    mask_padded_vocabulary(logits, 0, 90)                  # padding ids at -inf, as the model does
    target = torch.randint(0, 90, (7, 3), generator=g)
    weights = torch.randn(7, 3, generator=g)
    outs = []
    for fused in (False, True):
        x = logits.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(x, target, None, 0, fused=fused, chunk_tokens=chunk)
        (loss * weights).sum().backward()
        assert loss.dtype == torch.float32 and x.grad.dtype == dtype
        outs.append((loss, x.grad.float()))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)


def test_model_with_cross_entropy_loss_fusion_gives_the_same_loss_and_gradients():
    from megalite.model.gpt import GPTModel
    batch = masked_micro_batches()[0]
    results = []
    for fusion in (False, True):
        config = parse_args(with_flags(TINY_LLAMA_ARGS, cross_entropy_loss_fusion=fusion), world_size=1)
        model = GPTModel(config.model, seed=1)
        loss = model(batch["tokens"], batch["position_ids"], labels=batch["labels"]).mean()
        loss.backward()
        results.append((loss, [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0])
    for fused, plain in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-7)


def test_chunked_cross_entropy_peak_memory_is_a_fraction_of_unfused():
    """bf16 logits [tokens, V]: unfused holds fp32 copies of the whole (upcast, log-softmax, gradient),
    at least 4x the logits' bytes; chunked holds the bf16 gradient and a few fp32 chunks."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from cross_entropy_memory import cross_entropy_memory
    tokens, vocab, chunk = 256, 4096, 32
    r = cross_entropy_memory(tokens, vocab, torch.bfloat16, chunk_tokens=chunk)
    chunk_fp32 = chunk * vocab * 4
    assert r["unfused peak bytes"] >= 4 * r["logits bytes"]
    assert r["fused peak bytes"] <= r["logits bytes"] + 4 * chunk_fp32 + 64 * tokens
    assert r["saved bytes"] > 0.5 * r["unfused peak bytes"]
