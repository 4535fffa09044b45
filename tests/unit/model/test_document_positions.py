"""GPTModel with the batch's document structure: RoPE at each sample's own positions under
--reset-position-ids (against transformers' Llama given the same position_ids), unchanged without it,
and attention kept within the documents of each sample's cu_seqlens (against each document alone)."""
from dataclasses import replace

import pytest
import torch

from megalite.model.gpt import GPTModel
from megalite_test_utils import TINY_LLAMA_ARGS
from unit.model.test_gpt_model import copy_llama_weights, model_config

transformers = pytest.importorskip("transformers")
VOCAB = 201
# two samples of 32 tokens that pack different documents: [0, 12), [12, 32) and [0, 5), [5, 9), [9, 32)
CU_SEQLENS = torch.tensor([[0, 12, 32, 32], [0, 5, 9, 32]], dtype=torch.int32)


def reset_positions(cu_seqlens: torch.Tensor, s: int) -> torch.Tensor:
    """[b, s]: each position minus the start of its document."""
    index = torch.arange(s)
    starts = [row[torch.searchsorted(row, index, right=True) - 1] for row in cu_seqlens.long()]
    return index - torch.stack(starts)


@pytest.fixture(scope="module")
def models():
    """(transformers' tiny Llama, megalite's copy of it, megalite's copy with --reset-position-ids)."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=32)).eval()
    plain = GPTModel(model_config(TINY_LLAMA_ARGS)).eval()
    copy_llama_weights(hf, plain, nq=4, nkv=2, d=16, h=64)
    reset = GPTModel(replace(plain.config, reset_position_ids=True)).eval()
    reset.load_state_dict(plain.state_dict())
    return hf, plain, reset


def test_rope_reads_each_samples_positions_only_with_the_flag(models):
    hf, plain, reset = models
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    positions = reset_positions(CU_SEQLENS, 32)
    with torch.no_grad():
        ours = reset(tokens, positions)[..., :VOCAB]
        theirs = hf(tokens, position_ids=positions).logits
        assert torch.equal(plain(tokens, positions), plain(tokens))      # RoPE at 0..s-1 without the flag
        shared = hf(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
    assert (ours - shared).abs().max() > 1e-3            # 50x the tolerance: the positions matter


def test_documents_attend_only_within_themselves(models):
    hf, _, reset = models
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = reset(tokens, reset_positions(CU_SEQLENS, 32), cu_seqlens=CU_SEQLENS)[..., :VOCAB]
        for b, row in enumerate(CU_SEQLENS.tolist()):
            for start, end in zip(row[:-1], row[1:]):
                if end > start:
                    alone = hf(tokens[b:b + 1, start:end]).logits[0]
                    torch.testing.assert_close(ours[b, start:end], alone, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("recompute", [dict(recompute_granularity="full", recompute_method="uniform",
                                            recompute_num_layers=1),
                                       dict(recompute_granularity="full", recompute_method="block",
                                            recompute_num_layers=1),
                                       dict(recompute_granularity="selective")])
def test_recomputation_keeps_the_documents(models, recompute):
    _, _, reset = models
    recomputed = GPTModel(replace(reset.config, **recompute))
    recomputed.load_state_dict(reset.state_dict())
    g = torch.Generator().manual_seed(3)
    tokens, labels = torch.randint(0, VOCAB, (2, 32), generator=g), torch.randint(0, VOCAB, (2, 32), generator=g)
    positions = reset_positions(CU_SEQLENS, 32)
    results = []
    for model, documents in ((reset.train(), CU_SEQLENS), (recomputed.train(), CU_SEQLENS), (reset, None)):
        model.zero_grad()
        loss = model(tokens, positions, labels=labels, cu_seqlens=documents).mean()
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    reset.eval()
    (loss, grads), (again, regrads), (across, _) = results
    assert torch.equal(loss, again) and all(torch.equal(a, b) for a, b in zip(grads, regrads))
    assert (loss - across).abs() > 1e-4
